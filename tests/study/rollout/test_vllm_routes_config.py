"""What the vllm engine asks for on CUDA so that vLLM returns routed experts (R3), checked by vLLM's own rule
(`VllmConfig._verify_aux_output_compatibility`, the vLLM installed here: the release the CUDA wheel pins) on a
stand-in of the config the engine's arguments and environment make. No engine starts; vLLM is imported in a child
interpreter only (tests/study/rollout/test_vllm_import.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from study.rollout import vllm_engine
from tests.shared import require

# In the child: vLLM's routed-experts rule on what KWARGS (LLM arguments) and ENV (the engine process's) configure: the
# model runner V2 only where the environment asks for it (vLLM's default picks V1 whenever a feature V2 lacks is on,
# or Triton is missing), prefix caching as the arguments set it (the engine sets it rather than rely on vLLM's
# default). Prints "ok" or the rule's ValueError.
CHILD = """
import json, os, sys
from types import SimpleNamespace
kwargs, env = json.loads(sys.argv[1]), json.loads(sys.argv[2])
os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
os.environ.update(env)
from vllm import envs
from vllm.config import vllm as vllm_config
envs.disable_envs_cache()
stand_in = SimpleNamespace(
    aux_output_config=SimpleNamespace(enabled=bool(kwargs.get("enable_return_routed_experts"))),
    use_v2_model_runner=bool(envs.VLLM_USE_V2_MODEL_RUNNER),
    model_config=SimpleNamespace(runner_type="generate", is_moe=True),
    cache_config=SimpleNamespace(enable_prefix_caching=bool(kwargs.get("enable_prefix_caching"))),
    speculative_config=None,
    parallel_config=SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1,
                                    prefill_context_parallel_size=1),
    kv_transfer_config=None,
)
try:
    vllm_config.VllmConfig._verify_aux_output_compatibility(stand_in)
    print("ok")
except ValueError as err:
    print(f"ValueError: {err}")
"""


def _verify(kwargs: dict, env: dict) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(kwargs), json.dumps(env)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_engine_asks_for_what_routed_experts_need() -> None:
    require("vllm")
    assert _verify(vllm_engine.ROUTES_KWARGS, vllm_engine.ROUTES_ENV) == "ok"
    off = {**vllm_engine.ROUTES_KWARGS, "enable_prefix_caching": False}
    assert "requires prefix caching" in _verify(off, vllm_engine.ROUTES_ENV)
    assert "requires Model Runner V2" in _verify(vllm_engine.ROUTES_KWARGS, {})
