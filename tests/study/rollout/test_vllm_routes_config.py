"""What the vllm engine asks for on CUDA so that vLLM returns routed experts (R3), checked by vLLM's own rule
(`VllmConfig._verify_aux_output_compatibility`, the vLLM installed here: the release the CUDA wheel pins) on a
stand-in of the config the engine's arguments and environment make. No engine starts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from study.rollout import vllm_engine

vllm_config = pytest.importorskip("vllm.config.vllm")


def _verify(kwargs: dict, env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's routed-experts rule on what `kwargs` (LLM arguments) and `env` (the engine process's) configure: the
    model runner V2 only where the environment asks for it (vLLM's default picks V1 whenever a feature V2 lacks is
    on, or Triton is missing), prefix caching as the arguments set it (the engine sets it rather than rely on
    vLLM's default)."""
    from vllm import envs

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    envs.disable_envs_cache()  # read the variable now
    stand_in = SimpleNamespace(
        aux_output_config=SimpleNamespace(enabled=bool(kwargs.get("enable_return_routed_experts"))),
        use_v2_model_runner=bool(envs.VLLM_USE_V2_MODEL_RUNNER),
        model_config=SimpleNamespace(runner_type="generate", is_moe=True),
        cache_config=SimpleNamespace(enable_prefix_caching=bool(kwargs.get("enable_prefix_caching"))),
        speculative_config=None,
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1
        ),
        kv_transfer_config=None,
    )
    vllm_config.VllmConfig._verify_aux_output_compatibility(stand_in)


def test_the_engine_asks_for_what_routed_experts_need(monkeypatch: pytest.MonkeyPatch) -> None:
    _verify(vllm_engine.ROUTES_KWARGS, vllm_engine.ROUTES_ENV, monkeypatch)  # accepted
    with pytest.raises(ValueError, match="requires prefix caching"):
        _verify({**vllm_engine.ROUTES_KWARGS, "enable_prefix_caching": False}, vllm_engine.ROUTES_ENV, monkeypatch)
    with pytest.raises(ValueError, match="requires Model Runner V2"):
        _verify(vllm_engine.ROUTES_KWARGS, {}, monkeypatch)
