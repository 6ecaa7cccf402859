"""The CPU shims for megatron-core: every patched target still exists, each patch took effect, and a forward
needs each of them (revert one and the forward fails with the error it fixes). A megatron upgrade that moves or
renames a target fails here, loudly, instead of deep inside a training step."""

import importlib

import pytest
import torch

from study.core.model_config import preset
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


# megatron's optimizer (point 6) ---------------------------------------------------------------------------------------
def _megatron_update(dtype: str, distributed: bool) -> dict:
    """One update of the tiny policy (one process) through study.policy.parallel.ShardedTrainer, i.e. megatron's DDP
    and `get_megatron_optimizer`."""
    from study.core.model_config import ParallelLayout
    from study.policy.parallel import ShardedTrainer

    model = build_policy(preset("tiny"), seed=0, routing_replay=False, dtype=dtype, parallel=ParallelLayout())
    trainer = ShardedTrainer(model, lr=1e-3, grad_clip=0.5, distributed_optimizer=distributed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.zero_grad()
    _forward(model).float().mean().backward()
    trainer.reduce()
    want = float(torch.stack([p.main_grad.double().norm() for p in model.parameters()]).norm())
    trainer.reduce = lambda: None  # reduced: step() clips and steps
    stepped, norm = trainer.step()
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in model.named_parameters())
    kinds = {type(o).__name__ for o in trainer.optimizer.chained_optimizers}
    mains = {
        p.dtype for o in trainer.optimizer.chained_optimizers for g in o.optimizer.param_groups for p in g["params"]
    }
    return {
        "stepped": stepped,
        "norm": norm,
        "want": want,
        "moved": moved,
        "kinds": kinds,
        "mains": mains,
        "numel": sum(p.numel() for p in model.parameters()),
    }


@pytest.mark.parametrize(
    ("dtype", "distributed", "kind"),
    [
        ("fp32", False, "FP32Optimizer"),
        ("bf16", False, "Float16OptimizerWithFloat16Params"),
        ("fp32", True, "DistributedOptimizer"),
        ("bf16", True, "DistributedOptimizer"),
    ],
)
def test_megatron_optimizer_steps_on_cpu(dtype, distributed, kind):
    got = _megatron_update(dtype, distributed)
    assert got["kinds"] == {kind}
    assert got["mains"] == {torch.float32}  # fp32 main parameters for bf16 weights
    assert got["stepped"] and got["norm"] == pytest.approx(got["want"], rel=1e-5)  # clipped: 0.5 < the norm
    assert got["norm"] > 0.5 and got["moved"] > 0.5 * got["numel"]


@pytest.mark.parametrize(
    ("target", "dtype", "distributed", "error"),
    [
        (("megatron.core.optimizer.optimizer", "torch"), "fp32", False, AssertionError),  # not compiled with CUDA
        (("megatron.core.optimizer.clip_grads", "torch"), "fp32", False, AssertionError),
        (("megatron.core.optimizer.clip_grads", "l2_norm_impl"), "fp32", False, AssertionError),
        (("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"), "fp32", False, AssertionError),
        (("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params", "__init__"), "bf16", False, TypeError),
        (("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "__init__"), "fp32", True, TypeError),
    ],
    ids=["optimizer_scalars", "clip_scalars", "l2_norm", "clip_type_check", "float16_type_check", "distributed"],
)
def test_megatron_optimizer_fails_without_each_shim(monkeypatch, target, dtype, distributed, error):
    _revert(monkeypatch, *target)
    with pytest.raises(error):
        _megatron_update(dtype, distributed)


# dist_checkpointing and loading into torch's Adam (points 7 and 8) --------------------------------------------------
def _save_and_load(tmp_path) -> list:
    """One process: an update through megatron's distributed optimizer, saved with dist_checkpointing and loaded
    into a fresh policy's; the loaded optimizer's per-weight step tensors."""
    from study.core.model_config import ParallelLayout
    from study.policy import parallel as P

    def trainer(seed: int):
        model = build_policy(preset("tiny"), seed=seed, routing_replay=False, parallel=ParallelLayout())
        return model, P.ShardedTrainer(model, lr=1e-3, grad_clip=0.5)

    model, saving = trainer(0)
    saving.zero_grad()
    _forward(model).float().mean().backward()
    saving.step()
    P.save_distributed(saving, tmp_path / "ckpt")
    _, loading = trainer(1)
    P.load_distributed(loading, tmp_path / "ckpt")
    return [s["step"] for o in loading.optimizer.chained_optimizers for s in o.optimizer.state.values()]


def test_distributed_checkpoint_round_trip_with_the_shims(tmp_path):
    steps = _save_and_load(tmp_path)
    assert len(steps) > 1 and all(float(s) == 1 for s in steps)
    assert len({id(s) for s in steps}) == len(steps)  # each weight its own step tensor


@pytest.mark.parametrize(
    ("target", "error"),
    [
        (
            ("megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync", "preload_tensors"),
            AssertionError,
        ),  # torch.cuda.synchronize(): not compiled with CUDA
        (
            ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "_set_main_param_and_optimizer_states"),
            KeyError,
        ),  # 'step'
    ],
    ids=["staging_sync", "torch_adam_step"],
)
def test_distributed_checkpoint_fails_without_each_shim(tmp_path, monkeypatch, target, error):
    _revert(monkeypatch, *target)
    with pytest.raises(error):
        _save_and_load(tmp_path)


def test_loaded_steps_are_shared_without_the_shim(tmp_path, monkeypatch):
    _revert(monkeypatch, "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "load_state_dict")
    steps = _save_and_load(tmp_path)
    assert len({id(s) for s in steps}) < len(steps)  # one tensor for many weights: torch's Adam adds 1 per weight


def test_a_destroyed_world_leaves_no_stale_megatron_groups():
    # an in-process vLLM engine's shutdown destroys torch's default group under megatron's parallel state; the next
    # init_distributed must rebuild megatron's groups for the new world, not hand out the destroyed ones
    from megatron.core import parallel_state as ps

    from study.policy.model import init_distributed

    init_distributed()
    torch.distributed.destroy_process_group()
    assert ps.model_parallel_is_initialized()  # megatron does not notice
    init_distributed()
    assert torch.distributed.get_process_group_ranks(ps.get_data_parallel_group()) == [0]


CUDA_BRANCH = r"""
import torch

cuda_available = torch.cuda.is_available
torch.cuda.is_available = lambda: True  # the device decision sees a GPU
from megatron.core.transformer.moe import moe_utils

from study.policy import compat

assert compat.apply() is False, "the CUDA branch makes no CPU stand-ins"
assert not compat.applied()
# the router's gating GEMM, as every MoE forward on a GPU without TransformerEngine runs it (on CPU tensors)
x = torch.randn(6, 16, requires_grad=True)
w = torch.randn(4, 16, requires_grad=True)
moe_utils.router_gating_linear(x, w, None, torch.float32).sum().backward()
assert x.grad is not None and w.grad is not None

# the whole policy on CPU tensors: the device stand-ins (and only those) in place of a GPU, the rest as on CUDA
torch.cuda.is_available = cuda_available
compat._patch_current_device()
compat._patch_rng_tracker()
compat._patch_causal_masks()
assert compat.apply() is False, "the device is decided once per process"
from study.core.model_config import preset
from study.policy.model import build_policy, token_logp

for layers in ("fast", "megatron"):
    model = build_policy(preset("tiny"), seed=0, layers=layers)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    logp = token_logp(model, ids[:, :-1], ids[:, 1:])  # (2, 8)
    logp.sum().backward()
    assert torch.isfinite(logp).all()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
print("cuda-branch-ok")
"""


def test_the_cuda_branch_runs_the_policy_without_transformer_engine():
    """On CUDA the local spec runs without TransformerEngine: the names megatron leaves undefined then (the router's
    `te_general_gemm`) are defined on every device, not only by the CPU stand-ins."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CUDA_BRANCH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cuda-branch-ok" in out.stdout
