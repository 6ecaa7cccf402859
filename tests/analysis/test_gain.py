"""The held-out gain: per run the last evaluation minus the step-0 one, per configuration its seed mean and interval,
and why it is not available for runs that never evaluated their start."""

import pytest

from analysis.runs import names, tidy
from analysis.stats import gain
from tests.analysis import synthetic

C = synthetic.Curve


def _load(tmp_path, curves, *, seeds=(0, 1, 2, 3, 4), n_steps=60, grid=None):
    synthetic.make_study(tmp_path, curves, seeds=seeds, n_steps=n_steps, grid=grid)
    return tidy.load_study(tmp_path)


def test_heldout_gain_is_the_last_evaluation_minus_the_step0_one(tmp_path, with_and_without_start):
    import pyarrow.parquet as pq

    new, old = with_and_without_start
    per_run = gain.per_run(new.long).set_index("run_id")
    assert (
        len(per_run) == len(new.runs) and gain.per_run(old.long).empty
    )  # runs without a step-0 evaluation: no gain, no row
    for rid, row in per_run.iterrows():
        m = pq.read_table(tmp_path / "True" / "runs" / rid / "metrics.parquet").to_pandas()
        ev = m.dropna(subset=["eval_in_dist"])
        assert ev["step"].iloc[0] == 0 and row["start"] == ev["eval_in_dist"].iloc[0]
        assert row["final_step"] == ev["step"].iloc[-1] > 0 and row["final"] == ev["eval_in_dist"].iloc[-1]
        assert row["value"] == row["final"] - row["start"]
    collapsed = new.runs.loc[new.runs["state"] == "collapsed", "run_id"]
    assert (per_run.loc[collapsed, "final_step"] == 30).all()  # its last evaluation before it stopped (step 32)


def test_heldout_gain_per_configuration_and_why_not_for_older_runs(tmp_path) -> None:
    # synthetic eval_in_dist: 0.9 x R0 at step 0, 0.9 x the reward at the eval steps: the gain is known
    curves = {"gspo": C(a=0.8, c_mid=2e12, noise=0.0), "grpo": C(a=0.5, c_mid=2e12, noise=0.0)}
    st = _load(tmp_path / "new", curves, seeds=(0, 1, 2), grid={"max_new_tokens": [256, 1024]})
    g = gain.heldout_gain(st)
    assert g.available and g.axes == ["max_new_tokens"] and len(g.table) == 4
    t = g.table.set_index(["algorithm", "max_new_tokens"])
    truth = {a: 0.9 * (synthetic.sigmoid(6e12, r0=0.1, a=c.a, b=c.b, c_mid=c.c_mid) - 0.1) for a, c in curves.items()}
    for (alg, _), row in t.iterrows():
        assert row["gain"] == pytest.approx(truth[alg], abs=0.02) and row["low"] > 0 and row["n"] == row["runs"] == 3
        assert row["final_step"] == "60" and row["label"] == names.label(alg)
    heads = [h for h, _ in g.lines()]
    assert heads == [f"Held-out gain, {names.label(a)}:" for a in ("grpo", "gspo")]
    assert "over 2 configurations of max_new_tokens" in g.lines()[0][1]
    one = gain.heldout_gain(_load(tmp_path / "one", {"gspo": C(a=0.8, c_mid=2e12)}, seeds=(0, 1, 2)))
    ((_, text),) = one.lines()
    assert text.startswith("RL raised held-out pass@1 (eval_in_dist, the validation split,") and "(n=3): 0.0" in text, (
        text
    )
    assert "at step 0 -> " in text and text.endswith("at step 60")
    synthetic.make_study(tmp_path / "old", {"gspo": C()}, seeds=(0, 1), n_steps=20, start_eval=False)
    old = gain.heldout_gain(tidy.load_study(tmp_path / "old"))
    assert not old.available and old.table.empty
    assert old.lines() == [("Held-out gain:", f"not available: {old.reason}")]
    assert "no run has an evaluation of its starting policy" in old.reason


def test_the_heldout_gain_reads_the_test_split_where_the_study_scored_one(tmp_path) -> None:
    import pandas as pd

    from analysis.runs import vocab

    st = _load(tmp_path / "s", {"gspo": C(a=0.8, c_mid=2e12, noise=0.0)}, seeds=(0, 1, 2))
    assert gain.heldout_metric(st) == vocab.EVAL_IN_DIST
    ev = st.long[st.long["metric"] == vocab.EVAL_IN_DIST]
    first_last = ev.groupby("run_id", observed=True)["step"].transform(lambda s: s.isin([s.min(), s.max()]))
    test = ev[first_last].assign(value=ev.loc[first_last, "value"] + 0.25 * (ev.loc[first_last, "step"] > 0))
    test = test.assign(metric=vocab.TEST_IN_DIST)  # scored at the first and last evaluations, as runs score it
    cats = [*st.long["metric"].cat.categories, vocab.TEST_IN_DIST]
    long = pd.concat([st.long.astype({"metric": str}), test.astype({"metric": str})], ignore_index=True)
    st.long = long.astype({"metric": pd.CategoricalDtype(cats)})
    g = gain.heldout_gain(st)
    validation = gain.heldout_gain(st, vocab.EVAL_IN_DIST)
    assert g.metric == vocab.TEST_IN_DIST and validation.metric == vocab.EVAL_IN_DIST
    assert g.table["gain"].iloc[0] == pytest.approx(validation.table["gain"].iloc[0] + 0.25)
    ((_, text),) = g.lines()
    assert text.startswith("RL raised held-out pass@1 (test_in_dist, the test split, which no choice of the design")
    ((_, text),) = validation.lines()
    assert "(eval_in_dist, the validation split, the held-out set the design may have been chosen on)" in text
