"""A regime reached through an emulation is labelled so wherever it is shown: runs with the routing-volatility dial
(router_kick > 0) that reach C3/C4's volatility read their verdicts as before, with "emulated regime" on the
precondition's evidence line, in the headline's regime column and on the claims page; runs without it read "in
regime"."""

from __future__ import annotations

import pytest

from analysis.claims import common, scorecard
from analysis.figures import claims_forest
from analysis.report import claims_page, headline
from analysis.runs import tidy
from analysis.stats import regime
from analysis.stats.verdicts import NOT_IN_REGIME, SUPPORTED
from tests.analysis import synthetic


def _cards(root, grid, rules=common.Rules(min_volatility=0.02)):  # noqa: B008 - a frozen dataclass
    # router_lr_scale 300 with these truths: 2.1% of slots per update, GRPO without replay collapses in every seed
    synthetic.make_study(root, synthetic.routing_truth(300.0), seeds=(0, 1, 2, 3, 4), n_steps=60, grid=grid)
    return {c.claim: c for c in scorecard.scorecard(tidy.load_study(root), rules)}


@pytest.mark.parametrize(("kick", "reached"), [(0.08, regime.EMULATED), (0.0, "in regime")])
def test_a_dialled_regime_is_labelled_emulated_and_an_undialled_one_is_not(tmp_path, kick, reached) -> None:
    cards = _cards(tmp_path, {"router_kick": [kick], "router_lr_scale": [300.0]})
    c3 = cards["C3"]
    assert c3.verdict == SUPPORTED  # the emulation labels the regime; it does not change the verdict
    (line,) = [e for e in c3.evidence if e.name.startswith("routing volatility (")]
    assert (f"{regime.EMULATED}: routing-volatility dial router_kick = 0.08" in line.name) == bool(kick)
    text = headline.regime_text(c3, common.Rules(min_volatility=0.02))
    assert text.startswith(f"{reached}: 2.") and "per update" in text
    assert claims_page.regime_kind(text) == ("emulated" if kick else "natural")


def test_a_dialled_study_below_the_regime_still_reads_not_tested(tmp_path) -> None:
    c3 = _cards(tmp_path, {"router_kick": [0.01], "router_lr_scale": [300.0]}, common.RULES)["C3"]
    assert c3.verdict == NOT_IN_REGIME  # 2.1% per update against the default 5%: the dial did not reach the regime
    assert c3.reason.startswith(f"{regime.EMULATED} (routing-volatility dial router_kick = 0.01): routing volatility")
    assert headline.regime_text(c3).startswith("not in regime: ")


def test_a_declared_claim_below_its_regime_shows_no_role_in_the_headline() -> None:
    below = common.ClaimResult("C3", "s", NOT_IN_REGIME, "rule", role="primary", declared="replay_cost_grpo")
    tested = common.ClaimResult("C3", "s", SUPPORTED, "rule", role="primary", declared="replay_cost_grpo")
    assert headline.verdict_text(below) == NOT_IN_REGIME  # a comparison below the regime decides nothing
    assert headline.verdict_text(tested) == f"primary: {SUPPORTED}"


def test_each_declared_comparison_is_read_in_its_own_strata_regime(tmp_path) -> None:
    """Two declared comparisons of C3, one per dose: the dose whose runs stay below the regime is reported as the
    replication it is, and the claim is decided by the one in regime alone, its volatility measured on its own runs
    (not averaged with the other dose's)."""
    from analysis.claims import declared

    c = synthetic.Curve
    for kick, per_update in ((0.01, 0.009), (0.06, 0.10)):
        curves = {"grpo": c(a=0.3, c_mid=2e12), "grpo_rr": c(a=0.8, c_mid=2e12)}
        curves = {k: c(a=v.a, c_mid=2e12, slot_mismatch=per_update, per_update=per_update) for k, v in curves.items()}
        synthetic.make_study(tmp_path, curves, seeds=(0, 1, 2), n_steps=40, grid={"router_kick": [kick]})
    study = tidy.load_study(tmp_path)
    comparisons = [
        declared.Comparison.from_entry(
            {**synthetic.COMPARISON, "name": f"at_{kick}", "stratum": {"router_kick": kick}, "threshold": -0.1}
        )
        for kick in (0.01, 0.06)
    ]
    c3 = {r.claim: r for r in scorecard.scorecard(study, comparisons=comparisons)}["C3"]
    assert c3.verdict == SUPPORTED  # GRPO gains far less than GRPO + RR at 10% per update
    assert c3.declared_reading.startswith(f"{scorecard.BELOW_REGIME}: at_0.01: ") and "at_0.06: difference" in (
        c3.declared_reading
    )
    volatility = {e.stratum: e.estimate for e in c3.evidence if e.name.startswith("routing volatility (")}
    assert volatility["at_0.01"] == pytest.approx(0.009, rel=0.2) and volatility["at_0.06"] == pytest.approx(
        0.1, rel=0.2
    )
    assert "per update 0.9" in c3.regime  # the comparison below the regime, named with its measured value
    text = headline.regime_text(c3)
    assert text.startswith(f"{regime.EMULATED}: 0.") and "to 1" in text  # each comparison's own value
    assert [e.label for e in claims_forest.estimates(c3)] == ["at_0.01", "at_0.06"]
