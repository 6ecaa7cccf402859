"""Figure 9 (Routing Replay along off-policy updates) and the outcome the report leads with, on synthetic studies
whose answers are known (analysis.synthetic.offpolicy_truth): one that reproduces Figure 3 at the one M in the regime
(outcome i), one where every arm breaks there, the dense control included (outcome ii)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import figures
from analysis.claims import offpolicy
from analysis.claims.offpolicy import DENSE, HELD_OUT, MOE
from analysis.figures import MissingData, style
from analysis.figures.fig8_routing_volatility import routing_volatility_tables
from analysis.report import build as report
from analysis.runs import columns, names, tidy, vocab
from analysis.runs.results import CSV_EXACT
from analysis.stats import curves, design
from tests.analysis import synthetic

M = vocab.MINIBATCH_AXIS
RUN = {"n_steps": synthetic.OFFPOLICY_STEPS, "flops_per_step": 1e11}


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[Path, tidy.Study]]:
    out = {}
    for reproduced in (True, False):
        root = tmp_path_factory.mktemp(f"offpolicy_{reproduced}")
        synthetic.make_offpolicy_study(root, reproduced=reproduced)
        out[reproduced] = (root, tidy.load_study(root))
    return out


@pytest.fixture(scope="module")
def made(studies) -> dict[bool, figures.Made]:
    return {k: figures.figure9_offpolicy_replay(st) for k, (_, st) in studies.items()}


def _truth(m: int, family: str, alg: str, reproduced: bool = True) -> synthetic.Curve:
    return synthetic.offpolicy_truth(m, reproduced=reproduced)[family][alg]


def _gain(c: synthetic.Curve) -> float:
    return synthetic.expected_gain(c, eval_every=synthetic.OFFPOLICY_EVERY, **RUN)


def _final(c: synthetic.Curve) -> float:
    return synthetic.expected_final_reward(c, **RUN)


def test_an_axis_only_the_dense_control_sets_is_read_as_missing_for_the_moe(studies) -> None:
    # the dense control's config overrides model.moe_ffn_hidden_size, the MoE's does not: the per-run tables and the
    # figures that group by every axis read it as missing for the MoE instead of failing
    _, st = studies[True]
    per_run = curves.compute_window(st.long, vocab.REWARD)
    ffn = per_run.set_index("run_id")["model.moe_ffn_hidden_size"]
    dense = st.runs.loc[st.runs["model.num_experts"] == 1, "run_id"]
    assert (ffn[dense] == 1024).all() and ffn.drop(dense).isna().all()
    figures.figure1_reward(st)
    assert len(routing_volatility_tables(st)["volatility"]) == 8  # 4 M x (MoE, dense)


def test_figure9_tables_hold_the_known_answer(made, tmp_path, layout_problems) -> None:
    tables = made[True].tables
    vol, arms, gaps, loss = (tables[k] for k in ("volatility", "arms", "gaps", "offpolicy_loss"))
    # (a) the MoE's volatility per M: none at M = 1 (no off-policy minibatch), 1.1 x the truth elsewhere (+20% drift)
    assert vol[M].tolist() == list(synthetic.OFFPOLICY_MINIBATCHES) and vol["n"].tolist() == [0, 12, 12, 12]
    truth = [synthetic.OFFPOLICY_VOLATILITY[m] * 1.1 for m in (4, 16, 64)]
    np.testing.assert_allclose(vol["mean"].iloc[1:], truth, rtol=0.03)
    assert vol["in_regime"].tolist() == [False, False, False, True]
    # (b) every arm's gain and final reward: the dense control apart from the MoE by its model config
    assert set(arms.loc[arms["model"] == DENSE, "algorithm"]) == {"grpo"}
    assert len(arms[(arms["model"] == MOE) & (arms["quantity"] == HELD_OUT)]) == 4 * 4 - 2
    for _, r in arms.iterrows():
        c = _truth(int(r[M]), r["model"], r["algorithm"])
        known = _gain(c) if r["quantity"] == HELD_OUT else _final(c)
        assert r["low"] - 0.01 <= known <= r["high"] + 0.01, (r.to_dict(), known)
    # (c) the gaps: GRPO - GRPO + RR opens at M = 64 only, GSPO's never; the dense control's loss at each M
    for _, r in gaps.iterrows():
        m, q = int(r[M]), r["quantity"]
        f = _gain if q == HELD_OUT else _final
        if r["model"] == MOE:
            known = f(_truth(m, MOE, r["minuend"])) - f(_truth(m, MOE, r["subtrahend"]))
        else:
            known = f(_truth(m, DENSE, "grpo")) - f(_truth(1, DENSE, "grpo"))
        # the family's simultaneous intervals cover every known gap together (95%); each unadjusted one is narrower
        assert r["simultaneous_low"] <= known <= r["simultaneous_high"], (r.to_dict(), known)
        assert r["simultaneous_low"] < r["low"] and r["high"] < r["simultaneous_high"]
        assert r["pairing"] == "paired by seed" and r["n"] == "3 seeds, paired" and r["p"] <= r["p_holm"]
    n = len(gaps)
    assert (gaps["family"].str.startswith(f"exploratory, family of {n}, Holm-adjusted")).all()
    assert gaps["family"].str.contains("unit of replication: seed").all()
    grpo = gaps[(gaps["minuend"] == "grpo") & (gaps["model"] == MOE)]
    assert (grpo.loc[grpo[M] == 64, "high"] < -0.2).all() and (grpo.loc[grpo[M] < 64, "high"] > 0).all()
    assert set(gaps.loc[gaps["model"] == DENSE, M]) == {4, 16, 64}
    # the off-policy loss beyond the dense control: GRPO at M = 64 only
    held = loss[loss["quantity"] == HELD_OUT].set_index(["algorithm", M])
    assert held.loc[("grpo", 64), "excess_high"] < 0 and held.loc[("grpo_rr", 64), "baseline"] == "grpo"
    assert (held.drop(("grpo", 64))["excess_high"] > 0).all()
    # collapses: GRPO's three runs at M = 64, in the table and the caption
    coll = tables["collapse_rate"]
    assert coll.loc[coll["collapsed"] > 0, ["algorithm", M, "collapsed", "runs"]].values.tolist() == [
        ["grpo", 64, 3, 3]
    ]
    assert "GRPO (MoE) at M = 64 3 of 3" in made[True].caption
    assert "collapse_rate" not in made[False].tables and "No run collapsed." in made[False].caption
    # the figure renders, reads at a glance, and its caption states the definitions and n
    paths = style.save(made[True].fig, tmp_path / made[True].name)
    assert all(p.stat().st_size > 1000 for p in paths) and paths[0].suffix == ".png"
    assert layout_problems(made[True].fig) == []
    assert not [ax for ax in made[True].fig.axes if ax.get_legend() is not None]
    cap = made[True].caption
    assert (
        "threshold 5%" in cap
        and "paired by seed" in cap
        and "Holm" in cap
        and "dense control 3/3/3/3" in cap
        and "GSPO 3/3/3/3" in cap
    )
    dense_line = [
        ln for ln in made[True].fig.axes[1].get_children() if getattr(ln, "get_gid", lambda: "")() == "arm-dense-grpo"
    ]
    assert dense_line


def test_figure9_final_reward_is_the_compute_window_its_caption_names(made, studies) -> None:
    _, st = studies[True]
    arms, caption = made[True].tables["arms"], made[True].caption
    assert curves.window_rule() in caption
    win = curves.compute_window(st.long, vocab.REWARD).set_index("run_id")
    runs = st.runs[st.runs["model.num_experts"] != 1]
    for _, r in arms[(arms["model"] == MOE) & (arms["quantity"] == offpolicy.FINAL)].iterrows():
        ids = runs.loc[(runs["algorithm"].astype(str) == r["algorithm"]) & (runs[M] == r[M]), "run_id"].astype(str)
        assert r["mean"] == pytest.approx(win.loc[ids, "value"].mean(), rel=1e-12), r.to_dict()


def test_figure9_gaps_are_paired_by_seed_and_read_as_one_holm_family(made, studies) -> None:
    from analysis.stats import gain

    _, st = studies[True]
    gaps = made[True].tables["gaps"]
    per = gain.per_run(st.long, vocab.EVAL_IN_DIST)
    per = per[per["model.num_experts"] != 1].set_index(["algorithm", M, "seed"])["value"]
    row = gaps[(gaps["minuend"] == "grpo") & (gaps[M] == 64) & (gaps["quantity"] == HELD_OUT)].iloc[0]
    x, y = (per.xs((a, 64), level=("algorithm", M)).to_dict() for a in ("grpo", "grpo_rr"))
    want = design.paired_difference(x, y)
    assert (row["estimate"], row["low"], row["high"], row["p"]) == pytest.approx(
        (want.ci.estimate, want.ci.low, want.ci.high, want.p_value)
    )
    np.testing.assert_allclose(gaps["p_holm"], design.holm(gaps["p"].tolist()))


def test_outcome_i_reproduces_figure3_with_its_numbers(made) -> None:
    tables = made[True].tables
    said = offpolicy.outcome(tables)
    assert (said.kind, said.reproduced, said.strata) == (offpolicy.IN_REGIME, True, (64,))
    text = " ".join(said.sentences)
    assert text.startswith("Outcome (i): at M = 64 the MoE's routing volatility was cumulative 7.7% [")
    assert "per update 6% of expert slots" in text and "at or above the 5% per-update threshold" in text
    assert "Figure 3 is reproduced there" in text and "GRPO collapsed in 3 of 3 runs there." in text
    ex = tables["offpolicy_loss"].set_index(["algorithm", M, "quantity"])
    r = ex.loc[("grpo", 64, HELD_OUT)]
    assert f"{r['excess']:+.3f} [{r['excess_low']:+.3f}, {r['excess_high']:+.3f}] for GRPO," in text
    # at a lower threshold M = 16 (1.3% per update) enters the regime too: there GRPO did not fall, so it is not
    # reproduced there, while M = 64 still reproduces it
    lower = offpolicy.outcome(tables, threshold=0.012)
    assert lower.strata == (16, 64) and lower.reproduced
    assert "Figure 3 is not reproduced there (GRPO did not fall beyond it)" in lower.sentences[1]
    assert lower.sentences[3].startswith("Figure 3 is reproduced there")


def test_outcome_ii_names_the_highest_volatility_the_dense_controls_limit_and_the_excluded_gap(made) -> None:
    tables = made[False].tables
    said = offpolicy.outcome(tables)
    assert (said.kind, said.reproduced, said.strata) == (offpolicy.NOT_IN_REGIME, None, ())
    first, dense, excluded = said.sentences
    arms = tables["arms"].set_index(["model", "algorithm", M, "quantity"])
    d64, g64 = arms.loc[(DENSE, "grpo", 64, HELD_OUT)], arms.loc[(MOE, "gspo", 64, HELD_OUT)]
    assert d64["mean"] < 0  # the dense control fell where the volatility reached the regime
    assert "The highest routing volatility reached was cumulative 7.7% [" in first
    assert "at M = 64, at or above the 5% per-update threshold" in first
    assert f"(GRPO) was {d64['mean']:+.3f} [{d64['low']:+.3f}, {d64['high']:+.3f}]" in first
    assert f"of GSPO {g64['mean']:+.3f} [" in first
    learned = "The dense control still learned (held-out gain's mean above 0) up to a cumulative volatility of 3.3%"
    assert dense.startswith(learned)
    g = tables["gaps"]
    g = g[(g["minuend"] == "grpo") & (g["subtrahend"] == "grpo_rr") & (g["quantity"] == HELD_OUT)]
    assert f"the narrowest interval is {(g['high'] - g['low']).min():.3f} wide" in excluded
    for _, r in g.iterrows():
        assert f"M = {r[M]} (" in excluded and f"[{r['low']:+.3f}, {r['high']:+.3f}]" in excluded
    # the outcome reads the tables as the report reads them back from CSV (results.reuse_figures)
    back = {k: pd.read_csv(io.StringIO(df.to_csv(index=False)), **CSV_EXACT) for k, df in tables.items()}
    assert offpolicy.outcome(back).sentences == said.sentences


def test_a_stratum_in_regime_only_cumulatively_is_not_tested(made) -> None:
    # at a 7% threshold M = 64's cumulative 7.7% reaches it but its 6% per update does not: no stratum in regime
    tables = made[True].tables
    vol = tables["volatility"].set_index(M)
    assert vol.loc[64, "mean"] >= 0.07 > vol.loc[64, "per_update"] >= 0.05
    said = offpolicy.outcome(tables, threshold=0.07)
    assert said.kind == offpolicy.NOT_IN_REGIME and said.strata == ()
    assert "below the 7% per-update threshold" in said.sentences[0]
    assert (
        "only the cumulative volatility reaches it, not the paper's unit (one update): not tested" in said.sentences[0]
    )


def test_figure9_is_skipped_with_its_reason_without_the_minibatch_axis(tmp_path) -> None:
    synthetic.make_routing_study(tmp_path, scales=(1.0, 30.0), seeds=(0, 1), n_steps=20)
    st = tidy.load_study(tmp_path)
    with pytest.raises(MissingData, match="does not sweep it"):
        figures.figure9_offpolicy_replay(st)
    rendered = figures.make_all(st, tmp_path / "figs", only=["figure9_offpolicy_replay"])
    assert "minibatches per rollout batch" in rendered.skipped["figure9_offpolicy_replay"]


def _figures_dir(root: Path, st: tidy.Study) -> Path:
    """A `figures` output holding Figure 9 alone, drawn from `st` (the report reuses it: fast)."""
    out = root / "figs"
    rendered = figures.make_all(st, out, only=["figure9_offpolicy_replay"])
    tables = {}
    for name, dfs in rendered.tables.items():
        (out / figures.TABLES).mkdir(parents=True, exist_ok=True)
        for t, df in dfs.items():
            (out / figures.TABLES / f"{name}.{t}.csv").write_text(df.to_csv(index=False))
        tables[name] = {t: f"{figures.TABLES}/{name}.{t}.csv" for t in dfs}
    entries = {
        n: {"files": [p.name for p in ps], "caption": rendered.captions[n], "tables": tables[n]}
        for n, ps in rendered.paths.items()
    }
    index = {"data": figures.data_fingerprint(st), "figures": entries, "skipped": {}}
    (out / figures.INDEX).write_text(json.dumps(index))
    return out


def test_the_report_gives_the_outcome_over_figure9_after_the_headline(studies) -> None:
    root, st = studies[True]
    rep = report.build_report(st, root / "report", figures_dir=_figures_dir(root, st))
    md, page = rep.markdown.read_text(), rep.html.read_text()
    said = offpolicy.outcome(figures.figure9_offpolicy_replay(st).tables)
    lead = md.index("54 runs (completed 51, collapsed 3")
    section = md.index("## Routing Replay along off-policy updates")
    # the headline's table first (every verdict on the first screen), then the outcome in sentences over Figure 9
    assert lead < md.index("## Headline") < md.index("| C1 |") < section
    assert section < md.index(said.sentences[0]) < md.index("![figure9_offpolicy_replay]")
    assert page.count("<figure id='figure9_offpolicy_replay'>") == 1  # not repeated under "More figures"
    assert (rep.html.parent / "tables" / "figure9_offpolicy_replay.gaps.csv").is_file()


def test_the_routing_figures_leave_out_the_dense_control(studies) -> None:
    # a model of one expert has nothing to route: its volatility 0, load 1 and entropy 0 would sit among the MoE's
    # configurations as if measured (Figure 8 drew them at x = 0 and joined them to the MoE's points)
    _, st = studies[True]
    made = figures.figure8_routing_volatility(st)
    vol = made.tables["volatility"]
    # the MoE's 4 M only: without the dense runs the model axes no longer vary, so M alone names a configuration
    assert vol["config"].tolist() == ["minibatches=1", "minibatches=4", "minibatches=16", "minibatches=64"]
    dense = int((st.runs["model.num_experts"] == 1).sum())
    assert dense > 0 and f"The {dense} runs of a dense control" in made.caption
    per_layer = figures.figure6_routing(st).tables.get("over_training")
    moe_algs = set(st.runs.loc[st.runs["model.num_experts"] == 32, "algorithm"].astype(str))
    assert per_layer is not None and set(per_layer["algorithm"].astype(str)) <= moe_algs
    only_dense = figures.select(st, {"model.num_experts": 1})
    assert figures.routed(only_dense) is only_dense  # nothing else: unchanged


def test_figures_1_and_3_draw_the_runs_whose_config_lacks_an_axis(studies) -> None:
    # the MoE's configs lack model.moe_ffn_hidden_size (NaN in the tables): matching a curve or a row of Figure 3 by
    # `==` dropped every MoE configuration, so Figure 1 showed the dense control's GRPO alone
    from matplotlib.colors import to_hex

    _, st = studies[True]
    fig1 = figures.figure1_reward(st).fig
    drawn = {to_hex(line.get_color()) for line in fig1.axes[0].get_lines()}
    for alg in set(st.runs["algorithm"].astype(str)):
        assert to_hex(names.color(alg)) in drawn, alg
    fig3 = figures.figure3_routing_replay(st).fig
    per_panel = [len(ax.get_lines()) for ax in fig3.axes if ax.get_lines()]
    assert len(per_panel) >= 2 * 4 and min(per_panel) > 0  # a row per MoE configuration, both families drawn


def test_the_mechanism_sentence_reads_the_highest_ms_grpo_beside_the_dense_control() -> None:
    """routing_attribution's table: at the highest M with a routing log-ratio, GRPO's volatility, the routing's and
    the weights' log-ratio on the MoE, and the dense control's weights' log-ratio at that M; nothing without it."""
    axis = vocab.MINIBATCH_AXIS
    cols = ["model", columns.ALGORITHM, axis, "n", vocab.ROUTING_SLOT, *vocab.LOGRATIOS]
    mech = pd.DataFrame(
        [
            [MOE, "grpo", 4, 2, 0.0135, 0.0021, 0.0004, 0.050, 0.010],
            [MOE, "grpo", 32, 2, 0.060, 0.0123, 0.0031, 0.210, 0.062],
            [MOE, "grpo_rr", 32, 2, 0.058, 0.0119, 0.0030, 0.190, 0.051],
            [DENSE, "grpo", 32, 2, np.nan, 0.0, 0.0, 0.170, 0.044],
            [MOE, "grpo", 1, 2, np.nan, np.nan, np.nan, np.nan, np.nan],
        ],
        columns=cols,
    )
    (said,) = offpolicy.mechanism({"mechanism": mech})
    assert "M = 32" in said and "6% of expert slots" in said
    assert "0.0123 (tokens past ln 2: 0.31%)" in said and "0.2100 (tokens past ln 2: 6.2%)" in said
    assert "the dense control's: 0.1700 (tokens past ln 2: 4.4%)" in said
    assert offpolicy.mechanism({"volatility": mech}) == ()
    assert offpolicy.mechanism({"mechanism": mech.assign(**{vocab.ROUTING_LOGRATIO: np.nan})}) == ()
