"""Scorecard verdicts on synthetic studies whose answers are known by construction."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import power, scorecard, synthetic, tidy
from analysis.scorecard import CONTRADICTED, INCONCLUSIVE, NOT_IN_STUDY, SUPPORTED

C = synthetic.Curve


def _load(tmp_path, curves, *, seeds=(0, 1, 2, 3, 4), n_steps=60, grid=None):
    synthetic.make_study(tmp_path, curves, seeds=seeds, n_steps=n_steps, grid=grid)
    return tidy.load_study(tmp_path)


def test_c2_clearly_above_ten_is_supported(tmp_path) -> None:
    st = _load(tmp_path, {"gspo": C(clip_low=0.05, clip_high=0.1), "grpo": C(clip_low=0.0005, clip_high=0.0008)})
    r = scorecard.claim_c2(st)
    assert r.verdict == SUPPORTED, r
    assert r.evidence[0].low >= 10 and r.evidence[0].estimate == pytest.approx(0.15 / 0.0013, rel=0.05)
    assert "grpo" in r.evidence[0].name and "10" in r.rule


def test_c2_clearly_below_ten_is_contradicted(tmp_path) -> None:
    st = _load(tmp_path, {"gspo": C(clip_low=0.01, clip_high=0.02), "grpo": C(clip_low=0.005, clip_high=0.01)})
    r = scorecard.claim_c2(st)
    assert r.verdict == CONTRADICTED, r
    assert r.evidence[0].high < 10 and r.evidence[0].estimate == pytest.approx(2.0, rel=0.05)


def test_c2_noisy_around_ten_is_inconclusive(tmp_path) -> None:
    st = _load(tmp_path, {"gspo": C(clip_low=0.005, clip_high=0.005), "grpo": C(clip_low=0.0005, clip_high=0.0005)})
    # make the per-run means noisy: scale each gspo run's clip fraction by a seed-dependent factor around 1
    rng = np.random.default_rng(1)
    runs = st.runs.set_index("run_id")
    long = st.long.copy()
    is_clip = long["metric"].astype(str) == "clip_frac"
    factors = {rid: float(rng.uniform(0.3, 1.7)) for rid in runs.index}
    long.loc[is_clip, "value"] *= long.loc[is_clip, "run_id"].astype(str).map(factors).to_numpy()
    st.long = long
    r = scorecard.claim_c2(st)
    assert r.verdict == INCONCLUSIVE, r
    assert r.evidence[0].low < 10 <= r.evidence[0].high


def test_missing_algorithm_is_inconclusive_with_reason(tmp_path) -> None:
    st = _load(tmp_path, {"gspo": C(), "sapo": C()}, seeds=(0, 1))
    cards = {r.claim: r for r in scorecard.scorecard(st)}
    assert set(cards) == {"C1", "C2", "C3", "C4", "C5", "C6"}
    for claim in ("C1", "C2", "C3", "C4", "C5"):
        assert cards[claim].verdict == INCONCLUSIVE
        assert cards[claim].reason.startswith(NOT_IN_STUDY), cards[claim]
        assert cards[claim].label.startswith(f"inconclusive: {NOT_IN_STUDY}")
    assert "grpo" in cards["C1"].reason and "grpo" in cards["C2"].reason
    assert "max_new_tokens" in cards["C6"].reason  # length axis not swept


def test_c1_c3_c4_known_answers(tmp_path) -> None:
    curves = {
        "grpo": C(a=0.5, c_mid=2e12, collapse_step=30),
        "grpo_rr": C(a=0.5, c_mid=2e12),
        "gspo": C(a=0.8, c_mid=2e12),
        "gspo_rr": C(a=0.8, c_mid=2e12),
    }
    cards = {r.claim: r for r in scorecard.scorecard(_load(tmp_path, curves))}
    assert cards["C1"].verdict == SUPPORTED and "grpo_rr" in cards["C1"].evidence[0].name  # replay partner
    assert cards["C1"].evidence[0].estimate > 0.1
    assert cards["C3"].verdict == SUPPORTED and cards["C3"].evidence[0].estimate == 1.0
    assert cards["C4"].verdict == SUPPORTED, cards["C4"]


def test_c1_contradicted_and_c3_contradicted_when_reversed(tmp_path) -> None:
    curves = {"grpo": C(a=0.8, c_mid=2e12), "grpo_rr": C(a=0.8, c_mid=2e12), "gspo": C(a=0.4, c_mid=2e12)}
    cards = {r.claim: r for r in scorecard.scorecard(_load(tmp_path, curves))}
    assert cards["C1"].verdict == CONTRADICTED and cards["C1"].evidence[0].high < 0
    assert cards["C3"].verdict == CONTRADICTED  # free GRPO never collapses
    assert cards["C4"].reason.startswith(NOT_IN_STUDY)  # no gspo_rr


def test_c3_no_collapse_in_either_arm_is_inconclusive_with_three_seeds_not_contradicted(tmp_path) -> None:
    # 0 of 3 vs 0 of 3: a free-GRPO collapse rate of up to 56% is compatible with that (Wilson), so "free GRPO
    # collapses no more often" would read a bootstrap's [0, 0] as evidence; with 5 seeds an excess collapse rate of
    # 0.5 is excluded and the claim is contradicted
    same = {a: C(a=0.8, c_mid=2e12) for a in ("grpo", "grpo_rr", "gspo", "gspo_rr")}
    three = {r.claim: r for r in scorecard.scorecard(_load(tmp_path / "3", same, seeds=(0, 1, 2)))}
    c3 = three["C3"]
    assert c3.verdict == INCONCLUSIVE, c3
    assert c3.evidence[0].estimate == 0 and c3.evidence[0].high == pytest.approx(1.96**2 / (3 + 1.96**2), abs=1e-3)
    assert c3.reason.startswith("too few runs: 3 run(s) of grpo, no compared run collapsed")
    assert f"at least {scorecard.runs_to_exclude()} runs of grpo" in c3.reason and scorecard.runs_to_exclude() == 4
    c4 = three["C4"]  # the same reading for GSPO's collapse part: 3 runs without a collapse do not show it is stable
    assert (
        c4.verdict == INCONCLUSIVE and "too few runs: 3 run(s) of gspo" in c4.reason and "(for the claim)" in c4.reason
    )
    c3_5 = scorecard.claim_c3(_load(tmp_path / "5", same, seeds=(0, 1, 2, 3, 4)))
    assert c3_5.verdict == CONTRADICTED and c3_5.evidence[0].high < scorecard.COLLAPSE_MARGIN
    # the rule says so, in the numbers the code uses
    for text in (str(scorecard.COLLAPSE_DECISION), "Newcombe", f"only from {scorecard.runs_to_exclude()} runs"):
        assert text in c3.rule


def test_rate_difference_matches_newcombe_1998_and_wilson_bounds() -> None:
    from analysis import stats

    # Newcombe (1998), Statistics in Medicine 17:873, Table II, method 10
    for (k1, n1, k2, n2), (lo, hi) in {
        (56, 70, 48, 80): (0.0524, 0.3339),
        (9, 10, 3, 10): (0.1705, 0.8090),
        (6, 7, 2, 7): (0.0582, 0.8062),
        (5, 56, 0, 29): (-0.0381, 0.1926),
    }.items():
        d = stats.rate_difference(k1, n1, k2, n2)
        assert (round(d.low, 4), round(d.high, 4)) == (lo, hi)
    assert stats.wilson_interval(0, 10) == (0.0, pytest.approx(1.96**2 / (10 + 1.96**2), abs=1e-4))
    assert stats.wilson_interval(4, 4)[1] == 1.0 and np.isnan(stats.rate_difference(0, 0, 1, 2).low)


def test_c4_contradicted_when_gspo_needs_replay(tmp_path) -> None:
    curves = {"gspo": C(a=0.8, c_mid=2e12, collapse_step=30), "gspo_rr": C(a=0.8, c_mid=2e12)}
    assert scorecard.claim_c4(_load(tmp_path, curves)).verdict == CONTRADICTED


def test_c5_and_c6_with_axes(tmp_path) -> None:
    # rollout log-probs hurt nobody here (same curves) -> the drop difference is ~0: inconclusive, with evidence
    curves = {"gspo": C(a=0.8, c_mid=2e12), "grpo": C(a=0.6, c_mid=2e12)}
    st = _load(tmp_path, curves, seeds=(0, 1, 2), grid={"old_logp_source": ["recompute", "rollout"]})
    r = scorecard.claim_c5(st)
    assert r.verdict == INCONCLUSIVE and len(r.evidence) == 4 and r.evidence[0].low < 0 < r.evidence[0].high
    # every arm ran seeds 0-2: the contrast is paired by seed, and the verdict states the smallest detectable size
    assert r.evidence[0].n == "3 seeds, paired" and r.evidence[3].name.startswith(power.PREFIX)
    assert 0 < r.evidence[3].estimate < 1 and "these seeds detect a difference of" in r.reason
    assert scorecard.detectable_lines(r) == [r.evidence[3]]
    assert f"; {power.TARGET:g} needs " in r.evidence[3].name  # and how many seeds would detect the target size
    c6 = scorecard.claim_c6(st)
    assert c6.evidence[0].low > 0  # the sigmoid still rises over the last half of 60 steps


def test_replay_partner_comes_from_the_registry_and_must_be_in_the_study(tmp_path) -> None:
    # grpo_r3 shares GRPO's loss but replays the engine's routes: not the Routing Replay partner C3 compares with
    st = _load(tmp_path, {"grpo": C(collapse_step=20), "grpo_r3": C(), "gspo": C()}, seeds=(0, 1), n_steps=30)
    cards = {r.claim: r for r in scorecard.scorecard(st)}
    assert cards["C3"].reason.startswith(NOT_IN_STUDY) and "Routing Replay partner" in cards["C3"].reason
    assert "reward(grpo)" in cards["C1"].evidence[0].name  # no grpo_rr: the baseline is plain GRPO


# --- stratification: runs that differ in another swept axis are compared within their stratum, never pooled --------
def _two_strata(tmp_path, by_stratum, *, axis="max_new_tokens", seeds=(0, 1, 2, 3, 4), n_steps=60):
    """One synthetic study whose curves differ per value of `axis` (make_study once per value, same root)."""
    for value, curves in by_stratum.items():
        synthetic.make_study(tmp_path, curves, seeds=seeds, n_steps=n_steps, grid={axis: [value]})
    return tidy.load_study(tmp_path)


def test_c1_strata_that_disagree_are_contradicted_though_the_pooled_mean_favours_gspo(tmp_path) -> None:
    st = _two_strata(
        tmp_path,
        {
            256: {"gspo": C(a=0.9, c_mid=2e12), "grpo": C(a=0.3, c_mid=2e12)},  # GSPO far ahead
            1024: {"gspo": C(a=0.5, c_mid=2e12), "grpo": C(a=0.6, c_mid=2e12)},  # GSPO behind
        },
    )
    r = scorecard.claim_c1(st)
    assert [s.verdict for s in r.strata] == [SUPPORTED, CONTRADICTED]
    assert [s.key for s in r.strata] == [{"max_new_tokens": 256}, {"max_new_tokens": 1024}]
    assert r.verdict == CONTRADICTED  # contradicted in any stratum with data -> contradicted
    assert "contradicted in: max_new_tokens=1024" in r.reason and "supported in 1" in r.reason
    pooled = [e for e in r.evidence if e.stratum.startswith("pooled")]
    assert len(pooled) == 1 and pooled[0].estimate > 0.1  # pooling would have said "GSPO better"
    firsts = [e for e in r.evidence if e.verdict]
    assert [e.stratum for e in firsts] == ["max_new_tokens=256", "max_new_tokens=1024"]
    assert firsts[0].low > 0 and firsts[1].high < 0
    assert "max_new_tokens" in r.rule and scorecard.STRATA_RULE in r.rule
    table = scorecard.scorecard_table([r])
    assert table["strata"].iloc[0] == "2 strata: supported 1, contradicted 1"
    per = scorecard.strata_table([r])
    assert per["verdict"].tolist() == [SUPPORTED, CONTRADICTED] and per["claim"].tolist() == ["C1", "C1"]


def test_c1_supported_only_when_every_stratum_with_data_is(tmp_path) -> None:
    same = {"gspo": C(a=0.6, c_mid=2e12, noise=0.05), "grpo": C(a=0.6, c_mid=2e12, noise=0.05)}
    st = _two_strata(tmp_path, {256: {"gspo": C(a=0.9, c_mid=2e12), "grpo": C(a=0.3, c_mid=2e12)}, 1024: same})
    r = scorecard.claim_c1(st)
    assert [s.verdict for s in r.strata] == [SUPPORTED, INCONCLUSIVE] and r.verdict == INCONCLUSIVE


def test_stratum_without_one_algorithm_has_no_data_and_does_not_count(tmp_path) -> None:
    st = _two_strata(
        tmp_path,
        {
            "bf16": {"gspo": C(clip_low=0.05, clip_high=0.1), "grpo": C(clip_low=0.0005, clip_high=0.0008)},
            "fp16": {"gspo": C(clip_low=0.001, clip_high=0.001)},  # no GRPO here: nothing to compare
        },
        axis="rollout_dtype",
    )
    r = scorecard.claim_c2(st)
    assert [s.verdict for s in r.strata] == [SUPPORTED, scorecard.NO_DATA]
    assert r.verdict == SUPPORTED and "(1 without)" in r.reason
    assert any(e.verdict == scorecard.NO_DATA and e.stratum == "rollout_dtype=fp16" for e in r.evidence)


def test_algorithm_specific_axes_are_pooled_and_determined_axes_not_split(tmp_path) -> None:
    # hparams.eps_high is swept for GSPO and takes another value for GRPO (no stratum could hold both): pooled,
    # flagged. (A key with one value per algorithm is no axis at all: tidy.infer_axes.)
    # train_dtype follows train_precision: stratifying on train_precision already splits it.
    for alg, curve, eps in (
        ("gspo", C(clip_low=0.05, clip_high=0.1), [4e-4, 5e-4]),
        ("grpo", C(clip_low=5e-4, clip_high=8e-4), [0.27]),
    ):
        for prec, dtype in (("fp32", "fp32"), ("bf16-emulated", "bf16")):
            synthetic.make_study(
                tmp_path,
                {alg: curve},
                seeds=(0, 1, 2),
                n_steps=40,
                grid={"hparams.eps_high": eps, "train_precision": [prec], "train_dtype": [dtype]},
            )
    st = tidy.load_study(tmp_path)
    assert st.axes == ["hparams.eps_high", "train_dtype", "train_precision"]
    r = scorecard.claim_c2(st)
    assert len(r.strata) == 2 and [list(s.key) for s in r.strata] == [["train_dtype"], ["train_dtype"]]
    assert "CONFOUNDED, not stratified: the compared groups share no value of hparams.eps_high" in r.rule
    assert "Determined by the stratified axes: train_precision" in r.rule
    assert r.verdict == SUPPORTED


def test_c5_stratifies_on_the_other_axes_but_not_its_own(tmp_path) -> None:
    curves = {"gspo": C(a=0.8, c_mid=2e12), "grpo": C(a=0.6, c_mid=2e12)}
    synthetic.make_study(
        tmp_path,
        curves,
        seeds=(0, 1, 2),
        n_steps=40,
        grid={"old_logp_source": ["recompute", "rollout"], "rollout_dtype": ["bf16", "fp16"]},
    )
    r = scorecard.claim_c5(tidy.load_study(tmp_path))
    assert [s.key for s in r.strata] == [{"rollout_dtype": "bf16"}, {"rollout_dtype": "fp16"}]
    assert "Not stratified on the claim's own axis old_logp_source" in r.rule


def test_every_rule_quotes_the_decisions_its_verdict_is_read_from(tmp_path) -> None:
    curves = {"grpo": C(a=0.5), "grpo_rr": C(a=0.6), "gspo": C(a=0.8), "gspo_rr": C(a=0.8)}
    st = _load(tmp_path, curves, seeds=(0, 1), n_steps=20)
    for r in [*scorecard.scorecard(st), *scorecard.scorecard(_load(tmp_path / "empty", {"sapo": C()}, seeds=(0,)))]:
        for decision in scorecard.DECISIONS[r.claim]:
            assert str(decision) in r.rule, (r.claim, r.rule)
    assert set(scorecard.DECISIONS) == set(scorecard.CLAIMS)


def test_heldout_gain_per_configuration_and_why_not_for_older_runs(tmp_path) -> None:
    # synthetic eval_in_dist: 0.9 x R0 at step 0, 0.9 x the reward at the eval steps: the gain is known
    curves = {"gspo": C(a=0.8, c_mid=2e12, noise=0.0), "grpo": C(a=0.5, c_mid=2e12, noise=0.0)}
    st = _load(tmp_path / "new", curves, seeds=(0, 1, 2), grid={"max_new_tokens": [256, 1024]})
    g = scorecard.heldout_gain(st)
    assert g.available and g.axes == ["max_new_tokens"] and len(g.table) == 4
    t = g.table.set_index(["algorithm", "max_new_tokens"])
    truth = {a: 0.9 * (synthetic.sigmoid(6e12, r0=0.1, a=c.a, b=c.b, c_mid=c.c_mid) - 0.1) for a, c in curves.items()}
    for (alg, _), row in t.iterrows():
        assert row["gain"] == pytest.approx(truth[alg], abs=0.02) and row["low"] > 0 and row["n"] == row["runs"] == 3
        assert row["final_step"] == "60" and row["label"] == scorecard.style.label(alg)
    heads = [h for h, _ in g.lines()]
    assert heads == [f"Held-out gain, {scorecard.style.label(a)}:" for a in ("grpo", "gspo")]
    assert "over 2 configurations of max_new_tokens" in g.lines()[0][1]
    one = scorecard.heldout_gain(_load(tmp_path / "one", {"gspo": C(a=0.8, c_mid=2e12)}, seeds=(0, 1, 2)))
    ((_, text),) = one.lines()
    assert text.startswith("RL raised held-out pass@1 (eval_in_dist) by 0.") and "(n=3): 0.0" in text, text
    assert "at step 0 -> " in text and text.endswith("at step 60")
    synthetic.make_study(tmp_path / "old", {"gspo": C()}, seeds=(0, 1), n_steps=20, start_eval=False)
    old = scorecard.heldout_gain(tidy.load_study(tmp_path / "old"))
    assert not old.available and old.table.empty
    assert old.lines() == [("Held-out gain:", f"not available: {old.reason}")]
    assert "no run has an evaluation of its starting policy" in old.reason
