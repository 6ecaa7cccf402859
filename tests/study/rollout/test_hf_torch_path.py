"""The hf engine's decode path on CUDA, run on the CPU: the torch ops (`_FusedDecoder`, what `STUDY_NATIVE=0`
selects here and what a GPU always takes) against the C path, the experts as every transformers of the pin builds
them, and the experts' dispatch a GPU gets for each dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from study.core import weights as W
from study.rollout import hf
from study.rollout.hf import HFEngine
from tests.study.rollout.conftest import CFG, build_megatron, random_prompts


def _rollout(engine: HFEngine, prompts: list[list[int]]):  # type: ignore[no-untyped-def]
    return engine.generate(prompts, 2, seed=7, max_new_tokens=8, return_routes=True)


@pytest.mark.slow
def test_the_torch_decode_path_samples_what_the_c_path_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """~20 s: the same seed through both decode paths, with the transformers installed here."""
    state = W.megatron_to_hf(build_megatron(CFG, seed=0), CFG)
    prompts = random_prompts(3, CFG.vocab_size, seed=5)
    engine = HFEngine(CFG)
    engine.load_weights(state)
    native = _rollout(engine, prompts)
    monkeypatch.setenv("STUDY_NATIVE", "0")  # the torch path
    torch_path = _rollout(engine, prompts)
    assert torch_path.tokens == native.tokens
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(torch_path.logprobs, native.logprobs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(torch_path.routes, native.routes, strict=True))


def _experts_on(device: str, dtype: torch.dtype, **attrs: object) -> SimpleNamespace:
    """transformers' experts module as `_grouped_mm` reads it (5.18 on), its weights claiming `device`."""
    weight = SimpleNamespace(device=torch.device(device), dtype=dtype, data_ptr=lambda: 0)
    return SimpleNamespace(
        config=SimpleNamespace(_experts_implementation="grouped_mm"),
        has_bias=False,
        has_gate=True,
        is_transposed=False,
        gate_up_proj=weight,
        **({"_is_expert_parallel": False} | attrs),
    )


def test_the_torch_path_reads_the_experts_of_every_transformers_in_the_pin() -> None:
    """transformers 5.16.1 to 5.17 build the experts without `_is_expert_parallel` (5.18 added it; the GPU image
    has 5.17): the torch decode path takes the grouped GEMM there too (scripts/rehearse_offline_node.sh runs the
    path on 5.17 itself)."""
    older = _experts_on("cpu", torch.float32)
    del older._is_expert_parallel
    assert hf._FusedDecoder._grouped_mm(older) is not None
    assert hf._FusedDecoder._grouped_mm(_experts_on("cpu", torch.float32, _is_expert_parallel=True)) is None


def test_the_experts_on_cuda_take_the_grouped_gemm_in_bf16_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's CUDA grouped GEMM is documented for bf16; transformers' own check passes fp32 on an sm80+ GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    assert hf._FusedDecoder._grouped_mm(_experts_on("cuda", torch.bfloat16)) is not None
    for dtype in (torch.float32, torch.float16):
        assert hf._FusedDecoder._grouped_mm(_experts_on("cuda", dtype)) is None, dtype
        assert hf.experts_implementation_for("cuda", dtype) == "eager"  # transformers' module: a GEMM per expert
    assert hf.experts_implementation_for("cuda", torch.bfloat16) is None  # transformers' default, grouped_mm
    assert hf.experts_implementation_for("cpu", torch.float32) is None
    assert hf._FusedDecoder._grouped_mm(_experts_on("cpu", torch.float32)) is not None
