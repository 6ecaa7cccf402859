"""Scorecard verdicts on synthetic studies whose answers are known by construction."""

from __future__ import annotations

import re

import numpy as np
import pytest

from analysis.claims import common, declared, scorecard
from analysis.claims.c1_reward import claim_c1
from analysis.claims.c2_clipping import claim_c2
from analysis.claims.c3_grpo_replay import claim_c3
from analysis.claims.c4_gspo_replay import claim_c4
from analysis.claims.c5_precision import claim_c5
from analysis.claims.c6_scaling import claim_c6
from analysis.claims.common import NOT_IN_STUDY
from analysis.claims.replay import runs_to_exclude
from analysis.report import headline
from analysis.runs import tidy
from analysis.stats import power
from analysis.stats.verdicts import CONTRADICTED, INCONCLUSIVE, NO_DATA, NOT_IN_REGIME, SUPPORTED
from tests.analysis import synthetic

C = synthetic.Curve


def _load(tmp_path, curves, *, seeds=(0, 1, 2, 3, 4), n_steps=60, grid=None):
    synthetic.make_study(tmp_path, curves, seeds=seeds, n_steps=n_steps, grid=grid)
    return tidy.load_study(tmp_path)


def test_c2_clearly_above_ten_is_supported(tmp_path) -> None:
    st = _load(tmp_path, {"gspo": C(clip_low=0.05, clip_high=0.1), "grpo": C(clip_low=0.0005, clip_high=0.0008)})
    r = claim_c2(st)
    assert r.verdict == SUPPORTED, r
    assert r.evidence[0].low >= 10 and r.evidence[0].estimate == pytest.approx(0.15 / 0.0013, rel=0.05)
    assert "grpo" in r.evidence[0].name and "10" in r.rule


def test_c2_clearly_below_ten_is_contradicted(tmp_path) -> None:
    st = _load(tmp_path, {"gspo": C(clip_low=0.01, clip_high=0.02), "grpo": C(clip_low=0.005, clip_high=0.01)})
    r = claim_c2(st)
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
    r = claim_c2(st)
    assert r.verdict == INCONCLUSIVE, r
    assert r.evidence[0].low < 10 <= r.evidence[0].high


def test_missing_algorithm_is_inconclusive_with_reason(tmp_path) -> None:
    st = _load(tmp_path, {"gspo": C(), "sapo": C()}, seeds=(0, 1))
    cards = {r.claim: r for r in scorecard.scorecard(st)}
    assert set(cards) == {"C1", "C2", "C3", "C4", "C5", "C6"}
    for claim in ("C1", "C2", "C3", "C4", "C5"):
        assert cards[claim].verdict == INCONCLUSIVE
        assert cards[claim].reason.startswith(NOT_IN_STUDY), cards[claim]
        assert cards[claim].label.startswith(f"exploratory: inconclusive: {NOT_IN_STUDY}")
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
    assert f"at least {runs_to_exclude()} runs of grpo" in c3.reason and runs_to_exclude() == 4
    c4 = three["C4"]  # the same reading for GSPO's collapse part: 3 runs without a collapse do not show it is stable
    assert (
        c4.verdict == INCONCLUSIVE and "too few runs: 3 run(s) of gspo" in c4.reason and "(for the claim)" in c4.reason
    )
    c3_5 = claim_c3(_load(tmp_path / "5", same, seeds=(0, 1, 2, 3, 4)))
    assert c3_5.verdict == CONTRADICTED and c3_5.evidence[0].high < common.COLLAPSE_MARGIN
    # the rule says so, in the numbers the code uses
    for text in (str(common.COLLAPSE_DECISION), "Newcombe", f"only from {runs_to_exclude()} runs"):
        assert text in c3.rule


def test_rate_difference_matches_newcombe_1998_and_wilson_bounds() -> None:
    from analysis.stats import intervals

    # Newcombe (1998), Statistics in Medicine 17:873, Table II, method 10
    for (k1, n1, k2, n2), (lo, hi) in {
        (56, 70, 48, 80): (0.0524, 0.3339),
        (9, 10, 3, 10): (0.1705, 0.8090),
        (6, 7, 2, 7): (0.0582, 0.8062),
        (5, 56, 0, 29): (-0.0381, 0.1926),
    }.items():
        d = intervals.rate_difference(k1, n1, k2, n2)
        assert (round(d.low, 4), round(d.high, 4)) == (lo, hi)
    assert intervals.wilson_interval(0, 10) == (0.0, pytest.approx(1.96**2 / (10 + 1.96**2), abs=1e-4))
    assert intervals.wilson_interval(4, 4)[1] == 1.0 and np.isnan(intervals.rate_difference(0, 0, 1, 2).low)


def test_c4_contradicted_when_gspo_needs_replay(tmp_path) -> None:
    curves = {"gspo": C(a=0.8, c_mid=2e12, collapse_step=30), "gspo_rr": C(a=0.8, c_mid=2e12)}
    assert claim_c4(_load(tmp_path, curves)).verdict == CONTRADICTED


def test_c5_and_c6_with_axes(tmp_path) -> None:
    # rollout log-probs hurt nobody here (same curves) -> the drop difference is ~0: inconclusive, with evidence
    curves = {"gspo": C(a=0.8, c_mid=2e12), "grpo": C(a=0.6, c_mid=2e12)}
    st = _load(tmp_path, curves, seeds=(0, 1, 2), grid={"old_logp_source": ["recompute", "rollout"]})
    r = claim_c5(st)
    assert r.verdict == INCONCLUSIVE and len(r.evidence) == 5 and r.evidence[0].low < 0 < r.evidence[0].high
    # the mismatch the claim needs was measured (synthetic mismatch_mean_abs ~0.0105 >= 0.001), last
    assert r.evidence[4].name.startswith("engine/trainer mismatch") and r.evidence[4].estimate == pytest.approx(
        0.0105, abs=1e-3
    )
    # every arm ran seeds 0-2: the contrast is paired by seed, and the verdict states the smallest detectable size
    assert r.evidence[0].n == "3 seeds, paired" and r.evidence[3].name.startswith(power.PREFIX)
    assert 0 < r.evidence[3].estimate < 1 and "these seeds detect a difference of" in r.reason
    assert common.detectable_lines(r) == [r.evidence[3]]
    assert f"; {power.TARGET:g} needs " in r.evidence[3].name  # and how many seeds would detect the target size
    c6 = claim_c6(st)
    assert c6.evidence[0].low > 0  # the sigmoid still rises over the last half of 60 steps
    # compute part supported, length part not in this study: the conjunction is inconclusive, saying why
    assert c6.verdict == INCONCLUSIVE and "axis max_new_tokens not swept" in c6.reason, c6
    assert "compute part: supported" in c6.reason


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
    r = claim_c1(st)
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
    r = claim_c1(st)
    assert [s.verdict for s in r.strata] == [SUPPORTED, INCONCLUSIVE] and r.verdict == INCONCLUSIVE


def test_stratum_without_one_algorithm_has_no_data_and_does_not_count(tmp_path) -> None:
    st = _two_strata(
        tmp_path,
        {
            "bf16": {"gspo": C(clip_low=0.05, clip_high=0.1), "grpo": C(clip_low=0.0005, clip_high=0.0008)},
            "fp16": {"gspo": C(clip_low=0.001, clip_high=0.001)},  # no GRPO here: nothing to compare
        },
        axis="rollout_precision",
    )
    r = claim_c2(st)
    assert [s.verdict for s in r.strata] == [SUPPORTED, NO_DATA]
    assert r.verdict == SUPPORTED and "(1 without)" in r.reason
    assert any(e.verdict == NO_DATA and e.stratum == "rollout_precision=fp16" for e in r.evidence)


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
    r = claim_c2(st)
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
        grid={"old_logp_source": ["recompute", "rollout"], "rollout_precision": ["bf16", "fp16"]},
    )
    r = claim_c5(tidy.load_study(tmp_path))
    assert [s.key for s in r.strata] == [{"rollout_precision": "bf16"}, {"rollout_precision": "fp16"}]
    assert "Not stratified on the claim's own axis old_logp_source" in r.rule


def test_every_rule_quotes_the_decisions_its_verdict_is_read_from(tmp_path) -> None:
    curves = {"grpo": C(a=0.5), "grpo_rr": C(a=0.6), "gspo": C(a=0.8), "gspo_rr": C(a=0.8)}
    st = _load(tmp_path, curves, seeds=(0, 1), n_steps=20)
    for r in [*scorecard.scorecard(st), *scorecard.scorecard(_load(tmp_path / "empty", {"sapo": C()}, seeds=(0,)))]:
        for decision in common.DECISIONS[r.claim]:
            assert str(decision) in r.rule, (r.claim, r.rule)
    assert set(common.DECISIONS) == set(common.CLAIMS)


# --- C6's verdict: compute and length parts ---------------------------------------------------------------------------
@pytest.mark.parametrize(("long_a", "verdict"), [(0.8, SUPPORTED), (0.4, CONTRADICTED)])
def test_c6_supported_when_longer_generation_learns_more_and_contradicted_when_less(tmp_path, long_a, verdict):
    # every GSPO run still rises over its last half (c_mid far out); at max_new_tokens 1024 the asymptote is long_a,
    # at 256 it is 0.6: the length gain's sign decides the claim
    short, long = C(a=0.6, c_mid=1e13, noise=0.01, truncation=0.02), C(a=long_a, c_mid=1e13, noise=0.01)
    st = _two_strata(tmp_path, {256: {"gspo": short}, 1024: {"gspo": long}}, seeds=(0, 1, 2))
    r = claim_c6(st)
    assert r.verdict == verdict, r
    # the shortest budget cut ~1% of the responses: in the length part's regime, measured on the 256-token runs only
    trunc = next(e for e in r.evidence if e.name.startswith("truncation at the shortest budget ("))
    assert trunc.estimate == pytest.approx(0.01, abs=2e-3) and trunc.n == "3" and not r.regime
    length = [e for e in r.evidence if e.name.startswith("RL's length gain") and e.verdict]
    assert len(length) == 1 and (length[0].low > 0 if verdict == SUPPORTED else length[0].high < 0)
    assert "compute part supported, length part " + verdict in r.reason
    # the verdict is on RL's part (the held-out gain at each length); truncation's part is reported beside it: the
    # same cold start (R0 = 0.1) at both lengths here, so it is ~0
    names = [e.name for e in r.evidence]
    assert "RL's held-out gain at max_new_tokens=256" in names and "RL's held-out gain at max_new_tokens=1024" in names
    trunc = next(e for e in r.evidence if e.name.startswith("truncation's part before RL"))
    assert trunc.low < 0 < trunc.high and abs(trunc.estimate) < 0.02
    assert r.paper.startswith("truncation's part before RL (cold start at max_new_tokens=1024 minus at 256)")
    assert r.split == "train + validation" and "eval_in_dist" in r.design


# --- regimes: C3, C4 and C5 tested only where their precondition was measured ---------------------------------------
def _routing(tmp_path, scales, **kwargs):
    synthetic.make_routing_study(tmp_path, scales=scales, seeds=(0, 1, 2, 3, 4), n_steps=60, **kwargs)
    return tidy.load_study(tmp_path)


def test_c3_c4_below_the_volatility_threshold_are_not_tested_in_regime_never_contradicted(tmp_path) -> None:
    # router_lr_scale 1: the routing moves 0.26% of expert slots since pi_old (as measured on the default study); no
    # GRPO run collapses, and with 5 seeds C3's interval would exclude an excess collapse rate of 0.5: contradicted,
    # were the claim not out of its regime
    st = _routing(tmp_path, (1.0,))
    cards = {r.claim: r for r in scorecard.scorecard(st)}
    for claim, alg in (("C3", "grpo"), ("C4", "gspo")):
        r = cards[claim]
        assert r.verdict == NOT_IN_REGIME, r
        assert r.evidence[0].name == "routing volatility (routing_slot_mismatch_mb2; threshold 0.05)"
        assert r.evidence[0].estimate == pytest.approx(0.0026 * 1.1, rel=0.05)  # the synthetic truth, +10% drift
        assert r.reason.startswith(
            "routing volatility: cumulative 0.29%, per update 0.29% of expert slots changed since pi_old (n=10 runs), "
            "below the 5% per update the claim needs (the paper's model: ~10% after one update)"
        )
        assert f"below the regime, {alg} collapsed in 0 of 5 runs and {alg}_rr in 0 of 5" in r.reason
        assert "evidence about this scale" in r.reason and r.label.startswith(f"{NOT_IN_REGIME}: routing volatility")
        assert "at or above 5% of expert slots changed since pi_old" in r.rule  # the threshold, in the rule sentence
    # the same runs with a threshold they reach: C3's normal verdict comes back, the measured value last
    low = {r.claim: r for r in scorecard.scorecard(st, common.Rules(min_volatility=0.002))}
    assert low["C3"].verdict == CONTRADICTED and low["C3"].evidence[-1].name.startswith("routing volatility")
    assert "at or above 0.2% of expert slots changed since pi_old" in low["C3"].rule and not low["C3"].regime


def test_high_volatility_gives_the_normal_verdicts_and_mixed_strata_count_only_those_in_regime(tmp_path) -> None:
    # scale 300: 2.1% of slots since pi_old, GRPO without replay collapses at step 40 in every seed; scale 1: 0.26%
    st = _routing(tmp_path, (1.0, 300.0))
    rules = common.Rules(min_volatility=0.02)
    cards = {r.claim: r for r in scorecard.scorecard(st, rules)}
    c3 = cards["C3"]
    assert [s.verdict for s in c3.strata] == [NOT_IN_REGIME, SUPPORTED]
    assert c3.verdict == SUPPORTED and c3.strata_summary == "2 strata: supported 1, not tested in regime 1"
    below = "not tested in regime: routing volatility per update 0.29% of expert slots changed since pi_old in 1 of 2"
    assert below in c3.reason
    c4 = cards["C4"]
    assert c4.strata[0].verdict == NOT_IN_REGIME and c4.strata[1].verdict != NOT_IN_REGIME
    # every stratum below the default threshold: not tested anywhere
    default = {r.claim: r for r in scorecard.scorecard(st)}
    assert default["C3"].verdict == default["C4"].verdict == NOT_IN_REGIME
    assert "per update 0.29% to 2.3% of expert slots changed since pi_old in 2 of 2 strata" in default["C3"].reason
    assert "below the 5% per update the claim needs (the paper's model: ~10% after one update)" in default["C3"].reason
    assert "grpo collapsed in 5 of 10 runs and grpo_rr in 0 of 10" in default["C3"].reason


def test_c3_without_an_off_policy_minibatch_is_not_tested(tmp_path) -> None:
    # one minibatch per rollout batch: routing_slot_mismatch is NaN at every step, the volatility is unmeasured
    import pyarrow as pa
    import pyarrow.parquet as pq

    synthetic.make_routing_study(tmp_path, scales=(300.0,), seeds=(0, 1, 2, 3, 4), n_steps=60)
    for path in (tmp_path / "runs").glob("*/metrics.parquet"):
        t = pq.read_table(path)
        for name in ("routing_slot_mismatch", "routing_slot_mismatch_mb2"):
            i = t.column_names.index(name)
            t = t.set_column(i, name, pa.array([None] * t.num_rows, pa.float64()))
        pq.write_table(t, path)
    r = claim_c3(tidy.load_study(tmp_path))
    assert r.verdict == NOT_IN_REGIME and "not measured (routing_slot_mismatch_mb2, routing_slot_mismatch)" in r.reason


def test_a_volatility_reached_only_cumulatively_is_not_the_papers_regime(tmp_path) -> None:
    # 64 minibatches of small updates add up to 7.7% of slots since pi_old, but one update moves 0.66%: the paper's
    # model moved ~10% in one update, so C3 and C4 are not tested, and the sentence gives both numbers
    curves = {
        alg: C(a=0.6, c_mid=2e12, slot_mismatch=0.07, per_update=0.006)
        for alg in ("grpo", "grpo_rr", "gspo", "gspo_rr")
    }
    st = _load(tmp_path, curves, seeds=(0, 1, 2, 3, 4), n_steps=40)
    for r in (claim_c3(st), claim_c4(st)):
        assert r.verdict == NOT_IN_REGIME, r
        head = rf"{NOT_IN_REGIME}: routing volatility: cumulative 7\.[6-9]%, per update 0\.6[4-8]% of expert slots"
        assert re.match(head, r.label), r.label  # the synthetic truth, 1.1 x each (drift)
        assert "below the 5% per update the claim needs" in r.reason and "only the cumulative reaches it" in r.reason
        assert "routing_slot_mismatch_mb2" in r.rule and "does not decide" in r.rule
    # the same cumulative volatility reached in one update is the regime
    st2 = _load(
        tmp_path / "one",
        {a: C(a=0.6, c_mid=2e12, slot_mismatch=0.07) for a in curves},
        seeds=(0, 1, 2, 3, 4),
        n_steps=40,
    )
    assert claim_c3(st2).verdict != NOT_IN_REGIME


def test_c5_needs_a_measured_engine_trainer_mismatch(tmp_path) -> None:
    # fp32 in both engines: the engine's log-probs are the recompute's to ~1e-6; GRPO's reward drops when it takes
    # them (a = 0.4 vs 0.8) and GSPO's does not, which would support the claim were there any mismatch to tolerate
    for src, grpo_a in (("recompute", 0.8), ("rollout", 0.4)):
        synthetic.make_study(
            tmp_path,
            {"gspo": C(a=0.8, c_mid=2e12, mismatch=1e-6), "grpo": C(a=grpo_a, c_mid=2e12, mismatch=1e-6)},
            seeds=(0, 1, 2),
            n_steps=40,
            grid={"old_logp_source": [src]},
        )
    st = tidy.load_study(tmp_path)
    r = claim_c5(st)
    assert r.verdict == NOT_IN_REGIME, r
    head = "engine/trainer mismatch 1.05e-06 nats per response token (n=12 runs), below the 0.001 nats the claim needs"
    assert r.reason == head
    assert "at or above 0.001 nats per response token" in r.rule
    assert claim_c5(st, common.Rules(min_mismatch=1e-7)).verdict == SUPPORTED


def test_rules_refuse_what_is_not_a_threshold() -> None:
    for bad in (-0.1, float("nan"), "5%"):
        with pytest.raises(ValueError, match="min_volatility"):
            common.Rules(min_volatility=bad)


def test_c1_window_is_the_one_its_rule_names(tmp_path) -> None:
    """C1 reads curves.compute_window over the compute both arms reached, and its rule quotes that window's text."""
    from analysis.runs import vocab
    from analysis.stats import curves

    st = _load(tmp_path, {"gspo": C(a=0.8, c_mid=1e12), "grpo": C(a=0.5, c_mid=1e12)}, seeds=(0, 1, 2), n_steps=40)
    res = claim_c1(st)
    assert curves.window_rule(curves.WINDOW_FRAC, curves.COMMON_END) in res.rule
    assert "the last 10% of compute" in res.rule
    c_end = float(st.runs["last_compute"].max())
    win = curves.compute_window(st.long, vocab.REWARD, budget=c_end)
    alg = win["algorithm"].astype(str)
    by_alg = {e.name: e.estimate for e in res.evidence}
    for name in ("gspo", "grpo"):
        assert by_alg[f"reward({name})"] == pytest.approx(win.loc[alg == name, "value"].mean())
        assert (win.loc[alg == name, "compute_from"] >= 0.9 * c_end).all()


def _declared(seeds, **kw):
    from analysis.claims import declared

    entry = {**synthetic.COMPARISON, "name": "replay_cost_grpo", "threshold": -0.1, "seeds": list(seeds), **kw}
    return declared.Comparison.from_entry(entry)


_REPLAY = {"grpo": C(a=0.3, c_mid=2e12), "grpo_rr": C(a=0.8, c_mid=2e12), "gspo": C(a=0.8, c_mid=2e12)}


def test_a_declared_comparison_decides_its_claim_and_the_others_are_exploratory(tmp_path) -> None:
    from analysis.claims import declared

    st = _load(tmp_path, _REPLAY, seeds=(0, 1, 2), n_steps=40)
    comp = _declared((0, 1, 2))
    cards = {r.claim: r for r in scorecard.scorecard(st, comparisons=[comp])}
    c3, c1 = cards["C3"], cards["C1"]
    conf = declared.confirm(st.long, comp, st.runs)
    assert not conf.deviations and c3.verdict == conf.reading.verdict == SUPPORTED  # grpo gains far less
    assert (c3.role, c3.split, c3.pairing, c3.declared) == ("primary", "validation", common.PAIRED, comp.name)
    assert c3.evidence[0].estimate == pytest.approx(conf.reading.interval.estimate) and "paired" in c3.evidence[0].n
    assert "two-sided 95% interval" in c3.evidence[0].name and c3.regime == ""  # in regime: 10% per update
    assert c3.label.startswith(
        "primary, declared replay_cost_grpo: supported (replay_cost_grpo: difference detected, with the declared sign)"
    )
    assert scorecard.DECLARED_RULE in c3.rule
    # the reason names what the declared test tested, then the old reading, for reference
    assert c3.reason.startswith(
        "replay_cost_grpo declared eval_in_dist (gain) algorithm=grpo - algorithm=grpo_rr differs from 0 (two-sided; "
        "sized for -0.1): difference detected, with the declared sign, "
    )
    assert "the exploratory reading of the whole study: " in c3.reason
    # undeclared claims: exploratory, labelled so, with their split and pairing
    assert c1.role == "exploratory" and c1.label.startswith("exploratory: ") and c1.split == "train"
    assert "unit of replication" in c1.pairing and "no declared comparison" in c1.design


def test_a_declared_comparison_below_the_claims_regime_leaves_the_claim_not_tested(tmp_path) -> None:
    """Runs at 0.9% of expert slots moved per update (the claim needs 5%; the paper's model ~10%) where replay helped
    GRPO: C3 stays not tested in regime, its regime line kept, and the declared reading stands beside it as the
    replication of a gap at this scale."""
    below = {k: C(a=v.a, c_mid=2e12, slot_mismatch=0.07, per_update=0.009) for k, v in _REPLAY.items()}
    st = _load(tmp_path, below, seeds=(0, 1, 2), n_steps=40)
    assert claim_c3(st).verdict == NOT_IN_REGIME
    c3 = {r.claim: r for r in scorecard.scorecard(st, comparisons=[_declared((0, 1, 2))])}["C3"]
    assert c3.verdict == NOT_IN_REGIME and "per update 0.9" in c3.regime and "below the 5% per update" in c3.regime
    assert c3.declared == "replay_cost_grpo" and c3.role == "primary"
    assert c3.declared_reading == (
        f"{scorecard.BELOW_REGIME}: replay_cost_grpo: difference detected, with the declared sign"
    )
    assert c3.label.startswith(f"not tested in regime: {c3.regime}; {scorecard.BELOW_REGIME}, not a test of the claim")
    assert headline.regime_text(c3).startswith("not in regime: 0.9")
    assert c3.evidence[0].name.startswith("routing volatility (")
    # the same runs at 7% per update: in regime, the declared comparison decides
    above = {k: C(a=v.a, c_mid=2e12, slot_mismatch=0.09, per_update=0.07) for k, v in _REPLAY.items()}
    st = _load(tmp_path / "above", above, seeds=(0, 1, 2), n_steps=40)
    c3 = {r.claim: r for r in scorecard.scorecard(st, comparisons=[_declared((0, 1, 2))])}["C3"]
    assert c3.verdict == SUPPORTED and c3.regime == "" and headline.regime_text(c3).startswith("in regime: 7")


def test_runs_that_deviate_from_the_declaration_are_flagged_under_the_headline(tmp_path) -> None:
    st = _load(tmp_path, _REPLAY, seeds=(0, 1, 2), n_steps=40)
    cards = scorecard.scorecard(st, comparisons=[_declared((0, 1, 2, 3))])  # seed 3 was never run
    c3 = {r.claim: r for r in cards}["C3"]
    assert c3.role == "exploratory" and any("[3]" in d for d in c3.deviations)
    assert c3.label.startswith("exploratory, declared replay_cost_grpo: ")
    assert "the runs deviate from replay_cost_grpo" in c3.design
    cls, _, text = headline.deviation_line(cards)
    assert cls == "deviation" and "C3" in text and "[3]" in text
    table = scorecard.scorecard_table(cards).set_index("claim")
    assert "[3]" in table.loc["C3", "deviations"] and table.loc["C1", "deviations"] == ""


def test_c2_reads_its_ratio_beside_the_papers_two_orders_of_magnitude(tmp_path) -> None:
    from analysis.stats import design
    from analysis.stats.intervals import CI

    # GSPO clips 0.06 of tokens, GRPO 0.0012: ratio 50, log(50) / log(100) = 0.85 of the paper's orders of magnitude
    curves = {"gspo": C(clip_low=0.02, clip_high=0.04), "grpo": C(clip_low=0.0004, clip_high=0.0008)}
    st = _load(tmp_path, curves, seeds=(0, 1, 2))
    r = claim_c2(st)
    ratio = r.evidence[0]
    assert ratio.estimate == pytest.approx(50, rel=0.05) and ratio.low > 1
    want = design.size_against_paper(CI(ratio.estimate, ratio.low, ratio.high, 3))
    assert r.paper.startswith("direction supported, size 0.85 of the paper's") and r.paper == want.sentence
    assert "vs the paper's ~100x" in r.paper and "two orders of magnitude" in r.rule
    row = headline.headline_table([r]).df.iloc[0]  # the headline: the paper's ~100x beside this study's ratio
    assert row["paper"].startswith("~100x") and row["this study: estimate [95% CI]"].startswith(
        f"{ratio.estimate:.3g} ["
    )


def test_c6_length_is_decided_on_rls_part_not_on_truncations(tmp_path) -> None:
    # the longer budget starts higher (cold start R0 0.3 vs 0.1: truncation, before any RL) and ends at the same
    # asymptote: the final held-out score is no higher, RL gained less there, so the length part is contradicted,
    # and truncation's part (+0.18) is reported beside it
    st = _two_strata(
        tmp_path,
        {
            256: {"gspo": C(a=0.7, r0=0.1, c_mid=1e12, noise=0.01, truncation=0.02)},
            1024: {"gspo": C(a=0.7, r0=0.3, c_mid=1e12, noise=0.01, truncation=0.02)},
        },
        seeds=(0, 1, 2),
    )
    r = claim_c6(st)
    rl = next(e for e in r.evidence if e.name.startswith("RL's length gain"))
    trunc = next(e for e in r.evidence if e.name.startswith("truncation's part before RL"))
    assert rl.high < 0 and trunc.low > 0.1 and trunc.estimate == pytest.approx(0.9 * 0.2, abs=0.03)
    assert "length part contradicted" in r.reason and r.verdict == CONTRADICTED
    assert "truncation's part before RL" in r.paper and "beside RL's" in r.paper


def test_c6_length_part_is_not_tested_where_the_shortest_budget_cuts_the_answers(tmp_path) -> None:
    # the same gain as a supported length part, but the 256-token budget cut ~15% of the responses: the length part
    # is not tested in regime (measured on the shortest budget's runs), so it decides nothing and the claim, whose
    # compute part alone is supported, is inconclusive
    short, long = C(a=0.6, c_mid=1e13, noise=0.01, truncation=0.3), C(a=0.8, c_mid=1e13, noise=0.01, truncation=0.0)
    st = _two_strata(tmp_path, {256: {"gspo": short}, 1024: {"gspo": long}}, seeds=(0, 1, 2))
    r = claim_c6(st)
    assert r.verdict == INCONCLUSIVE and "length part not tested in regime" in r.reason, r.reason
    trunc = next(e for e in r.evidence if e.name.startswith("truncation at the shortest budget ("))
    assert trunc.estimate == pytest.approx(0.15, abs=0.01)  # the 256-token runs' mean only, not the 1024's 0
    assert r.regime.startswith("truncation at the shortest budget 15% of responses cut at the budget (n=3 runs)")
    assert "above the 2% the claim allows at most" in r.regime
    assert headline.regime_text(r).startswith("not in regime: 15% (needs at most 2%")
    # a looser ceiling, set as the scorecard's rule, puts the same runs in regime
    assert claim_c6(st, common.Rules(max_truncation=0.2)).verdict == SUPPORTED


def test_a_declared_length_comparison_keeps_c6s_regime(tmp_path) -> None:
    # a declared comparison of the two budgets, its runs below the regime (the 256-token budget cuts ~15%): C6 stays
    # not tested in regime, with the declared reading beside it
    short, long = C(a=0.6, c_mid=1e13, noise=0.01, truncation=0.3), C(a=0.8, c_mid=1e13, noise=0.01, truncation=0.0)
    st = _two_strata(tmp_path, {256: {"gspo": short}, 1024: {"gspo": long}}, seeds=(0, 1, 2))
    arms = {"axis": "max_new_tokens", "treatment": 1024, "control": 256}
    entry = {**synthetic.COMPARISON, "claim": "C6", "arms": arms, "threshold": 0.05, "alternative": "greater"}
    c = declared.Comparison.from_entry({**entry, "stratum": {"algorithm": "gspo"}})
    c6 = {r.claim: r for r in scorecard.scorecard(st, comparisons=[c])}["C6"]
    assert c6.verdict == NOT_IN_REGIME and scorecard.BELOW_REGIME in c6.reason
    assert "truncation at the shortest budget 15%" in c6.regime
    assert c6.read_at == (0.0,)  # a difference is read against 0


def test_a_declaration_the_runs_cannot_be_read_by_says_so_instead_of_a_number(tmp_path) -> None:
    # two runs of one seed in the declared arm (no stratum separates the two lengths): no pair, no reading
    st = _two_strata(tmp_path, {256: _REPLAY, 1024: _REPLAY}, seeds=(0, 1, 2))
    c3 = {r.claim: r for r in scorecard.scorecard(st, comparisons=[_declared((0, 1, 2))])}["C3"]
    assert c3.role == "exploratory" and c3.verdict == INCONCLUSIVE
    assert any("several runs of seed(s) [0, 1, 2]" in d for d in c3.deviations)
    assert "no reading (" in c3.evidence[0].name and "nan" not in str(c3.evidence[0])


def _shift_by_seed(st, metric: str, offsets: dict[int, float]) -> None:
    """Add a per-seed offset to every run's `metric`, the same for every arm of a seed (what a seed's shared prompts,
    cold start and evaluation sampling do to its arms)."""
    seed_of = dict(zip(st.runs["run_id"].astype(str), st.runs["seed"].astype(int), strict=True))
    long = st.long.copy()
    rows = long["metric"].astype(str) == metric
    long.loc[rows, "value"] += long.loc[rows, "run_id"].astype(str).map(seed_of).map(offsets).to_numpy()
    st.long = long


def test_c1_pairs_by_seed_where_the_arms_share_seeds(tmp_path) -> None:
    """A seed's arms move together (a large per-seed offset) and GSPO is ahead by 0.05 in every seed: the unpaired
    interval spans 0, the paired one excludes it; the evidence's n says the pairing."""
    from analysis.stats import intervals

    st = _load(tmp_path, {"gspo": C(a=0.65, c_mid=1e12, noise=0.0), "grpo": C(a=0.6, c_mid=1e12, noise=0.0)})
    _shift_by_seed(st, "reward_mean", {0: -0.2, 1: 0.15, 2: 0.0, 3: 0.25, 4: -0.1})
    res = claim_c1(st)
    first = res.evidence[0]
    assert first.n == "5 seeds, paired" and first.low > 0, first
    assert res.verdict == SUPPORTED and "paired by seed" in res.pairing
    seeds: dict[str, list] = {}
    groups = {g: st.runs["algorithm"].astype(str) == g for g in ("gspo", "grpo")}
    vals, _ = common.final_at_common_compute(st, groups, seeds=seeds)
    welch = intervals.mean_difference(vals["gspo"], vals["grpo"])
    assert welch.low < 0 < welch.high and first.estimate == pytest.approx(welch.estimate)


def test_c1_and_c2_fall_back_to_welch_when_the_arms_ran_other_seeds(tmp_path) -> None:
    synthetic.make_study(tmp_path, {"gspo": C(a=0.7, c_mid=1e12, clip_low=0.05, clip_high=0.1)}, seeds=(0, 1, 2))
    synthetic.make_study(tmp_path, {"grpo": C(a=0.5, c_mid=1e12, clip_low=0.001, clip_high=0.002)}, seeds=(5, 6, 7))
    st = tidy.load_study(tmp_path)
    for res in (claim_c1(st), claim_c2(st)):
        assert res.evidence[0].n == "3 vs 3", res.evidence[0]


def test_c2_pairs_the_log_ratio_by_seed(tmp_path) -> None:
    """Clip fractions that scale together within a seed: the per-seed ratio is 20 in every seed, so the paired
    interval is tight around 20 while the ratio of noisy means is wide."""
    st = _load(tmp_path, {"gspo": C(clip_low=0.02, clip_high=0.02), "grpo": C(clip_low=0.001, clip_high=0.001)})
    seed_of = dict(zip(st.runs["run_id"].astype(str), st.runs["seed"].astype(int), strict=True))
    factor = {0: 0.2, 1: 3.0, 2: 1.0, 3: 0.5, 4: 2.0}
    long = st.long.copy()
    rows = long["metric"].astype(str) == "clip_frac"
    long.loc[rows, "value"] *= long.loc[rows, "run_id"].astype(str).map(seed_of).map(factor).to_numpy()
    st.long = long
    first = claim_c2(st).evidence[0]
    assert first.n == "5 seeds, paired" and first.estimate == pytest.approx(20.0, rel=0.05), first
    assert 15 < first.low <= first.high < 27, first
