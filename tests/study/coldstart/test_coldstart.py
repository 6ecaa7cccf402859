"""Cold start (study/coldstart/): the SFT loss falls, only response tokens carry loss, the content-addressed
directory is reused without training, policy.pt reproduces the trained weights' log-probs, coldstart.json is
complete; a model shape (a preset plus overrides) has its own directory, trained in that shape; slow tier: the tiny
preset on chain_sum reaches the pass@1 band."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from study.coldstart import (
    PRESET_DEFAULTS,
    ColdStartError,
    ColdStartSettings,
    coldstart_main,
    ensure_coldstart,
    read_record,
    resolve_settings,
)
from study.coldstart.sft import collate, sft_loss
from study.coldstart.store import build_parser, parse_model, with_sets
from study.core.model_config import PRESETS
from study.data.tasks import eval_set, make_task
from study.data.tokenizer import EOS_ID, PAD_ID, TaskTokenizer, build_tokenizer
from study.policy.model import build_policy, token_logp

# A reduced budget: two checks, far from the band, so the run ends with status "budget" in a few seconds.
FAST = dict(max_steps=40, eval_every=20, eval_size=8, eval_samples=2, batch_size=16, max_new_tokens=48)


@pytest.fixture(scope="module")
def fast_coldstart(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float]:
    """(results root, directory, wall seconds) of one reduced-budget tiny/chain_sum cold start."""
    results = tmp_path_factory.mktemp("results")
    t = time.perf_counter()
    directory = ensure_coldstart("tiny", "chain_sum", results, strict=False, **FAST)
    return results, directory, time.perf_counter() - t


def test_sft_loss_falls(fast_coldstart: tuple[Path, Path, float]) -> None:
    losses = read_record(fast_coldstart[1])["loss_curve"]
    assert len(losses) == FAST["max_steps"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)


def test_loss_only_on_response_tokens() -> None:
    cfg = PRESETS["tiny"]
    tok = build_tokenizer(cfg.vocab_size, ["chain_sum"], n_per_task=50)
    items = make_task("chain_sum", seed=3).take(4)
    input_ids, targets, mask = collate(tok, items, max_len=cfg.max_seq_len)  # (B, S) each
    # The mask is 1 exactly on the targets solution + <eos> of each example.
    for b, item in enumerate(items):
        ids, n_prompt = tok.encode_example(item.prompt, item.solution)
        expected = torch.zeros(input_ids.shape[1])
        expected[n_prompt - 1 : len(ids) - 1] = 1.0
        torch.testing.assert_close(mask[b], expected)
        assert targets[b, len(ids) - 2] == EOS_ID and mask[b, len(ids) - 2] == 1
        assert (targets[b, len(ids) - 1 :] == PAD_ID).all()
    model = build_policy(cfg, seed=0)
    loss, metrics = sft_loss(model, input_ids, targets, mask)
    assert metrics["tokens"] == float(mask.sum())
    # Any other target ids where the mask is 0 (prompt tokens, padding): the same loss, bit for bit.
    scrambled = torch.where(mask.bool(), targets, torch.randint_like(targets, 3, tok.vocab_size))
    assert not torch.equal(scrambled, targets)
    loss2, _ = sft_loss(model, input_ids, scrambled, mask)
    assert float(loss2.detach()) == float(loss.detach())
    # And the loss is the token mean of the response NLL.
    logp = token_logp(model, input_ids, targets)  # (B, S)
    torch.testing.assert_close(loss, -logp[mask.bool()].mean())


def test_reuse_without_training(fast_coldstart: tuple[Path, Path, float]) -> None:
    results, directory, first_s = fast_coldstart
    before = (directory / "coldstart.json").stat().st_mtime_ns, (directory / "policy.pt").stat().st_mtime_ns
    t = time.perf_counter()
    again = ensure_coldstart("tiny", "chain_sum", results, strict=False, **FAST)
    second_s = time.perf_counter() - t
    assert again == directory
    after = (directory / "coldstart.json").stat().st_mtime_ns, (directory / "policy.pt").stat().st_mtime_ns
    assert after == before  # nothing rewritten
    assert second_s < min(1.0, first_s / 5), (first_s, second_s)
    # Only the final directory and its lock file; no temporary build directory left behind.
    names = {p.name for p in (results / "coldstart").iterdir()}
    assert names == {directory.name, f".{directory.name}.lock"}
    # Other settings -> another directory name.
    other = resolve_settings("tiny", "chain_sum", **FAST, seed=1)
    assert other.dirname != directory.name and directory.name == resolve_settings("tiny", "chain_sum", **FAST).dirname


def test_strict_raises_outside_band(fast_coldstart: tuple[Path, Path, float]) -> None:
    results = fast_coldstart[0]
    with pytest.raises(ColdStartError, match="status 'budget'"):
        ensure_coldstart("tiny", "chain_sum", results, **FAST)  # the same, reused, directory


def test_policy_pt_reproduces_logp(fast_coldstart: tuple[Path, Path, float]) -> None:
    directory = fast_coldstart[1]
    record = read_record(directory)
    cfg = PRESETS["tiny"]
    state = torch.load(directory / "policy.pt", weights_only=True)
    policy = build_policy(cfg, seed=12345)  # another init: every weight must come from the file
    result = policy.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys)
    tok = TaskTokenizer.load(directory)
    item = eval_set("chain_sum", "in_dist", size=1)[0]
    input_ids, targets, mask = collate(tok, [item], max_len=cfg.max_seq_len)  # (1, S) each
    with torch.no_grad():
        logp = token_logp(policy, input_ids, targets)  # (1, S)
    assert float((logp * mask).sum()) == pytest.approx(record["probe_logp"], abs=1e-5)
    # The HF export in the same directory computes the same log-probs (transformers' Qwen3-MoE).
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        hf_logp = torch.log_softmax(hf(input_ids=input_ids).logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(hf_logp[mask.bool()], logp[mask.bool()], atol=1e-4, rtol=1e-4)


def test_coldstart_json_fields(fast_coldstart: tuple[Path, Path, float]) -> None:
    directory = fast_coldstart[1]
    record = json.loads((directory / "coldstart.json").read_text())
    assert record["status"] == "budget"  # 40 steps cannot reach pass@1 0.1
    assert record["band"] == [0.1, 0.5]
    assert record["steps_trained"] == FAST["max_steps"]
    assert record["step"] in (20, 40)  # the check nearest the band
    assert [c["step"] for c in record["checks"]] == [20, 40]
    for check in record["checks"]:
        assert set(check) == {"step", "pass_at_1", "truncation_rate", "loss", "wall_s"}
        assert 0.0 <= check["pass_at_1"] <= 1.0
    assert record["pass_at_1"] == next(c["pass_at_1"] for c in record["checks"] if c["step"] == record["step"])
    settings = record["settings"]
    assert {k: settings[k] for k in FAST} == FAST
    assert settings["model"] == "tiny" and settings["task"] == "chain_sum" and settings["seed"] == 0
    assert directory.name == f"tiny-chain_sum-{record['hash']}"
    assert set(record["timings"]) == {"tokenizer_s", "train_s", "eval_s", "write_s", "total_s"}
    assert record["timings"]["total_s"] > 0
    assert record["tokenizer_vocab_size"] <= PRESETS["tiny"].vocab_size
    for name in (
        "policy.pt",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
        "model.safetensors",
    ):
        assert (directory / name).is_file(), name


def test_settings_errors() -> None:
    with pytest.raises(ValueError, match="band"):
        ColdStartSettings(band=(0.5, 0.1))
    with pytest.raises(ValueError, match="unknown model preset"):
        resolve_settings("huge", "chain_sum")
    with pytest.raises(ValueError, match=r"model.moe_top_k = 9: valid range is \[1, 4\]"):
        resolve_settings({"preset": "tiny", "moe_top_k": 9}, "chain_sum")
    with pytest.raises(ValueError, match=r"model: unknown field\(s\) \['experts'\]; valid: preset, num_layers"):
        resolve_settings({"preset": "tiny", "experts": 8}, "chain_sum")
    with pytest.raises(ValueError, match=r"model\.vocab_size = 100: must be >= 259"):
        resolve_settings({"preset": "tiny", "vocab_size": 100}, "chain_sum")
    with pytest.raises(ValueError, match="task"):
        ColdStartSettings(task="sudoku")
    with pytest.raises(ValueError, match="unknown coldstart setting"):
        resolve_settings("tiny", "chain_sum", learning_rate=1.0)
    with pytest.raises(FileNotFoundError, match="init"):
        ColdStartSettings(init="/nonexistent/coldstart")
    assert coldstart_main(["--model", "huge", "--quiet"]) == 2
    assert coldstart_main(["--model", "tiny", "--set", "moe_top_k=9", "--quiet"]) == 2
    assert coldstart_main(["--model", "{preset: tiny, experts: 8}", "--quiet"]) == 2


# --- model shapes ----------------------------------------------------------------------------------------------------
def test_the_directory_is_keyed_by_the_shape() -> None:
    """A plain preset, however spelled, names the directory it always did; every other shape has its own directory,
    labelled readably, and takes its base preset's recipe."""
    plain = resolve_settings("default", "chain_sum")
    assert plain.hashed()["model"] == "default" and plain.dirname.startswith("default-chain_sum-")
    assert resolve_settings({"preset": "default"}, "chain_sum").dirname == plain.dirname
    assert resolve_settings({"preset": "default", "num_experts": 8}, "chain_sum").dirname == plain.dirname
    shapes = [
        {"preset": "default", "num_experts": 16},
        {"preset": "default", "num_experts": 32, "moe_top_k": 8},
        {"preset": "default", "num_layers": 8},
        {"preset": "default", "init_std": 0.01},
        "tiny",
    ]
    names = [resolve_settings(shape, "chain_sum").dirname for shape in shapes]
    assert len({plain.dirname, *names}) == len(shapes) + 1
    assert [name.rsplit("-", 2)[0] for name in names] == [
        "default_e16",
        "default_e32_k8",
        "default_l8",
        "default_std0p01",
        "tiny",
    ]
    shaped = resolve_settings(shapes[1], "chain_sum")
    recipe = PRESET_DEFAULTS["default"]
    assert (shaped.lr, shaped.batch_size, shaped.max_steps) == (recipe["lr"], recipe["batch_size"], recipe["max_steps"])
    assert shaped.model_config == PRESETS["default"].replace(num_experts=32, moe_top_k=8)


def test_the_cli_spells_a_shape_two_ways() -> None:
    args = build_parser().parse_args(["--model", "default", "--set", "num_experts=32", "--set", "model.moe_top_k=8"])
    assert with_sets(args.model, args.sets) == {"preset": "default", "num_experts": 32, "moe_top_k": 8}
    as_yaml = parse_model("{preset: default, num_experts: 32, moe_top_k: 8}")
    as_json = parse_model('{"preset": "default", "num_experts": 32, "moe_top_k": 8}')
    assert as_yaml == as_json == with_sets(args.model, args.sets)
    assert parse_model("tiny") == "tiny" and with_sets("tiny", []) == "tiny"
    assert with_sets(as_yaml, ["num_experts=16"])["num_experts"] == 16


def test_a_shape_trains_in_its_own_shape(tmp_path: Path) -> None:
    """A two-step cold start of the tiny preset with 8 experts, top-3: its own directory, its record and its weights
    in that shape."""
    shape = {"preset": "tiny", "num_experts": 8, "moe_top_k": 3}
    tiny = dict(max_steps=2, eval_every=2, eval_size=4, eval_samples=1, batch_size=4, max_new_tokens=48)
    directory = ensure_coldstart(shape, "chain_sum", tmp_path, strict=False, **tiny)
    assert directory.name.startswith("tiny_e8_k3-chain_sum-")
    record = read_record(directory)
    assert record["settings"]["model"] == shape and record["model_config"]["num_experts"] == 8
    state = torch.load(directory / "policy.pt", weights_only=True)
    router = next(v for k, v in state.items() if k.endswith("mlp.router.weight"))
    assert router.shape == (8, PRESETS["tiny"].hidden_size)
    assert json.loads((directory / "config.json").read_text())["num_experts_per_tok"] == 3


@pytest.mark.slow
def test_tiny_chain_sum_reaches_band(tiny_coldstart: Path) -> None:
    """The tiny preset's own recipe reaches the default band on one thread: the session's shared cold start
    (tests/conftest.py), trained by `python -m study.launch --coldstart tiny chain_sum` in a fresh process with the
    defaults (its timings are printed)."""
    record = read_record(tiny_coldstart)
    assert tiny_coldstart.name == resolve_settings("tiny", "chain_sum", threads=1).dirname
    assert record["settings"]["threads"] == 1
    print(
        f"tiny/chain_sum cold start: pass@1 {record['pass_at_1']:.3f} after {record['steps_trained']} SFT steps "
        f"({record['timings']})"
    )
    assert record["status"] == "in_band"
    lo, hi = record["band"]
    assert lo <= record["pass_at_1"] <= hi


def test_knobs_name_their_own_cold_start() -> None:
    """A run's task knobs train its cold start (and pick its in_dist check set): other knobs, another directory;
    the task's defaults keep the directory of a cold start made before knobs existed."""
    plain = resolve_settings("tiny", "chain_sum")
    assert resolve_settings("tiny", "chain_sum", knobs={}).dirname == plain.dirname
    assert "knobs" not in plain.hashed()
    easy = resolve_settings("tiny", "chain_sum", knobs={"terms": [2, 3], "digits": 1})
    assert easy.dirname != plain.dirname and easy.hashed()["knobs"] == {"digits": 1, "terms": [2, 3]}
    with pytest.raises(ValueError, match="unknown knob 'depth'"):
        resolve_settings("tiny", "chain_sum", knobs={"depth": 2})


def test_budget_table_scores_the_cold_start_at_each_budget(fast_coldstart: tuple[Path, Path, float], tmp_path) -> None:
    from study.tools import budgets

    _, directory, _ = fast_coldstart
    knobs = {"terms": [2, 3], "digits": 1}
    out = tmp_path / "b.csv"
    budgets.main(
        [
            str(directory),
            "--task",
            "chain_sum",
            "--knobs",
            '{"terms": [2, 3], "digits": 1}',
            "--budgets",
            "48",
            "4",
            "--eval-size",
            "8",
            "--eval-samples",
            "2",
            "--out",
            str(out),
        ]
    )
    t = pd.read_csv(out)
    assert t["max_new_tokens"].tolist() == [4, 48] and (t["problems"] == 8).all()
    # 4 tokens hold no worked solution (the shortest, "a+b=c\n#### c", is ~10 tokens): most samples are cut (a few
    # stop early), none scores; at 48 every reference fits and fewer samples are cut
    assert t["truncated"].iloc[0] > 0.5 and t["pass_at_1"].iloc[0] == 0.0 and t["reference_fits"].iloc[0] == 0.0
    assert t["reference_fits"].iloc[1] == 1.0 and t["truncated"].iloc[1] < t["truncated"].iloc[0]
    assert t["knobs"].iloc[0] == '{"digits": 1, "terms": [2, 3]}' and t["coldstart"].iloc[0] == directory.name
    with pytest.raises(ValueError, match="budgets"):
        budgets.budget_table(directory, "chain_sum", knobs, [0])
    with pytest.raises(FileNotFoundError, match=r"coldstart\.json"):
        budgets.budget_table(tmp_path, "chain_sum", knobs, [8])
