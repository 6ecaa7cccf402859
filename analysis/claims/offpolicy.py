"""The routing study along off-policy updates: Figure 9's tables (`offpolicy_tables`) and the outcome they show.

Two outcomes, stated with their numbers either way:

(i) some stratum (the MoE at one M, minibatches per rollout batch) reached the regime of the paper's Figure 3 (its
    routing volatility at or above the threshold) while the dense control still learned there (its held-out gain's
    seed mean above 0) and so did GSPO: then whether GRPO without Routing Replay fell beyond the dense control's
    off-policy loss (the 95% interval of its excess loss, alg(M) - alg(M_0) - dense(M) + dense(M_0), below 0) while
    GRPO + Routing Replay and GSPO did not (their intervals not below 0): Figure 3 reproduced, or not;
(ii) no such stratum: the highest volatility reached and at which M, the dense control's and GSPO's gains there, the
    highest volatility at which the dense control still learned, and, within the regime reached, the GRPO minus GRPO
    + Routing Replay held-out gaps the seeds exclude (those outside its 95% interval at each M, paired by seed).

The claims are about the paper's algorithms, so this module names them (through analysis.claims.common's names and
the registry's replay partner).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from analysis.claims.common import GRPO, GSPO, comparison_pairs
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM, RUN_ID, SEED
from analysis.runs.select import DENSE, MOE, MissingData, configurations, model_of, need_metric, short, varying
from analysis.runs.tidy import Study
from analysis.stats import collapse, curves, design, gain, intervals, regime

# --- Figure 9's tables ------------------------------------------------------------------------------------------------
HELD_OUT, FINAL = "held-out gain", "final reward"
"""Figure 9's quantities (its tables' `quantity` column)."""
INTERVAL = ("mean", "low", "high", "n")
"""The columns of a mean over runs with its t interval."""


def _interval(ci: intervals.CI) -> tuple[float, float, float, int]:
    return ci.estimate, ci.low, ci.high, ci.n


def _bounds(name: str) -> tuple[str, str, str]:
    """The columns of an estimate `name` with its interval: name, name_low, name_high."""
    return name, f"{name}_low", f"{name}_high"


@dataclass(frozen=True)
class _Arms:
    """The runs of an off-policy study by arm, and the per-run quantities its tables read."""

    arm: dict[tuple[str, str, Any], list[str]]
    """(model, algorithm, M) -> the arm's run ids."""
    ms: list[Any]
    """The M values, in order (the first: the fewest)."""
    moe: pd.DataFrame
    """The MoE's runs (study.runs rows)."""
    algs: dict[str, list[str]]
    """Per model (MOE, DENSE): its algorithms, in registry order."""
    quantities: dict[str, dict[str, float]]
    """Per quantity (HELD_OUT when measured, FINAL): run id -> its value."""
    seed_of: dict[str, Any]

    @property
    def dense(self) -> str | None:
        """The dense control's algorithm (the first), None without a dense control."""
        return self.algs[DENSE][0] if self.algs[DENSE] else None

    def values(self, q: str, mod: str, alg: str, m: Any) -> np.ndarray:
        """Quantity `q` of each run of the arm (model, algorithm, M); NaN where a run has none."""
        return np.array([self.quantities[q].get(r, np.nan) for r in self.arm.get((mod, alg, m), [])], np.float64)

    def by_seed(self, q: str, mod: str, alg: str, m: Any) -> dict[Any, float] | None:
        """The arm's values keyed by seed; None when a seed has several runs (the seed then identifies no pair)."""
        ids = self.arm.get((mod, alg, m), [])
        seeds = [self.seed_of[r] for r in ids]
        if len(set(seeds)) < len(seeds):
            return None
        return {s: self.quantities[q].get(r, np.nan) for s, r in zip(seeds, ids, strict=True)}

    def dense_at(self, *ms: Any) -> bool:
        """Whether the dense control ran at every M of `ms`."""
        return self.dense is not None and all((DENSE, self.dense, m) in self.arm for m in ms)


def _per_run(per_run: pd.DataFrame) -> dict[str, float]:
    return dict(zip(per_run[RUN_ID].astype(str), per_run["value"].astype(float), strict=True))


def _read_arms(study: Study, frac: float) -> _Arms:
    """The off-policy study's arms (offpolicy_tables: what it needs of the study, else MissingData)."""
    axis = vocab.MINIBATCH_AXIS
    swept = varying(study)
    if axis not in swept:
        raise MissingData(
            f"the off-policy figure compares minibatches per rollout batch ({axis!r}); this study does not sweep it "
            f"(swept axes: {', '.join(swept) or 'none'})"
        )
    for m in (vocab.ROUTING_SLOT, vocab.REWARD):
        need_metric(study, m)
    other = [a for a in swept if a != axis and a.split(".")[0] != "model"]
    if other:
        raise MissingData(
            f"the off-policy figure reads one configuration besides {axis} and the model; this study "
            f"also sweeps {', '.join(other)}: select one value of each (where=)"
        )
    keys, m_of = configurations(study, [axis])
    runs = study.runs[study.runs[RUN_ID].astype(str).isin(m_of)].copy()
    runs["model"] = model_of(study, runs[RUN_ID].astype(str).tolist())
    shape_cols = [a for a in swept if a.split(".")[0] == "model"]
    moe = runs[runs["model"] == MOE]
    if moe.empty:
        raise MissingData(f"the off-policy figure needs MoE runs; every run's {vocab.NUM_EXPERTS_KEY} is 1")
    if shape_cols and len(moe[shape_cols].astype(str).drop_duplicates()) > 1:
        raise MissingData(
            f"the off-policy figure reads one MoE shape; this study sweeps several ({', '.join(shape_cols)}"
            "): select one (where=)"
        )
    arm = {
        (mod, str(alg), m): grp[RUN_ID].astype(str).tolist()
        for (mod, alg, m), grp in runs.groupby(["model", ALGORITHM, axis], observed=True, sort=False)
    }
    quantities = {}
    if vocab.EVAL_IN_DIST in study.metrics:
        gains = gain.per_run(study.long, vocab.EVAL_IN_DIST)
        if len(gains):
            quantities[HELD_OUT] = _per_run(gains)
    quantities[FINAL] = _per_run(curves.compute_window(study.long, vocab.REWARD, frac=frac))
    return _Arms(
        arm=arm,
        ms=[k[0] for k in keys],
        moe=moe,
        algs={mod: names.order({a for (md, a, _m) in arm if md == mod}) for mod in (MOE, DENSE)},
        quantities=quantities,
        seed_of=dict(zip(runs[RUN_ID].astype(str), runs[SEED], strict=True)),
    )


def _volatility(study: Study, arms: _Arms, threshold: float) -> pd.DataFrame:
    """offpolicy_tables' `volatility`: per M, the MoE's cumulative and per-update volatility over its runs."""
    axis = vocab.MINIBATCH_AXIS
    vol = _per_run(curves.run_mean(study.long, vocab.ROUTING_SLOT))
    one = _per_run(curves.run_mean(study.long, regime.PER_UPDATE)) if regime.PER_UPDATE in study.metrics else {}
    rows = []
    for m in arms.ms:
        ids = arms.moe.loc[arms.moe[axis] == m, RUN_ID].astype(str)
        cum, per = (np.array([q.get(r, np.nan) for r in ids], np.float64) for q in (vol, one))
        ci, pu = intervals.mean_ci(cum[np.isfinite(cum)]), intervals.mean_ci(per[np.isfinite(per)])
        rows.append((m, *_interval(ci), *_interval(pu), threshold, bool(pu.n > 0 and pu.estimate >= threshold)))
    columns = [axis, *INTERVAL, *_bounds("per_update"), "per_update_n", "threshold", "in_regime"]
    return pd.DataFrame(rows, columns=columns)


def _arm_means(arms: _Arms) -> pd.DataFrame:
    """offpolicy_tables' `arms`: per model, algorithm, M and quantity, the mean over seeds with its t interval."""
    rows = []
    for mod, q, m in itertools.product((MOE, DENSE), arms.quantities, arms.ms):
        for alg in arms.algs[mod]:
            if (mod, alg, m) in arms.arm:
                rows.append((mod, alg, m, q, *_interval(intervals.mean_ci(arms.values(q, mod, alg, m)))))
    return pd.DataFrame(rows, columns=["model", ALGORITHM, vocab.MINIBATCH_AXIS, "quantity", *INTERVAL])


def _gaps(arms: _Arms, x_of: Mapping[Any, float]) -> pd.DataFrame:
    """offpolicy_tables' `gaps`: each MoE algorithm minus its Routing Replay partner and the dense control's
    off-policy loss, per quantity and M, read as one family (`design.read_as_family`)."""
    axis = vocab.MINIBATCH_AXIS
    head = ("comparison", "minuend", "subtrahend", "model", axis, "volatility", "quantity")
    pairs = [(free, rr) for rr, free, claim in comparison_pairs(arms.algs[MOE]) if claim in ("C3", "C4")]
    m0, dense = arms.ms[0], arms.dense

    def gap_row(what: str, a: str, b: str, model: str, m: Any, q: str, ka: tuple, kb: tuple) -> dict[str, Any]:
        """minuend arm `ka` minus subtrahend arm `kb` ((model, algorithm, M)): paired by seed when both arms ran the
        same seeds (two or more, one run each), else Welch."""
        gap = design.arm_gap(arms.values(q, *ka), arms.values(q, *kb), arms.by_seed(q, *ka), arms.by_seed(q, *kb))
        return {**dict(zip(head, (what, a, b, model, m, x_of[m], q), strict=True)), **gap}

    rows = []
    for q, m in itertools.product(arms.quantities, arms.ms):
        for free, rr in pairs:
            if (MOE, free, m) in arms.arm and (MOE, rr, m) in arms.arm:
                what = f"{names.label(free)} - {names.label(rr)}"
                rows.append(gap_row(what, free, rr, MOE, m, q, (MOE, free, m), (MOE, rr, m)))
        if dense is not None and m != m0 and arms.dense_at(m, m0):
            what = f"dense control ({names.label(dense)}): at M minus at M = {short(m0)}"
            rows.append(gap_row(what, dense, dense, DENSE, m, q, (DENSE, dense, m), (DENSE, dense, m0)))
    design.read_as_family(rows)
    return pd.DataFrame(rows, columns=[*head, *design.GAP_COLUMNS])


def _offpolicy_loss(arms: _Arms, x_of: Mapping[Any, float]) -> pd.DataFrame:
    """offpolicy_tables' `offpolicy_loss`: per MoE algorithm and M, its loss from its routing family's arm at the
    fewest M and that loss's excess over the dense control's."""
    m0, dense = arms.ms[0], arms.dense
    at0 = [a for (md, a, m) in arms.arm if md == MOE and m == m0]
    rows = []
    for q, alg, m in itertools.product(arms.quantities, arms.algs[MOE], arms.ms[1:]):
        base = _base_of(alg, at0)
        if (MOE, alg, m) not in arms.arm or base is None:
            continue
        groups = [arms.values(q, MOE, alg, m), arms.values(q, MOE, base, m0)]
        loss = intervals.mean_difference(*groups)
        excess = intervals.CI(np.nan, np.nan, np.nan, 0)
        if arms.dense_at(m, m0):
            dense_groups = [arms.values(q, DENSE, dense, m), arms.values(q, DENSE, dense, m0)]
            excess = intervals.contrast_ci([*groups, *dense_groups], (1.0, -1.0, -1.0, 1.0))
        rows.append((alg, base, m, x_of[m], q, *_interval(loss)[:3], *_interval(excess)[:3], excess.n or loss.n))
    columns = [
        ALGORITHM,
        "baseline",
        vocab.MINIBATCH_AXIS,
        "volatility",
        "quantity",
        *_bounds("loss"),
        *_bounds("excess"),
        "n",
    ]
    return pd.DataFrame(rows, columns=columns)


def _collapse_rate(study: Study, arms: _Arms) -> pd.DataFrame | None:
    """offpolicy_tables' `collapse_rate`: per model, algorithm and M, its collapsed runs with a Wilson interval; None
    when no run collapsed."""
    coll = collapse.collapse_table(study.long, study.runs)
    fell = dict(zip(coll[RUN_ID].astype(str), coll["collapsed"].astype(bool), strict=True))
    if not any(fell.get(r, False) for ids in arms.arm.values() for r in ids):
        return None
    rows = []
    for mod, m in itertools.product((MOE, DENSE), arms.ms):
        for alg in arms.algs[mod]:
            ids = arms.arm.get((mod, alg, m), [])
            if ids:
                k = sum(fell.get(r, False) for r in ids)
                rows.append((mod, alg, m, k, len(ids), k / len(ids), *intervals.wilson_interval(k, len(ids))))
    return pd.DataFrame(
        rows, columns=["model", ALGORITHM, vocab.MINIBATCH_AXIS, "collapsed", "runs", "rate", "low", "high"]
    )


def _mechanism(study: Study, arms: _Arms) -> pd.DataFrame:
    """offpolicy_tables' `mechanism`: per (model, algorithm, M) arm, the mean over its runs of each run's mean over
    steps of the routing volatility and of each log-ratio metric (NaN where none measured it)."""
    metrics = [vocab.ROUTING_SLOT, *(m for m in vocab.LOGRATIOS if m in study.metrics)]
    per_run = {m: _per_run(r) for m in metrics if len(r := curves.run_mean(study.long, m))}
    rows = []
    for (mod, alg, m), ids in arms.arm.items():
        means = []
        for name in metrics:
            vals = np.array([per_run.get(name, {}).get(r, np.nan) for r in ids], np.float64)
            means.append(float(np.nanmean(vals)) if np.isfinite(vals).any() else np.nan)
        rows.append((mod, alg, m, len(ids), *means))
    return pd.DataFrame(rows, columns=["model", ALGORITHM, vocab.MINIBATCH_AXIS, "n", *metrics])


def _base_of(alg: str, present: Sequence[str]) -> str | None:
    """The arm at the fewest minibatches an algorithm's off-policy loss is measured from: itself, else the first of
    its routing variants (the same loss under another routing mode, registry order) that ran there: replay is a no-op
    with one minibatch, so a study leaves the replay arms out there."""
    if alg in present:
        return alg
    return next((v for v in names.registry().routing_variants(alg) if v in present), None)


def offpolicy_tables(
    study: Study, *, frac: float = curves.WINDOW_FRAC, threshold: float | None = None
) -> dict[str, pd.DataFrame]:
    """Figure 9's data, along the minibatches per rollout batch M (vocab.MINIBATCH_AXIS), for the MoE and its dense
    control (runs whose model has one expert; failed runs left out). Per run: its routing volatility (mean
    routing_slot_mismatch over its steps), its held-out gain (analysis.stats.gain.per_run) and its final reward
    (`curves.compute_window`: the mean over the last `frac` of its compute, the window the scorecard's claims read).

    - `volatility`: per M, the MoE's volatility, cumulative (`mean`: routing_slot_mismatch, over minibatches 2..M)
      and per update (`per_update`: routing_slot_mismatch_mb2, the change after one update, the paper's unit): mean
      over every MoE run at that M (all algorithms) with a 95% t interval over runs; `threshold` (default
      analysis.stats.regime.MIN_VOLATILITY) and whether the per-update mean reaches it (`in_regime`);
    - `arms`: per model, algorithm, M and quantity, the mean over seeds with a 95% t interval;
    - `gaps`: per M, each algorithm minus its Routing Replay partner (the pairs of C3 and C4, reversed: what dropping
      replay costs) on the MoE, and the dense control's off-policy loss (its value at M minus at the fewest M), at the
      MoE's volatility of that M: paired by seed where both arms ran the same seeds (a seed's arms share prompts, cold
      start and evaluation sampling; `design.paired_difference`), else Welch, with its 95% interval and p-value, and,
      the table read as one exploratory family (`family`), the Holm-adjusted p-value (`p_holm`) and the simultaneous
      (Bonferroni) interval (`simultaneous_low`, `simultaneous_high`);
    - `offpolicy_loss`: per MoE algorithm and M, its off-policy loss (its value at M minus its routing family's at
      the fewest M, `_base_of`) and that loss's excess over the dense control's (the contrast alg(M) - base(M_0) -
      dense(M) + dense(M_0), Welch-Satterthwaite interval): below 0 when the arm falls beyond the dense control;
    - `mechanism` (only when runs measured the routing log-ratio, routing_attribution): per model, algorithm and M,
      the seed means of each run's step means of the routing volatility and of the off-policy minibatches'
      log-ratios (vocab.LOGRATIOS: the routing's part and the weights');
    - `collapse_rate` (only when some run collapsed, analysis.stats.collapse): per model, algorithm and M, the
      collapsed runs of the runs, with a Wilson interval.
    """
    threshold = regime.MIN_VOLATILITY if threshold is None else float(threshold)
    arms = _read_arms(study, frac)
    volatility = _volatility(study, arms, threshold)
    x_of = dict(zip(volatility[vocab.MINIBATCH_AXIS], volatility["mean"], strict=True))
    tables = {
        "volatility": volatility,
        "arms": _arm_means(arms),
        "gaps": _gaps(arms, x_of),
        "offpolicy_loss": _offpolicy_loss(arms, x_of),
    }
    if vocab.ROUTING_LOGRATIO in study.metrics:  # runs with routing_attribution: the mechanism beside the volatility
        tables["mechanism"] = _mechanism(study, arms)
    rate = _collapse_rate(study, arms)
    if rate is not None:
        tables["collapse_rate"] = rate
    return tables


# --- the outcome ------------------------------------------------------------------------------------------------------
IN_REGIME, NOT_IN_REGIME, UNDECIDED = "i", "ii", ""
"""`Outcome.kind`: "i" (a stratum in the regime, Figure 3 reproduced there or not: `Outcome.reproduced`), "ii" (no
stratum in the regime with the dense control and GSPO learning), "" (the tables lack what the outcome needs)."""


@dataclass(frozen=True)
class Outcome:
    """Which outcome the runs show, and the sentences that say so with their numbers."""

    kind: str
    sentences: tuple[str, ...]
    strata: tuple[object, ...] = ()
    """The M values in the regime with the dense control and GSPO learning (outcome i)."""
    reproduced: bool | None = None
    """Outcome i: whether Figure 3 is reproduced in at least one of `strata`; None otherwise."""


def _gain(x: float) -> str:
    return f"{x:+.3f}" if np.isfinite(x) else "n/a"


def _ci(est: float, lo: float, hi: float) -> str:
    """ "+0.123 [+0.100, +0.150]", or the estimate alone where there is no interval."""
    if not np.isfinite(lo) or not np.isfinite(hi):
        return f"{_gain(est)} (no interval)"
    return f"{_gain(est)} [{_gain(lo)}, {_gain(hi)}]"


def _row(t: pd.DataFrame, **where: object) -> pd.Series | None:
    """The one row of `t` matching `where` (column == value; the M column compared as text), or None."""
    mask = np.ones(len(t), dtype=bool)
    for col, value in where.items():
        mask &= (t[col].astype(str) == str(value)).to_numpy()
    hit = t[mask]
    return hit.iloc[0] if len(hit) else None


def outcome(tables: Mapping[str, pd.DataFrame], threshold: float | None = None) -> Outcome:
    """Which outcome (module docstring) Figure 9's `tables` show; `threshold` (default: the tables' own, the
    regime's routing volatility) decides which strata are in the regime."""
    axis = vocab.MINIBATCH_AXIS
    vol, arms, gaps = (tables[k] for k in ("volatility", "arms", "gaps"))
    thr = float(vol["threshold"].iloc[0]) if threshold is None else float(threshold)
    reg = names.registry()
    grpo, gspo = GRPO, GSPO
    rr = reg.replay_partner(grpo)
    dense_algs = names.order_or_sorted(arms.loc[arms["model"] == DENSE, ALGORITHM].astype(str))
    moe_algs = set(arms.loc[arms["model"] == MOE, ALGORITHM].astype(str))
    missing = [names.label_or_name(a) for a in (grpo, rr, gspo) if a not in moe_algs]
    missing += [] if dense_algs else ["a dense control (runs whose model has one expert)"]
    if missing:
        return Outcome(UNDECIDED, (f"No outcome: the off-policy study lacks {', '.join(missing)}.",))
    if not (arms["quantity"] == HELD_OUT).any():
        why = "no held-out gain (no run evaluated its starting policy at step 0), which the outcome is decided on"
        return Outcome(UNDECIDED, (f"No outcome: {why}.",))
    dense = dense_algs[0]
    lab = {a: names.label(a) for a in (grpo, rr, gspo)}  # GRPO, its replay partner, GSPO: in this order
    measured = vol[vol["n"].astype(int) > 0].sort_values("mean")
    if measured.empty:
        return Outcome(UNDECIDED, ("No outcome: no MoE run measured its routing volatility (no M above one).",))

    def gain_at(model: str, alg: str, m: object) -> pd.Series | None:
        return _row(arms, model=model, algorithm=alg, quantity=HELD_OUT, **{axis: m})

    def mean(row: pd.Series | None) -> float:
        return float(row["mean"]) if row is not None else np.nan

    def ci(row: pd.Series | None) -> str:
        return _ci(float(row["mean"]), float(row["low"]), float(row["high"])) if row is not None else "not run"

    unit = regime.volatility(thr).unit

    def one(r: pd.Series) -> float:
        """The per-update volatility of row `r` (NaN when not measured): what the regime is decided on."""
        return float(r["per_update"]) if "per_update" in r and r["per_update_n"] > 0 else np.nan

    def volatility(r: pd.Series) -> str:
        pct = regime.percent
        cum = (
            f"cumulative {pct(float(r['mean']))} [{pct(float(r['low']))}, {pct(float(r['high']))}]"
            if np.isfinite(float(r["low"]))
            else f"cumulative {pct(float(r['mean']))}"
        )
        u = one(r)
        per = f"per update {pct(u)}" if np.isfinite(u) else f"per update not measured ({regime.PER_UPDATE})"
        return f"{cum}, {per} {unit} (n={int(r['n'])} run{'s' if int(r['n']) != 1 else ''})"

    strata = []
    for _, r in measured.iterrows():
        m = r[axis]
        if one(r) >= thr and mean(gain_at(DENSE, dense, m)) > 0 and mean(gain_at(MOE, gspo, m)) > 0:
            strata.append(r)
    dense_lab = "the dense control"
    if strata:

        def dense_gain(m: object) -> str:
            return f"{names.label(dense)}: held-out gain {ci(gain_at(DENSE, dense, m))}"

        def gspo_gain(m: object) -> str:
            return ci(gain_at(MOE, gspo, m))

        return _in_regime(strata, thr, lab, dense_lab, dense_gain, gspo_gain, volatility, tables)

    top = measured.iloc[-1]
    m_top = top[axis]
    side = "at or above" if one(top) >= thr else "below"
    only = (
        "; only the cumulative volatility reaches it, not the paper's unit (one update): not tested in regime"
        if side == "below" and float(top["mean"]) >= thr
        else ""
    )
    out = [
        "Outcome (ii): no stratum reached the regime with the dense control and GSPO still learning. "
        f"The highest routing volatility reached was {volatility(top)} at M = {short(m_top)}, {side} the "
        f"{regime.percent(thr)} per-update threshold (the paper's model: ~{regime.percent(regime.PAPER_PER_UPDATE)} "
        f"after one update){only}; there the held-out gain of {dense_lab} ({names.label(dense)}) was "
        f"{ci(gain_at(DENSE, dense, m_top))} and of {lab[gspo]} {ci(gain_at(MOE, gspo, m_top))}."
    ]
    learned = [r for _, r in measured.iterrows() if mean(gain_at(DENSE, dense, r[axis])) > 0]
    if learned:
        best = learned[-1]
        out.append(
            f"The dense control still learned (held-out gain's mean above 0) up to a cumulative volatility of "
            f"{regime.percent(float(best['mean']))} (M = {short(best[axis])}, gain "
            f"{ci(gain_at(DENSE, dense, best[axis]))})."
        )
    else:
        out.append("The dense control learned (held-out gain's mean above 0) at no M with a measured volatility.")
    in_regime = [r for _, r in measured.iterrows() if one(r) >= thr]
    for r in in_regime:
        if r[axis] == m_top:
            continue
        out.append(
            f"At M = {short(r[axis])}, also at or above the threshold ({volatility(r)}), the held-out gain of "
            f"{dense_lab} was {ci(gain_at(DENSE, dense, r[axis]))} and of {lab[gspo]} "
            f"{ci(gain_at(MOE, gspo, r[axis]))}."
        )
    g = gaps[(gaps["minuend"].astype(str) == grpo) & (gaps["subtrahend"].astype(str) == rr)]
    g = g[g["quantity"] == HELD_OUT]
    g = g[g[axis].astype(str).isin(measured[axis].astype(str))]
    g = g.assign(_v=g[axis].astype(str).map(dict(zip(measured[axis].astype(str), measured["mean"], strict=True))))
    g = g.sort_values("_v")
    finite = g[np.isfinite(g["low"].astype(float))]
    if finite.empty:
        out.append(f"No {lab[grpo]} \u2212 {lab[rr]} held-out gap has an interval at a measured M.")
    else:
        per = "; ".join(
            f"M = {short(r[axis])} ({regime.percent(float(r['_v']))}): "
            f"{_ci(float(r['estimate']), float(r['low']), float(r['high']))}"
            for _, r in finite.iterrows()
        )
        below = finite[finite["high"].astype(float) < 0]
        tail = (
            " At "
            + ", ".join(f"M = {short(m)}" for m in below[axis])
            + " the interval lies below 0: dropping replay cost held-out gain there."
            if len(below)
            else ""
        )
        width = float((finite["high"].astype(float) - finite["low"].astype(float)).min())
        out.append(
            f"Within the regime reached (cumulative volatility {regime.percent(float(finite['_v'].min()))} to "
            f"{regime.percent(float(finite['_v'].max()))}), the seeds exclude only the {lab[grpo]} \u2212 {lab[rr]} "
            f"held-out gain gaps outside each M's 95% interval (paired by seed) ({per}); the narrowest interval is "
            f"{width:.3f} wide, so no smaller gap is ruled out.{tail}"
        )
    return Outcome(NOT_IN_REGIME, tuple(out))


def mechanism(tables: Mapping[str, pd.DataFrame]) -> tuple[str, ...]:
    """One sentence on what the routing moved in the ratios (Figure 9's `mechanism` table, runs with
    routing_attribution): at the highest M, GRPO's routing volatility on the MoE, the routing-attributable log-ratio
    and the weights' log-ratio, beside the dense control's weights' log-ratio; () without the table."""
    mech = tables.get("mechanism")
    if mech is None or mech.empty or vocab.ROUTING_LOGRATIO not in mech:
        return ()
    axis, grpo = vocab.MINIBATCH_AXIS, GRPO
    moe = mech[(mech["model"] == MOE) & (mech[ALGORITHM].astype(str) == grpo)]
    moe = moe[np.isfinite(moe[vocab.ROUTING_LOGRATIO].astype(float))]
    if moe.empty:
        return ()
    top = moe.loc[moe[axis].astype(float).idxmax()]
    dense = mech[(mech["model"] == DENSE) & (mech[axis].astype(str) == str(top[axis]))]

    def pair(row: pd.Series, mean: str, share: str) -> str:
        return f"{float(row[mean]):.4f} (tokens past ln 2: {regime.percent(float(row[share]))})"

    said = (
        f"The mechanism, at M = {short(top[axis])}: {names.label(grpo)}'s routing moved "
        f"{regime.percent(float(top[vocab.ROUTING_SLOT]))} of expert slots since pi_old, and routing alone moved "
        f"log pi_theta / pi_old by a mean |.| of {pair(top, vocab.ROUTING_LOGRATIO, vocab.ROUTING_LOGRATIO_LN2)}, "
        f"against {pair(top, vocab.WEIGHT_LOGRATIO, vocab.WEIGHT_LOGRATIO_LN2)} for the whole change"
    )
    if len(dense):
        said += f"; the dense control's: {pair(dense.iloc[0], vocab.WEIGHT_LOGRATIO, vocab.WEIGHT_LOGRATIO_LN2)}"
    return (said + " (seed means of the runs' step means over minibatches 2..M).",)


def _in_regime(
    strata: list[pd.Series],
    thr: float,
    lab: Mapping[str, str],
    dense_lab: str,
    dense_gain: Callable[[object], str],
    gspo_gain: Callable[[object], str],
    volatility: Callable[[pd.Series], str],
    tables: Mapping[str, pd.DataFrame],
) -> Outcome:
    """Outcome (i): per stratum in the regime, whether GRPO fell beyond the dense control while GRPO + Routing
    Replay and GSPO did not; `lab`: the three algorithms' labels (GRPO, its replay partner, GSPO, in that order)."""
    axis = vocab.MINIBATCH_AXIS
    grpo, rr, gspo = lab
    loss, gaps, coll = tables["offpolicy_loss"], tables["gaps"], tables.get("collapse_rate")
    out, reproduced, ms = [], [], []
    for r in strata:
        m = r[axis]
        ms.append(m)
        ex = {a: _row(loss, algorithm=a, quantity=HELD_OUT, **{axis: m}) for a in (grpo, rr, gspo)}
        hi = {a: float(row["excess_high"]) if row is not None else np.nan for a, row in ex.items()}
        fell = {a: (None if not np.isfinite(h) else h < 0) for a, h in hi.items()}
        yes = fell[grpo] is True and fell[rr] is False and fell[gspo] is False
        reproduced.append(yes)
        why = []
        if fell[grpo] is not True:
            why.append(f"{lab[grpo]} did not fall beyond it" if fell[grpo] is False else f"{lab[grpo]}: no interval")
        for a in (rr, gspo):
            if fell[a] is not False:
                why.append(f"{lab[a]} fell beyond it too" if fell[a] else f"{lab[a]}: no interval")
        excess = {
            a: "not run"
            if row is None
            else _ci(float(row["excess"]), float(row["excess_low"]), float(row["excess_high"]))
            for a, row in ex.items()
        }
        gap = []
        for q in (HELD_OUT, FINAL):
            row = _row(gaps, minuend=grpo, subtrahend=rr, quantity=q, **{axis: m})
            if row is not None:
                gap.append(f"{q} {_ci(float(row['estimate']), float(row['low']), float(row['high']))} (n = {row['n']})")
        fell_runs = ""
        c = _row(coll, model=MOE, algorithm=grpo, **{axis: m}) if coll is not None else None
        if c is not None:
            fell_runs = f" {lab[grpo]} collapsed in {int(c['collapsed'])} of {int(c['runs'])} runs there."
        verdict = "Figure 3 is reproduced there" if yes else f"Figure 3 is not reproduced there ({'; '.join(why)})"
        out += [
            f"Outcome (i): at M = {short(m)} the MoE's routing volatility was {volatility(r)}, at or above the "
            f"{regime.percent(thr)} per-update threshold (the paper's model: "
            f"~{regime.percent(regime.PAPER_PER_UPDATE)} after one update), while {dense_lab} ({dense_gain(m)}) "
            f"and {lab[gspo]} ({gspo_gain(m)}) still learned.",
            f"{verdict}: the held-out gain's off-policy loss beyond {dense_lab}'s (the arm's change from the fewest "
            f"M less the dense control's, 95% interval) was {excess[grpo]} for {lab[grpo]}, {excess[rr]} for "
            f"{lab[rr]} and {excess[gspo]} for {lab[gspo]}; {lab[grpo]} \u2212 {lab[rr]}: "
            + ("; ".join(gap) or "not measured")
            + f".{fell_runs}",
        ]
    return Outcome(IN_REGIME, tuple(out), tuple(ms), any(reproduced))


__all__ = [
    "DENSE",
    "FINAL",
    "HELD_OUT",
    "IN_REGIME",
    "MOE",
    "NOT_IN_REGIME",
    "UNDECIDED",
    "Outcome",
    "offpolicy_tables",
    "outcome",
]
