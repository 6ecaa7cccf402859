"""Token samples (token_samples.parquet): loaded with bounded memory, exact per-sequence log-ratios, Figure 4b's
histogram shows the known log-ratio distribution, and runs without the file are a skipped panel, never a crash."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis import figures
from analysis.figures import MissingData
from analysis.runs import columns, tidy
from tests.analysis import synthetic

from .conftest import TOKEN_TRUTH

C = synthetic.Curve


def test_sequence_log_ratios_are_exact_and_tokens_bounded(tmp_path):
    cols, truth = synthetic.synthetic_token_samples([1, 4, 6], mu=0.03, sigma=0.01, rng=np.random.default_rng(3))
    cfg = {"algorithm": "gspo", "seed": 0, "train_precision": "bf16-emulated"}
    synthetic.write_run(tmp_path / "runs", "r1", config=cfg, status={"state": "completed"}, metrics=None, tokens=cols)
    n_rows = len(cols["step"])
    st = tidy.load_study(tmp_path, max_token_rows=500)
    assert len(st.tokens) == 500 < n_rows  # subsampled ...
    assert len(st.sequences) == 3 * synthetic.TOKEN_SEQS  # ... but every sequence is kept, from every token
    seq = st.sequences.sort_values(["step", "sample"])
    np.testing.assert_allclose(seq["seq_log_ratio"], truth, atol=2e-6)  # float32 log-probs
    assert seq["n_tokens"].sum() == n_rows
    assert set(st.tokens["step"]) <= {1, 4, 6} and st.tokens["trainer_logp"].dtype == np.float32
    # joined run columns, the precision keys (not swept here) and the emulation flag from the manifest
    assert {"run_id", "algorithm", "seed", "train_precision", "old_logp_source", "precision_emulated"} <= set(st.tokens)
    assert st.tokens["train_precision"].astype(str).unique().tolist() == ["bf16-emulated"]
    assert bool(st.runs["precision_emulated"].iloc[0])
    again = tidy.load_study(tmp_path, max_token_rows=500)
    pd.testing.assert_frame_equal(st.tokens, again.tokens)  # the subset is seeded by the run id
    full = tidy.load_study(tmp_path, max_token_rows=10**9)
    assert len(full.tokens) == n_rows


def test_histogram_table_shows_the_known_log_ratio_distribution(study):
    made = figures.figure4b_token_logprobs(study)
    t = made.tables["seq_log_ratio"].set_index("config")
    hist = made.tables["seq_log_ratio_hist"]
    assert (
        len(t) == 2
    )  # rollout_precision bf16 / fp16 (train_precision and old_logp_source unset in the synthetic configs)
    for cfg, row in t.iterrows():
        mu, sigma = TOKEN_TRUTH["bf16" if "bf16" in cfg else "fp16"]
        assert row["mean"] == pytest.approx(mu, abs=4 * sigma / np.sqrt(row["n_sequences"]))
        assert row["std"] == pytest.approx(sigma, rel=0.05)
        h = hist[hist["config"] == cfg]
        assert h["count"].sum() == row["n_sequences"]  # edge bins hold the tails: nothing dropped
        peak = h.iloc[int(np.argmax(h["count"].to_numpy()))]
        assert peak["bin_left"] - 2 * sigma < mu < peak["bin_right"] + 2 * sigma
        assert cfg in {a.get_title() for a in made.fig.axes}
    # one stairs artist per configuration, with the table's fractions
    stairs = [a for ax in made.fig.axes for a in ax.patches if str(a.get_gid()).startswith("hist-")]
    assert len(stairs) == 2
    assert "length-normalised" in made.caption and "mean over the sequence's tokens" in made.caption
    assert "EMULATED" not in made.caption  # the synthetic runs say nothing about emulation


def test_scatter_has_identity_line_and_hexbins_when_dense(study):
    made = figures.figure4b_token_logprobs(study, hexbin_above=10)
    scat = [ax for ax in made.fig.axes if any(line.get_gid() == "y=x" for line in ax.get_lines())]
    assert len(scat) == 2
    assert all(ax.collections for ax in scat) and "hexbins" in made.caption
    summary = made.tables["tokens"]
    assert (summary["n_tokens"] > 0).all() and (summary["pearson_r"] > 0.99).all()


def test_emulated_runs_are_said_so_in_the_caption(tmp_path):
    synthetic.make_study(
        tmp_path,
        {"gspo": C(), "grpo": C()},
        seeds=(0, 1),
        n_steps=20,
        grid={"train_precision": ["fp32", "bf16-emulated"], "old_logp_source": ["recompute", "rollout"]},
        token_mismatch=lambda c: (0.0, 0.001) if c["train_precision"] == "fp32" else (0.01, 0.005),
    )
    st = tidy.load_study(tmp_path)
    assert st.runs["precision_emulated"].sum() == len(st.runs) // 2
    made = figures.figure4b_token_logprobs(st, axes=("train_precision", "old_logp_source"))
    assert "EMULATED in 8 of 16 runs" in made.caption
    titles = [ax.get_title() for ax in made.fig.axes]
    assert "bf16-emulated / rollout (emulated)" in titles and "fp32 / rollout" in titles


def test_runs_without_token_samples_skip_the_panel_with_a_reason(tmp_path):
    synthetic.make_study(tmp_path, {"gspo": C()}, seeds=(0, 1), n_steps=20)
    st = tidy.load_study(tmp_path)
    assert st.tokens.empty and st.sequences.empty and st.runs["error"].isna().all()
    with pytest.raises(MissingData, match=r"token_samples\.parquet"):
        figures.figure4b_token_logprobs(st)
    out = figures.make_all(st, tmp_path / "figs", only=["figure4b_token_logprobs"])
    assert "token_samples.parquet" in out.skipped["figure4b_token_logprobs"]
    back = st.write(tmp_path / "tidy")
    assert back["tokens"].exists()
    assert tidy.read_study(tmp_path / "tidy").tokens.empty


def test_a_broken_token_file_is_reported_not_raised(tmp_path):
    ids = synthetic.make_study(tmp_path, {"gspo": C()}, seeds=(0,), n_steps=20, token_mismatch=lambda c: (0, 0.01))
    pq.write_table(pa.table({"step": [1], "sample": [0]}), tmp_path / "runs" / ids[0] / "token_samples.parquet")
    st = tidy.load_study(tmp_path)
    assert "token_samples.parquet: missing column(s) pos, trainer_logp, engine_logp" in st.runs["error"].iloc[0]
    assert st.tokens.empty


def test_tokens_round_trip_through_write(study, tmp_path):
    study.write(tmp_path / "tidy")
    back = tidy.read_study(tmp_path / "tidy")
    assert len(back.tokens) == len(study.tokens) and len(back.sequences) == len(study.sequences)
    assert len(study.tokens) <= columns.MAX_TOKEN_ROWS * len(study.runs)


def test_token_budget_bounds_the_whole_study(tmp_path):
    synthetic.make_study(tmp_path, {"gspo": C()}, seeds=(0, 1, 2, 3), n_steps=20, token_mismatch=lambda c: (0, 0.01))
    st = tidy.load_study(tmp_path, token_budget=1000)
    per_run = st.tokens.groupby("run_id", observed=True).size()
    assert len(per_run) == 4 and (per_run == 250).all()  # 1000 // 4 runs, each run has more than that
    assert st.sequences.groupby("run_id", observed=True).size().eq(3 * synthetic.TOKEN_SEQS).all()  # untouched
