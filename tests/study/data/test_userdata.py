"""User data, a local HF checkpoint as the initial policy, and the optional KL to a reference policy, through the
real RL loop on the tiny preset."""

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import algorithms
from study import parts, rl
from study.core.model_config import PRESETS
from study.core.weights import export_hf
from study.data import tasks
from study.data.tokenizer import TaskTokenizer
from study.policy.model import build_policy
from study.run.config import RunConfig, load_config

TIMING = ("wall_s", "time_rollout_s", "time_old_logp_s", "time_update_s", "time_sync_s", "peak_rss_gb")
# Two steps, a held-out evaluation at step 2, short responses: seconds per run.
RUN = [
    "task=user",
    "verifier=numeric",
    "steps=2",
    "eval_every=2",
    "eval_size=4",
    "eval_samples=2",
    "max_new_tokens=24",
    "checkpoint_every=0",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 24 chain-sum-like (prompt, answer) rows as JSONL and as parquet."""
    root = tmp_path_factory.mktemp("userdata")
    rows = [{"prompt": it.prompt, "answer": it.answer} for it in tasks.make_task("chain_sum", seed=5).take(24)]
    jsonl = root / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = root / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    return {"jsonl": jsonl, "parquet": parquet}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, data: dict[str, Path]) -> Path:
    """An HF Qwen3-MoE checkpoint exported from a random tiny policy (seed 7), with the user-data tokenizer."""
    out = tmp_path_factory.mktemp("hf") / "ckpt"
    policy = build_policy(PRESETS["tiny"], seed=7)
    export_hf(policy, PRESETS["tiny"], out)
    tok, _ = parts.initial_policy(
        load_config(preset="tiny", sets=[*RUN, f"data={data['jsonl']}", "coldstart=scratch"]), out
    )
    tok.save(out, model_max_length=PRESETS["tiny"].max_seq_len)
    torch.save(policy.state_dict(), out.parent / "expected.pt")
    return out


def _metrics(run_dir: Path) -> pd.DataFrame:
    """The training steps' rows (step 0 holds the start's held-out evaluation alone: checked here, left out)."""
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"
    m = pd.read_parquet(run_dir / "metrics.parquet")
    assert m["step"].iloc[0] == 0 and m["reward_mean"].isna().iloc[0] and 0 <= m["eval_in_dist"].iloc[0] <= 1
    return m[m["step"] > 0].reset_index(drop=True)


def test_stream_is_deterministic_cycles_and_holds_out(data: dict[str, Path]) -> None:
    cfg = load_config(preset="tiny", sets=[*RUN, f"data={data['jsonl']}", "coldstart=scratch"])
    train, held = cfg.user_split()
    assert len(held) == 4 and len(train) == 20 and not {i.prompt for i in held} & {i.prompt for i in train}
    assert (
        held
        == load_config(
            preset="tiny", sets=[*RUN, f"data={data['parquet']}", "coldstart=scratch", "seed=3"]
        ).user_split()[1]
    )
    stream = tasks.UserTask(tuple(train), seed=0)
    first, second = stream.take(20), stream.take(20, start=20)
    assert sorted(i.prompt for i in first) == sorted(i.prompt for i in train) == sorted(i.prompt for i in second)
    assert first != second  # a new order each epoch
    assert stream.take(5, start=17) == tasks.UserTask(tuple(train), seed=0).take(5, start=17)
    assert stream.take(20) != tasks.UserTask(tuple(train), seed=1).take(20)


def test_run_id_hashes_content_not_path(data: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere.jsonl"
    shutil.copy(data["jsonl"], copy)
    ids = [
        load_config(preset="tiny", sets=[*RUN, f"data={p}", "coldstart=scratch"]).run_id
        for p in (data["jsonl"], copy, data["parquet"])
    ]
    assert ids[0] == ids[1] != ids[2]
    # kl_coef = 0 and the user-data fields at their defaults leave existing run ids as they were
    assert load_config(preset="tiny", sets=["kl_coef=0"]).run_id == load_config(preset="tiny").run_id
    assert load_config(preset="tiny", sets=["kl_coef=0.1"]).run_id != load_config(preset="tiny").run_id


def test_jsonl_and_parquet_runs_and_kl_changes_the_loss(data: dict[str, Path], tmp_path: Path) -> None:
    # From random weights every reward is 0, so advantages are 0; weight decay moves the policy off the reference
    # anyway (decoupled AdamW decay), which is all the KL term needs to show.
    sets = [*RUN, "coldstart=scratch", "lr=0.01", "weight_decay=0.5"]
    plain = _metrics(
        rl.run(load_config(preset="tiny", sets=[*sets, f"data={data['jsonl']}"]), tmp_path, progress=False)
    )
    kl = _metrics(
        rl.run(
            load_config(preset="tiny", sets=[*sets, f"data={data['parquet']}", "kl_coef=1.0"]), tmp_path, progress=False
        )
    )
    for m in (plain, kl):
        assert m["step"].tolist() == [1, 2]
        assert m["reward_mean"].notna().all() and 0 <= m["eval_in_dist"].iloc[-1] <= 1
        assert m["eval_hard"].isna().all()  # user data has one held-out split
    assert plain["kl_ref"].isna().all()
    assert kl["kl_ref"].map(math.isfinite).all() and (kl["kl_ref"] >= 0).all() and kl["kl_ref"].iloc[0] > 0
    # same rows, same seed, same initial policy: identical rollouts at step 1, a different loss once the policy
    # has moved away from the reference (the second minibatch of step 1)
    assert kl["reward_mean"].iloc[0] == plain["reward_mean"].iloc[0]
    assert kl["loss"].iloc[0] != plain["loss"].iloc[0]


def test_kl_penalty_from_the_same_state() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=gen)
    ref = logp - 0.3 * torch.rand(4, 6, generator=gen)
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for name in ("grpo", "gspo", "dapo"):
        alg = algorithms.get(name)
        hp = alg.check_hparams({})
        w = rl.aggregation_weights(alg, mask, hp)
        assert torch.isclose(w.sum(), torch.tensor(1.0)) and (w[mask == 0] == 0).all()
        theta = logp.clone().requires_grad_(True)
        base, _ = alg.loss(theta, logp, adv, mask, **hp)
        kl = rl.kl_to_reference(theta, ref, mask, w)
        assert float(kl) > 0 and float(rl.kl_to_reference(logp, logp, mask, w)) == 0.0
        assert not torch.equal(base + 0.5 * kl, base)
        (grad,) = torch.autograd.grad(kl, theta)
        assert grad[mask.bool()].abs().sum() > 0 and (grad[mask == 0] == 0).all()


def test_hf_checkpoint_is_the_initial_policy(data: dict[str, Path], hf_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(preset="tiny", sets=[*RUN, f"data={data['jsonl']}", f"coldstart={hf_dir}"])
    tok, checkpoint = parts.initial_policy(cfg, tmp_path)
    state = dict(checkpoint.tensors())  # streamed, mapped to Megatron names
    expected = torch.load(hf_dir.parent / "expected.pt", weights_only=True)
    weights = {k for k, v in expected.items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
    assert set(state) == weights
    assert all(torch.equal(state[k], expected[k]) for k in weights)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    m = _metrics(rl.run(cfg, tmp_path, progress=False))
    assert m["step"].tolist() == [1, 2] and m["grad_norm"].notna().all()


def test_tokenizer_special_ids_come_from_the_files(hf_dir: Path, tmp_path: Path) -> None:
    tok = TaskTokenizer.load(hf_dir)
    tok.tokenizer.add_special_tokens(["<|end|>"])
    (tmp_path / "tokenizer.json").write_text(tok.to_json())
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<|end|>"}, "pad_token": "<pad>"})
    )
    other = TaskTokenizer.load(tmp_path)
    end = other.tokenizer.token_to_id("<|end|>")
    assert (other.eos_id, other.bos_id, other.pad_id) == (end, None, 0) and end > 2
    assert other.encode_prompt("sum 1+2\n") == other.encode("sum 1+2\n")  # no bos
    assert other.encode_response("#### 3")[-1] == end
    assert other.decode_response([*other.encode("#### 3"), end, 5]) == ("#### 3", True)
    with pytest.raises(ValueError, match="eos_token '<nope>' is not in the vocabulary"):
        TaskTokenizer(other.tokenizer, specials={"eos_token": "<nope>"})


def _error(sets: list[str]) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        load_config(preset="tiny", sets=sets)
    return str(e.value)


def test_errors_name_the_field(data: dict[str, Path], hf_dir: Path, tmp_path: Path) -> None:
    base = [*RUN, "coldstart=scratch"]
    assert _error([*base, f"data={tmp_path / 'missing.jsonl'}"]).startswith("data = ")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "sum 1+2\\n", "answer": "3"}\n{not json\n')
    assert _error([*base, f"data={bad}"]).startswith(f"data = '{bad}': {bad}:2: not valid JSON")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"prompt": "sum 1+2\\n", "answer": "3", "solution": "#### 4"}\n')
    assert "data = " in _error([*base, f"data={wrong}"]) and "does not accept" in _error([*base, f"data={wrong}"])
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer\n")
    assert "unsupported file type" in _error([*base, f"data={csv}"])
    assert _error([*base, f"data={data['jsonl']}", "verifier=nope"]).startswith("verifier = 'nope'; valid: exact")
    assert _error([*RUN[:1], "coldstart=scratch", f"data={data['jsonl']}"]).startswith("verifier = ''")
    assert _error([*base, "data="]).startswith("data = ''")
    assert _error(["task=chain_sum", f"data={data['jsonl']}"]).startswith("data = ")
    assert _error([*base, f"data={data['jsonl']}", "eval_size=24"]).startswith("data = ")
    assert _error([*RUN, f"data={data['jsonl']}"]).startswith("coldstart = 'auto'")
    assert _error([*base, f"data={data['jsonl']}", "kl_coef=-1"]).startswith("kl_coef = -1.0")
    msg = _error([*base, f"data={data['jsonl']}", f"coldstart={hf_dir}", "model=default", "max_new_tokens=24"])
    assert msg.startswith(f"coldstart = '{hf_dir}'") and "hidden_size" in msg and "set model = 'tiny'" in msg
    edited = tmp_path / "edited"
    shutil.copytree(hf_dir, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "num_experts": 8}))
    msg = _error([*base, f"data={data['jsonl']}", f"coldstart={edited}"])
    assert "num_experts: checkpoint 8, model 4" in msg and "set model = {preset: tiny, num_experts: 8}" in msg
    # checked against the resolved shape: the checkpoint fits the shape it names
    assert (
        load_config(preset="tiny", sets=[*base, f"data={data['jsonl']}", f"coldstart={edited}", "model.num_experts=8"])
        .model_config()
        .num_experts
        == 8
    )
    (edited / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert "valid presets" in _error([*base, f"data={data['jsonl']}", f"coldstart={edited}"])  # no shape fits
    assert isinstance(load_config(preset="tiny", sets=[*base, f"data={data['jsonl']}"]), RunConfig)
