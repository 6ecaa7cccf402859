"""The CPU shims for megatron-core: every patched target still exists, each patch took effect, and a forward
needs each of them (revert one and the forward fails with the error it fixes). A megatron upgrade that moves or
renames a target fails here, loudly, instead of deep inside a training step."""

import importlib

import pytest
import torch

from study.model_config import preset
from study.policy import compat as megatron_compat
from study.policy.model import build_policy, token_logp

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are CPU-only")


def _owner(path: str):
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:  # a class inside a module
        module, _, cls = path.rpartition(".")
        return getattr(importlib.import_module(module), cls)


@pytest.fixture(scope="module")
def model():
    # megatron's own core attention: its masked softmax needs the causal-mask shim and its attention dropout the RNG
    # tracker's; the policy's default SDPA attention needs neither, and megatron falls back to it for what SDPA
    # cannot express (packed sequences, dropout in training)
    return build_policy(preset("tiny"), seed=0, layers="megatron")


def _forward(model) -> torch.Tensor:
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    return token_logp(model, ids[:, :-1], ids[:, 1:])


def test_apply_is_idempotent_and_active():
    assert megatron_compat.apply() is True
    patched = torch.cuda.current_device
    assert megatron_compat.apply() is True
    assert torch.cuda.current_device is patched
    assert megatron_compat.applied()


def test_every_target_exists_and_is_patched():
    megatron_compat.apply()
    assert {k for k in megatron_compat.ORIGINALS} == set(megatron_compat.SHIMS)
    for owner_path, attr in megatron_compat.SHIMS:
        owner = _owner(owner_path)
        assert hasattr(owner, attr), f"{owner_path}.{attr} vanished: megatron changed, revisit the shim"
        value = getattr(owner, attr)
        if attr == "te_general_gemm":
            assert value is None
        else:
            assert megatron_compat.is_shim(value), f"{owner_path}.{attr} is not the CPU shim"
        original = megatron_compat.ORIGINALS[(owner_path, attr)]
        if attr != "te_general_gemm":
            assert original is not megatron_compat.MISSING, f"megatron no longer defines {owner_path}.{attr}"


def test_te_general_gemm_is_undefined_without_transformer_engine():
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.HAVE_TE is False
    assert megatron_compat.ORIGINALS[("megatron.core.transformer.moe.moe_utils", "te_general_gemm")] is (
        megatron_compat.MISSING
    )


def test_forward_works_with_the_shims(model):
    from megatron.core.fusions import fused_softmax

    logp = _forward(model)
    assert logp.shape == (2, 8) and torch.isfinite(logp).all()
    sdpa = build_policy(preset("tiny"), seed=0)  # the same weights (same seed), the policy's SDPA core attention
    assert (_forward(sdpa) - logp).abs().max() <= 1e-5
    assert fused_softmax.get_default_causal_mask(4).device == torch.device("cpu")
    assert torch.cuda.current_device() == torch.device("cpu")


def _revert(monkeypatch, owner_path: str, attr: str) -> None:
    owner = _owner(owner_path)
    original = megatron_compat.ORIGINALS[(owner_path, attr)]
    if original is megatron_compat.MISSING:
        monkeypatch.delattr(owner, attr)
    else:
        monkeypatch.setattr(owner, attr, original)


@pytest.mark.parametrize(
    ("targets", "error"),
    [
        ([("torch.cuda", "current_device")], AssertionError),  # Torch not compiled with CUDA enabled
        ([("megatron.core.tensor_parallel.random", "_get_cuda_rng_state")], (AssertionError, RuntimeError)),
        (
            [
                ("megatron.core.transformer.utils", "get_default_causal_mask"),
                ("megatron.core.fusions.fused_softmax", "get_default_causal_mask"),
            ],
            (AssertionError, RuntimeError),
        ),
        ([("megatron.core.transformer.moe.moe_utils", "te_general_gemm")], NameError),
    ],
    ids=["current_device", "rng_tracker_fork", "causal_mask", "te_general_gemm"],
)
def test_forward_fails_without_each_shim(model, monkeypatch, targets, error):
    for owner_path, attr in targets:
        _revert(monkeypatch, owner_path, attr)
    with pytest.raises(error):
        _forward(model)


def test_rng_tracker_seeding_needs_the_shim(monkeypatch):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123, force_reset_rng=True)  # patched: works
    with monkeypatch.context() as patch:
        _revert(patch, "megatron.core.tensor_parallel.random.CudaRNGStatesTracker", "add")
        with pytest.raises((AssertionError, RuntimeError)):
            model_parallel_cuda_manual_seed(123, force_reset_rng=True)
    model_parallel_cuda_manual_seed(123, force_reset_rng=True)  # leave a seeded tracker for later tests
