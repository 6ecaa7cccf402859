"""The RL run end to end on the tiny preset: every algorithm trains, collapses are recorded, runs are idempotent,
and a run killed with SIGKILL resumes to bit-identical metrics."""

import json
import os
import platform
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

import algorithms
from study import parts, record, rl
from study.batch import pad
from study.data import tasks
from study.run.config import load_config
from tests.shared import sharing_coldstart

# Columns that measure the machine, not the computation.
TIMING = ("wall_s", "time_rollout_s", "time_old_logp_s", "time_update_s", "time_sync_s", "peak_rss_gb")


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def test_pad_lays_out_teacher_forcing_tensors() -> None:
    # Worked by hand: two ragged samples (prompt + response of 5 and 4 tokens), T = 3 response slots.
    r0, r1 = torch.arange(8, dtype=torch.uint8).view(4, 1, 2), torch.arange(10, 16, dtype=torch.uint8).view(3, 1, 2)
    samples = [
        {"prompt": [5, 6], "response": [7, 8, 9], "logp": torch.tensor([-0.1, -0.2, -0.3]), "adv": 0.5, "routes": r0},
        {"prompt": [1, 2, 3], "response": [4], "logp": torch.tensor([-0.5]), "adv": -0.5, "routes": r1},
    ]
    b = pad(samples, 3)
    assert b.n == 2
    assert b.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 3, 0]]
    assert b.targets.tolist() == [[6, 7, 8, 9], [2, 3, 4, 0]]
    assert b.attn_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b.pos.tolist() == [[1, 2, 3], [2, 3, 3]]  # targets[i, pos[i, t]] is response token t
    assert b.mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert torch.equal(b.rollout_logp, torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0.0, 0.0]]))
    assert torch.equal(b.advantages, torch.tensor([0.5, -0.5]))
    assert b.input_ids.dtype == b.targets.dtype == b.attn_mask.dtype == torch.long
    routes = b.engine_routes.experts
    assert routes.shape == (2, 4, 1, 2) and routes.dtype == torch.uint8
    assert torch.equal(routes[0], r0) and torch.equal(routes[1, :3], r1) and not routes[1, 3].any()
    assert pad([], 3) is None
    # parallel.tensor = 3 (sequence parallelism splits S over 3 ranks): S = 4 padded to 6, one more pad column each
    p = pad(samples, 3, multiple=3)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 0, 0], [1, 2, 3, 0, 0, 0]]
    assert p.targets.tolist() == [[6, 7, 8, 9, 0, 0], [2, 3, 4, 0, 0, 0]]
    assert p.attn_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert p.pos[p.mask.bool()].tolist() == b.pos[b.mask.bool()].tolist()  # the response tokens' targets: the same
    assert p.engine_routes.experts.shape == (2, 6, 1, 2) and torch.equal(p.engine_routes.experts[:, :4], routes)
    assert not p.engine_routes.experts[:, 4:].any()


def test_reward_collapse_is_a_result_not_a_crash(tmp_path: Path) -> None:
    # From random weights nothing is ever correct: the reward floor trips after its 2-step window.
    cfg = load_config(preset="tiny", sets=["coldstart=scratch", "reward_floor=0.5", "collapse_window=2"])
    run_dir = rl.run(cfg, tmp_path, progress=False)
    st = status(run_dir)
    assert st["state"] == "collapsed" and st["step"] == 2 and "reward collapse" in st["reason"]
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert metrics["step"].tolist() == [0, 1, 2]  # 0: the start's held-out evaluation; the collapsing step is kept
    assert {"reward_mean", "clip_frac", "clip_frac_low", "clip_frac_high", "compute_flops", "wall_s"} <= set(metrics)
    assert not [p.name for p in run_dir.rglob(".*.tmp")], "a temporary file was left behind"


def test_finished_runs_are_skipped(tmp_path: Path) -> None:
    cfg = load_config(preset="tiny", sets=["coldstart=scratch", "steps=2", "eval_every=0"])
    run_dir = rl.run(cfg, tmp_path, progress=False)
    assert status(run_dir)["state"] == "completed"
    before = (run_dir / "metrics.parquet").stat().st_mtime_ns
    assert rl.run(cfg, tmp_path, progress=False) == run_dir
    assert (run_dir / "metrics.parquet").stat().st_mtime_ns == before
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert {"git_sha", "packages", "seed", "host", "threads", "job_id"} <= set(manifest)
    assert manifest["packages"]["torch"].startswith("2.13.0")
    assert isinstance(
        manifest["native_kernels"], bool
    )  # whether the optional C kernels ran (tests/study/kernels checks they build)


@pytest.mark.parametrize("temperature", [1.0, 1.4])
def test_token_samples_pair_trainer_and_engine_logprobs(tmp_path: Path, monkeypatch, temperature: float) -> None:
    """The trainer's pi_old and the engine's log-probs of every sampled token agree to fp32 rounding, at temperature 1
    and at T = 1.4 (both of softmax(logits / T): the trainer scores the distribution the engine sampled from); the
    held-out evaluations sample at eval_temperature (1), the rollouts at T."""
    from study.rollout.hf import HFEngine

    temps: list[float] = []
    generate = HFEngine.generate

    def spy(self, prompts, n, **kwargs):  # type: ignore[no-untyped-def]
        temps.append(kwargs["temperature"])
        return generate(self, prompts, n, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", spy)
    sets = ["coldstart=scratch", "steps=3", "eval_every=2", "checkpoint_every=0", f"temperature={temperature}"]
    cfg = load_config(preset="tiny", sets=sets)
    run_dir = rl.run(cfg, tmp_path, progress=False)
    metrics = pd.read_parquet(run_dir / "metrics.parquet").set_index("step")
    evaluations = int(metrics["eval_in_dist"].notna().sum()) * len(tasks.EVAL_SPLITS)
    assert evaluations >= 4 and len(temps) == 3 + evaluations  # one rollout per step (no dynamic sampling)
    assert temps.count(1.0) == evaluations + (3 if temperature == 1.0 else 0)
    tokens = pd.read_parquet(run_dir / record.TOKEN_SAMPLES)
    assert sorted(tokens["step"].unique()) == [1, 2, 3]  # step 1, the eval step, the last step
    # the tiny batch (16 sequences) is under the 64-sequence cap: every response token is there, once
    per_step = tokens.groupby("step").size()
    assert per_step.tolist() == metrics.loc[[1, 2, 3], "tokens"].astype(int).tolist()
    assert not tokens.duplicated(["step", "sample", "pos"]).any()
    d = tokens["trainer_logp"] - tokens["engine_logp"]
    assert (tokens[["trainer_logp", "engine_logp"]] <= 0).all().all()
    # fp32 on both sides: the two engines agree to float rounding; the per-step summary is the same numbers
    assert d.abs().max() < 1e-3
    assert d.abs().groupby(tokens["step"]).mean().to_numpy() == pytest.approx(
        metrics.loc[[1, 2, 3], "mismatch_mean_abs"].to_numpy(), rel=1e-4, abs=1e-7
    )


@pytest.mark.parametrize("minibatches", [1, 4])
def test_pi_old_reuses_the_first_minibatch_forward(tmp_path: Path, monkeypatch, minibatches: int) -> None:
    """pi_old is recomputed for every row but the first minibatch's, whose update forward (same weights, same
    tokens) gives pi_old: per step the policy forwards 2B - B/M rows, and with one minibatch the ratio is exactly 1."""
    rows: list[int] = []
    real = parts.token_logp

    def counting(model, input_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        rows.append(input_ids.shape[0])
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(parts, "token_logp", counting)  # pi_old and the updates
    monkeypatch.setattr(rl, "token_logp", counting)  # the reference and the sync check (off here)
    sets = ["coldstart=scratch", "steps=2", "eval_every=0", "checkpoint_every=0", f"minibatches={minibatches}"]
    cfg = load_config(preset="tiny", sets=sets)
    run_dir = rl.run(cfg, tmp_path, progress=False)
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    b = cfg.prompts_per_step * cfg.group_size
    assert sum(rows) == 2 * (2 * b - b // minibatches)
    if minibatches == 1:  # the only update starts at pi_old itself
        assert metrics["clip_frac"].eq(0).all() and metrics["approx_kl"].eq(0).all()
        # no forward follows an update: old-vs-new routing volatility is undefined, not a structural zero
        assert metrics["routing_slot_mismatch"].isna().all()
        layers = pd.read_parquet(run_dir / "routing_layers.parquet")
        assert layers["slot_mismatch"].isna().all() and layers["expert_load_imbalance"].notna().all()
    else:
        assert metrics["routing_slot_mismatch"].notna().all()
    assert metrics["mismatch_mean_abs"].lt(1e-4).all()  # pi_old (both kinds of rows) vs the engine's log-probs


@pytest.mark.slow
@pytest.mark.parametrize("name", algorithms.names())
def test_every_algorithm_trains_and_moves_its_parameters(name: str, results: Path) -> None:
    cfg = load_config(preset="tiny", sets=[f"algorithm={name}", "steps=3", "eval_every=3", "checkpoint_every=0"])
    run_dir = rl.run(cfg, results, progress=False)
    assert status(run_dir)["state"] == "completed", status(run_dir)
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert metrics["step"].tolist() == [0, 1, 2, 3]  # 0: the start's held-out evaluation alone
    assert metrics.iloc[0]["eval_in_dist"] >= 0 and metrics.iloc[0][["reward_mean", "grad_norm"]].isna().all()
    metrics = metrics.iloc[1:]
    assert metrics[["reward_mean", "clip_frac", "compute_flops"]].notna().all().all()
    assert metrics["compute_flops"].is_monotonic_increasing
    assert metrics["grad_norm"].gt(0).any(), "no gradient signal: the cold start is outside the pass@1 band"
    assert 0 <= metrics["eval_in_dist"].dropna().iloc[-1] <= 1
    start = torch.load(next((results / "coldstart").glob("tiny-chain_sum-*/policy.pt")), weights_only=True)
    final = torch.load(run_dir / "checkpoint" / "state.pt", weights_only=False)["model"]
    moved = [
        k for k, v in start.items() if torch.is_tensor(v) and v.is_floating_point() and not torch.equal(v, final[k])
    ]
    assert any("router" in k for k in moved) and any("experts" in k for k in moved)
    assert metrics["engine_routing_slot_mismatch"].notna().all()  # the hf engine returns its routes
    if algorithms.get(name).routing != "free":  # replay: the update forward's free choice vs the recorded routes
        assert metrics["routing_slot_mismatch"].notna().all()


@pytest.mark.slow
def test_exploding_ratio_collapses(results: Path) -> None:
    # a ratio bound no update can meet: the second minibatch (off-policy after one step) trips it
    cfg = load_config(preset="tiny", sets=["algorithm=grpo", "max_log_ratio=1e-7", "steps=2"])
    run_dir = rl.run(cfg, results, progress=False)
    st = status(run_dir)
    assert st["state"] == "collapsed" and "exploding ratio" in st["reason"]


def _in_subprocess(results: Path, sets: list[str]) -> subprocess.Popen:
    """`python -m study run` in a fresh process: the reference, the killed run and the resume all run in the same
    kind of process, so a difference is a resume difference."""
    cmd = [sys.executable, "-m", "study", "run", "--preset", "tiny", "--results", str(results), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(results: Path, tmp_path: Path) -> None:
    sets = ["algorithm=gspo", "steps=6", "checkpoint_every=2", "eval_every=3"]
    reference_root, killed_root = tmp_path / "reference", tmp_path / "killed"
    for root in (reference_root, killed_root):
        sharing_coldstart(results, root)
    ref = _in_subprocess(reference_root, sets)
    assert ref.wait(timeout=600) == 0, ref.stderr.read()
    (reference,) = (reference_root / "runs").iterdir()
    expected = pd.read_parquet(reference / "metrics.parquet").drop(columns=list(TIMING))

    proc = _in_subprocess(killed_root, sets)
    run_dir = killed_root / "runs" / reference.name
    deadline = time.time() + 300
    while time.time() < deadline:
        st = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
        if st.get("step", 0) >= 5:  # past the step-4 checkpoint, before the end
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    st = status(run_dir)
    assert st["state"] == "running" and st["step"] < 6, "the run finished before it could be killed"

    resume = subprocess.run(
        [sys.executable, "-m", "study", "resume", str(run_dir), "--quiet"], capture_output=True, text=True, timeout=600
    )
    assert resume.returncode == 0, resume.stderr
    assert status(run_dir)["state"] == "completed"
    got = pd.read_parquet(run_dir / "metrics.parquet").drop(columns=list(TIMING))
    pd.testing.assert_frame_equal(got, expected, check_exact=True)
    pd.testing.assert_frame_equal(
        pd.read_parquet(run_dir / record.TOKEN_SAMPLES),
        pd.read_parquet(reference / record.TOKEN_SAMPLES),
        check_exact=True,
    )


def cpu_kind() -> str:
    """What decides a run's float sums on this machine besides the code: the CPU's vendor (MKL's and oneDNN's code
    paths differ by vendor) and its widest matrix instructions (what `-march=native` compiles study/kernels/ for, and
    which oneDNN kernels torch runs): e.g. "AuthenticAMD avx512", "GenuineIntel amx"."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.processor() or platform.machine()} unknown"
    vendor = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("vendor_id")), "unknown")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    isa = next(
        (name for flag, name in (("amx_tile", "amx"), ("avx512f", "avx512"), ("avx2", "avx2")) if flag in flags),
        platform.machine(),
    )
    return f"{vendor} {isa}"


# Golden numbers: two seeded tiny runs from the tiny cold start, one torch thread, the C kernels on (their default).
# A change to the numerics of a run (sampling, the loss, routing, the optimiser, the kernels' sums beyond rounding)
# moves these beyond the tolerance and fails here: a visible, reviewed change. The float sums, and so the sampled
# tokens, depend on the CPU kind (`cpu_kind`), so the numbers are pinned per kind; on a kind with none pinned the test
# runs the golden run twice and requires the two to be identical, and warns with the numbers to pin. To re-pin after
# an intended change, run `python -m tests.study.test_rl RESULTS_DIR` on each kind and say in the commit message why
# they moved.
GOLDEN_RUNS = (("algorithm=grpo_rr", "steps=4"), ("algorithm=gspo", "seed=1", "steps=4"))
GOLDEN_BY_CPU = {
    "AuthenticAMD avx512": {
        GOLDEN_RUNS[0]: {
            "reward_mean": [0.0625, 0.1875, 0.0, 0.0],
            "loss": [0.00048287, 0.00026077, 0.0, 0.0],
            "grad_norm": [0.38624861, 0.54216417, 0.0, 0.0],
            "approx_kl": [8.768e-05, 4.573e-05, 6.44e-06, 3.08e-06],
            "clip_frac": [0.0, 0.0, 0.0, 0.0],
            "response_len_mean": [25.5, 24.25, 27.6875, 32.5],
            "eval_in_dist": [None, 0.125, None, 0.125],
            "routing_slot_mismatch": [0.0, 0.0, 0.0, 0.00196336],
        },
        GOLDEN_RUNS[1]: {
            "reward_mean": [0.1875, 0.25, 0.0625, 0.0625],
            "loss": [0.00030972, 0.0, 3.356e-05, -3.75e-05],
            "grad_norm": [1.00125436, 0.0, 0.17576614, 0.30385649],
            "approx_kl": [0.00010723, 4.187e-05, 2.602e-05, 3.999e-05],
            "clip_frac": [0.0, 0.0, 0.1534296, 0.02702703],
            "response_len_mean": [22.125, 25.3125, 33.3125, 20.25],
            "eval_in_dist": [None, 0.125, None, 0.0625],
            "routing_slot_mismatch": [0.0009124, 0.0, 0.0006649, 0.00096526],
        },
    },
    "GenuineIntel amx": {
        GOLDEN_RUNS[0]: {
            "reward_mean": [0.0, 0.1875, 0.0, 0.125],
            "loss": [0.0, -0.00060749, 0.0, 9.85e-06],
            "grad_norm": [0.0, 0.63383907, 0.0, 1.05665603],
            "approx_kl": [0.0, 0.00030874, 3.48e-06, 2.544e-05],
            "clip_frac": [0.0, 0.0, 0.0, 0.0],
            "response_len_mean": [25.3125, 23.9375, 26.6875, 30.375],
            "eval_in_dist": [None, 0.0625, None, 0.0625],
            "routing_slot_mismatch": [0.0, 0.00144509, 0.00083893, 0.00069638],
        },
        GOLDEN_RUNS[1]: {
            "reward_mean": [0.0625, 0.1875, 0.0625, 0.1875],
            "loss": [0.00325099, -4.062e-05, 0.00065384, -3.102e-05],
            "grad_norm": [0.54627754, 0.15431628, 0.36072402, 1.00181341],
            "approx_kl": [0.0002694, 4.563e-05, 0.00010163, 0.00010668],
            "clip_frac": [0.0, 0.04651163, 0.05691057, 0.07142857],
            "response_len_mean": [22.1875, 25.3125, 30.0625, 19.875],
            "eval_in_dist": [None, 0.0625, None, 0.0625],
            "routing_slot_mismatch": [0.0, 0.0, 0.00072464, 0.00097656],
        },
    },
}
GOLDEN_COLUMNS = tuple(next(iter(GOLDEN_BY_CPU.values()))[GOLDEN_RUNS[0]])


@pytest.fixture(scope="module")
def golden_results(tmp_path_factory: pytest.TempPathFactory, tiny_coldstart: Path) -> Path:
    """The golden runs' own results directory, sharing the session's tiny cold start (trained in a fresh process)."""
    return sharing_coldstart(tiny_coldstart.parent.parent, tmp_path_factory.mktemp("golden"))


def isolated_run(sets: list[str], results: Path, **env: str) -> Path:
    """rl.run of the tiny preset with `sets` in a fresh interpreter: golden numbers measure the computation alone,
    whatever earlier tests left in the test process (importing vLLM leaves the numerics alone:
    tests/study/rollout/test_vllm_import.py)."""
    code = (
        "import sys\nfrom study import rl\nfrom study.run.config import load_config\n"
        "print(rl.run(load_config(preset='tiny', sets=sys.argv[2:]), sys.argv[1], progress=False))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(results), *sets],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def _golden_columns(run_dir: Path) -> dict[str, list[float | None]]:
    metrics = pd.read_parquet(run_dir / "metrics.parquet").iloc[1:]  # step 0: the start's held-out evaluation alone
    return {c: [None if v != v else float(v) for v in metrics[c]] for c in GOLDEN_COLUMNS}  # NaN: no evaluation


@pytest.mark.slow
@pytest.mark.parametrize("sets", GOLDEN_RUNS, ids=["grpo_rr", "gspo"])
def test_golden_numbers(golden_results: Path, sets: tuple[str, ...]) -> None:
    run_dir = isolated_run([*sets, "threads=1", "eval_every=2"], golden_results, STUDY_NATIVE="1")
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    start, metrics = metrics.iloc[0], metrics.iloc[1:]  # step 0: the start's held-out evaluation alone
    assert start["step"] == 0 and start["eval_in_dist"] >= 0 and pd.isna(start["reward_mean"])
    got = _golden_columns(run_dir)
    pinned = GOLDEN_BY_CPU.get(cpu_kind())
    if pinned is None:  # no numbers for this CPU kind: the run repeats itself exactly, and the numbers are shown
        again = isolated_run(
            [*sets, "threads=1", "eval_every=2"],
            sharing_coldstart(golden_results, golden_results / f"again-{'-'.join(sets)}"),
            STUDY_NATIVE="1",
        )
        assert _golden_columns(again) == got
        warnings.warn(f"no golden numbers pinned for CPU kind {cpu_kind()!r}; {sets}: {got}", stacklevel=1)
    for column, want in ({} if pinned is None else pinned[sets]).items():
        assert [g is None for g in got[column]] == [w is None for w in want], column
        assert [g for g in got[column] if g is not None] == pytest.approx(
            [w for w in want if w is not None], rel=1e-4, abs=2e-7
        ), column
    # A zero loss and gradient norm is a step without signal (every group's rewards equal: no advantage), not an update
    # that stopped working; the steps with signal carry the update's numbers.
    idle = metrics["grad_norm"].eq(0)
    assert metrics.loc[idle, "zero_var_group_frac"].eq(1).all() and metrics.loc[idle, "loss"].eq(0).all()
    assert metrics.loc[~idle, "zero_var_group_frac"].lt(1).all() and (~idle).sum() >= 2


# The C kernels are an accelerator: the same run on the torch paths samples the same tokens (rewards, lengths and
# clip fractions equal) and its float metrics agree to this relative tolerance (measured: 2e-4 at most on loss and
# approx_kl, values of ~1e-5; the kernels' sums run in another order, ~1e-6 per op). Documented in README.md.
KERNEL_RTOL = 1e-3


@pytest.mark.slow
def test_the_torch_paths_give_the_kernels_metrics(golden_results: Path) -> None:
    """`STUDY_NATIVE=0`: the golden grpo_rr run (in another results directory sharing the golden cold start, made
    with the kernels) within KERNEL_RTOL of the same run with the kernels, tokens identical."""
    run = [*GOLDEN_RUNS[0], "threads=1", "eval_every=2"]
    want = _golden_columns(isolated_run(run, golden_results, STUDY_NATIVE="1"))  # the golden run (done: read back)
    other = sharing_coldstart(golden_results, golden_results / "torch-paths")
    run_dir = isolated_run(run, other, STUDY_NATIVE="0")
    assert json.loads((run_dir / "manifest.json").read_text())["native_kernels"] is False
    got = _golden_columns(run_dir)
    for column in GOLDEN_COLUMNS:
        exact = column in ("reward_mean", "response_len_mean", "clip_frac", "eval_in_dist")
        assert [g is None for g in got[column]] == [w is None for w in want[column]], column
        pairs = [(g, w) for g, w in zip(got[column], want[column], strict=True) if w is not None]
        assert [g for g, _ in pairs] == pytest.approx(
            [w for _, w in pairs], rel=0 if exact else KERNEL_RTOL, abs=0 if exact else 1e-8
        ), column


@pytest.mark.slow
@pytest.mark.parametrize("how", ["absent", "no-compiler"])
def test_the_harness_runs_without_the_kernels(tmp_path: Path, how: str) -> None:
    """With study/kernels/ missing (its import fails) or no working C compiler (a fresh build cache), a tiny run
    completes on the torch paths; the manifest says the kernels did not run."""
    code = (
        "import sys\n"
        "if sys.argv[1] == 'absent':\n"
        "    sys.modules['study.kernels'] = None  # `import study.kernels` now fails, as if the folder were deleted\n"
        "from study import rl\n"
        "from study.run.config import load_config\n"
        "cfg = load_config(preset='tiny', sets=['coldstart=scratch', 'steps=2', 'eval_every=2'])\n"
        "print(rl.run(cfg, sys.argv[2], progress=False))\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CC": "false" if how == "no-compiler" else ""}
    env.pop("STUDY_NATIVE", None)
    out = subprocess.run(
        [sys.executable, "-c", code, how, str(tmp_path / "results")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    assert status(run_dir)["state"] == "completed"
    assert json.loads((run_dir / "manifest.json").read_text())["native_kernels"] is False
    if how == "no-compiler":
        assert "runs as torch ops" in out.stderr  # the build's warning


if __name__ == "__main__":  # the golden runs' numbers on this machine, to pin under its cpu_kind()
    results = Path(sys.argv[1])
    if not (results / "coldstart").is_dir():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "study.launch",
                "--coldstart",
                "tiny",
                "chain_sum",
                "--results",
                str(results),
                "--coldstart-settings",
                "{}",
            ],
            check=True,
        )
    print(repr(cpu_kind()))
    for sets in GOLDEN_RUNS:
        print(sets, _golden_columns(isolated_run([*sets, "threads=1", "eval_every=2"], results, STUDY_NATIVE="1")))
