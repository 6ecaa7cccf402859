"""The report's sections after the headline (analysis.report.headline) and the scorecard (analysis.report.evidence),
each a list of blocks (analysis.report.render): a line on the study (`lead`); for a study along off-policy updates,
the outcome it shows over its figure (analysis.claims.offpolicy); Figures 1-3 and the routing-volatility figure with
C3 and C4 per configuration; the cold start's generation budget; the precision parity; the learning signal; how the
study was set up (its notes, docs/studies/<name>.md); the other figures and their tables; the failed, collapsed,
unreadable and missing runs with the rule or reason that flagged each; and at the end the study and its provenance
(git sha, package versions, machine from the manifests; the config common to every run, the swept axes, and every run
with its axis values and state).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import figures
from analysis.claims import offpolicy, scorecard
from analysis.report import render
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM, EMULATED, METRIC, RUN_ID, STEP, VALUE
from analysis.runs.natural import natural_sorted
from analysis.runs.results import StudyNotes
from analysis.runs.tidy import Study
from analysis.stats import collapse, design
from analysis.stats import gain as gain_


def natural_sorted_text(values: Any) -> list[str]:
    """Values as text in natural order (numbers by value, then the rest alphabetically)."""
    return [str(v) for v in natural_sorted(values)]


def _common_config(configs: Mapping[str, Mapping[str, Any]], axes: Sequence[str]) -> dict[str, Any]:
    """Flattened config keys with one value across every run (seed, algorithm and the swept axes excluded)."""
    items = list(configs.values())
    if not items:
        return {}
    out = {}
    for key in sorted({k for c in items for k in c}):
        if key in axes or key.rsplit(".", 1)[-1] in ("seed", "algorithm"):
            continue
        vals = {json.dumps(c.get(key), sort_keys=True, default=str) for c in items}
        if len(vals) == 1:
            out[key] = items[0].get(key)
    return out


def provenance(study: Study) -> dict[str, Any]:
    """What the manifests say: git shas, package versions, python, machine, host and how the verifier was sandboxed
    (each with its run count)."""
    mans = list(study.manifests.values())

    def count(key: str) -> dict[str, int]:
        return dict(Counter(str(m.get(key)) for m in mans if m.get(key) is not None))

    packages: dict[str, Counter[str]] = {}
    for m in mans:
        for name, ver in (m.get("packages") or {}).items():
            packages.setdefault(name, Counter())[str(ver)] += 1
    return {
        "git_sha": count("git_sha"),
        "python": count("python"),
        "machine": count("machine"),
        "host": count("host"),
        "cpu_count": count("cpu_count"),
        "scoring_sandbox": dict(
            Counter(str(m["scoring_sandbox"] or "none (native grammars)") for m in mans if "scoring_sandbox" in m)
        ),
        "packages": {k: dict(v) for k, v in sorted(packages.items())},
    }


def problem_runs(study: Study) -> pd.DataFrame:
    """Failed, collapsed (reported in status.json or flagged by analysis's rules on the reward) and unknown-state
    runs, runs with a file that could not be read, then the runs set aside as unreadable (Study.unreadable) and the
    missing run ids; `flagged_by` says which: "error", "status.json" (the trainer's own guard: non-finite loss,
    exploding ratio, reward floor), the analysis rule (collapse.NON_FINITE, FLOOR, DROP), "unreadable" or
    "missing"."""
    runs = study.runs
    cols = [RUN_ID, ALGORITHM, *study.axes, "seed", "state", "last_step", "flagged_by", "collapse_step", "reason"]
    detected: dict[str, tuple[Any, Any, Any]] = {}
    if vocab.REWARD in study.metrics:
        coll = collapse.collapse_table(study.long, runs, vocab.REWARD)
        detected = {
            str(r): (s, why, rule)
            for r, s, why, rule in zip(
                coll[RUN_ID], coll["detected_step"], coll["detected_reason"], coll["detected_rule"], strict=True
            )
            if rule
        }
    records = []
    for _, r in runs.iterrows():
        rid = str(r[RUN_ID])
        if r["state"] in ("failed", "unknown"):
            flagged, step, reason = "error", r["collapse_step"], r["error"]
        elif r["state"] == "collapsed":
            flagged, step, reason = "status.json", r["collapse_step"], r["collapse_reason"]
        elif rid in detected:
            step, reason, rule = detected[rid]
            flagged = f"analysis: {rule}"
        elif isinstance(r.get("error"), str) and r["error"]:  # read, but a file of it could not be
            flagged, step, reason = "error", None, r["error"]
        else:
            continue
        rec = {c: r.get(c) for c in cols if c in runs.columns}
        rec.update(flagged_by=flagged, collapse_step=step, reason=reason)
        records.append(rec)
    order = {a: i for i, a in enumerate(names.order_or_sorted({str(r.get(ALGORITHM)) for r in records}))}
    records.sort(key=lambda r: (str(r["state"]), order.get(str(r.get(ALGORITHM)), 0), *(str(r.get(c)) for c in cols)))
    for _, u in study.unreadable.iterrows():
        records.append(
            {
                RUN_ID: u[RUN_ID],
                ALGORITHM: u[ALGORITHM],
                "seed": u["seed"],
                "state": "unreadable",
                "flagged_by": "unreadable",
                "reason": u["reason"],
            }
        )
    for rid in study.missing:
        records.append({RUN_ID: rid, "state": "missing", "flagged_by": "missing", "reason": "no run directory"})
    return pd.DataFrame.from_records(records, columns=cols)


def not_read(study: Study) -> tuple[int, int]:
    """(runs the study asked for, of them unreadable or missing): what no table, figure or verdict holds."""
    gone = len(study.unreadable) + len(study.missing)
    return len(study.runs) + gone, gone


def cleared_runs(study: Study) -> pd.DataFrame:
    """Runs whose reward fell by the per-run drop rule but which the seed-band check did not flag
    (collapse.COLLAPSE_RULE): run_id, algorithm, the swept axes, seed, why (the band and the run's last-window mean)."""
    cols = [RUN_ID, ALGORITHM, *study.axes, "seed", "why not flagged"]
    if vocab.REWARD not in study.metrics:
        return pd.DataFrame(columns=cols)
    coll = collapse.collapse_table(study.long, study.runs, vocab.REWARD)
    coll = coll[coll["in_band"].astype(bool)]
    out = coll[[RUN_ID, ALGORITHM, "in_band"]].merge(study.runs[[RUN_ID, *study.axes, "seed"]], on=RUN_ID, how="left")
    out = out.rename(columns={"in_band": "why not flagged"})
    return out[[c for c in cols if c in out.columns]].reset_index(drop=True)


def runs_table(study: Study) -> pd.DataFrame:
    """Every run: id, algorithm and its registry label, swept axes, seed, state, steps, precision emulation."""
    runs = study.runs
    cols = [RUN_ID, ALGORITHM, *study.axes, "seed", "state", "last_step"]
    out = runs[cols].copy()
    out.insert(2, "label", [names.label_or_name(str(a)) for a in out[ALGORITHM]])
    if runs[EMULATED].notna().any():
        out[EMULATED] = runs[EMULATED]
    return out.reset_index(drop=True)


def setup_section(notes: StudyNotes | None) -> list[render.Block]:
    """How the study was set up: the sweep file's description, then the study's notes (docs/studies/<sweep stem>.md)
    rendered, or a line saying they are missing; nothing without a sweep file."""
    if notes is None:
        return []
    head = f"From the sweep file {notes.sweep}" + (f": {notes.description}" if notes.description else ".")
    out: list[render.Block] = [render.h(2, "How the study was set up", anchor="setup"), render.p(head)]
    if notes.text is None:
        out.append(render.p(f"No study notes: {notes.why_missing}."))
    else:
        out += [render.p(f"The study's notes ({notes.doc}):"), render.Notes(notes.text)]
    return out


def _study_summary(study: Study) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "runs": len(study.runs),
        "states": study.runs["state"].value_counts().to_dict(),
        "unreadable": len(study.unreadable),
        "unreadable run ids": list(study.unreadable[RUN_ID]),
        "missing": len(study.missing),
        "missing run ids": list(study.missing),
        "algorithms": [
            names.label_or_name(a) for a in names.order_or_sorted(study.runs[ALGORITHM].dropna().astype(str).unique())
        ],
        "seeds": natural_sorted_text(study.runs["seed"].dropna().unique()),
        "swept axes": {a: natural_sorted_text(study.runs[a].dropna().unique()) for a in study.axes},
    }
    if study.runs[EMULATED].notna().any():
        summary["runs with emulated precision"] = int(study.runs[EMULATED].fillna(False).sum())
    return summary


def lead(study: Study) -> render.Para:
    """One line on the study under the title: runs and their states, algorithms, seeds, swept axes, missing runs."""
    sm = _study_summary(study)
    swept = render.text(sm["swept axes"]) if study.axes else "none"
    gone = [f"{sm[k]} {k}" for k in ("unreadable", "missing") if sm[k]]
    missing = "; ".join(gone) if gone else "none unreadable or missing"
    return render.p(
        f"{sm['runs']} runs ({render.text(sm['states'])}; {missing}) of {render.text(sm['algorithms'])}; "
        f"seeds {render.text(sm['seeds'])}; swept axes: {swept}."
    )


def study_section(study: Study, table_files: Mapping[str, Path], out_dir: Path) -> list[render.Block]:
    """The study (runs, states, algorithms, swept axes) and its provenance: manifests, packages, common config, runs
    (the end of the report: what a reader checks, not what they came for)."""
    prov = provenance(study)
    packages = pd.DataFrame(
        {"package": list(prov["packages"]), "versions (runs)": [render.counted(v) for v in prov["packages"].values()]}
    )
    return [
        render.h(2, "Study and provenance", anchor="study"),
        render.Table(render.kv(_study_summary(study))),
        render.h(3, "Provenance", anchor="provenance"),
        render.Table(
            pd.DataFrame(
                {
                    "key": [k for k in prov if k != "packages"],
                    "value": [render.counted(v) for k, v in prov.items() if k != "packages"],
                }
            )
        ),
        render.h(3, "Packages"),
        render.Table(packages),
        render.h(3, "Configuration common to every run"),
        render.Table(render.kv(_common_config(study.configs, study.axes))),
        render.h(3, "Runs"),
        render.table_or_link(runs_table(study), table_files.get("runs"), out_dir),
    ]


SIGNAL_METRICS = ("zero_var_group_frac", "zero_var_solved_frac")
"""Groups without a learning signal (every reward equal), and the part of them the policy solves every time."""


def signal_table(study: Study) -> pd.DataFrame:
    """Per configuration: the fraction of groups with no learning signal over the whole run and in its first and last
    quarter of steps (seed mean), and how much of it is groups every sample solves (the rest: groups none solves).
    Empty when the runs did not log it."""
    long = study.long
    rows = long[long[METRIC].astype(str).isin(SIGNAL_METRICS) & (long[STEP] > 0)].dropna(subset=[VALUE])
    if rows.empty:
        return pd.DataFrame()
    cols = [c for c in study.group_cols if c in rows.columns]
    last = rows.groupby(RUN_ID, observed=True)[STEP].transform("max")
    rows = rows.assign(quarter=(4 * (rows[STEP] - 1) // last.clip(lower=1)).clip(upper=3))
    out = []
    for key, g in rows.groupby(cols, observed=True):
        key = key if isinstance(key, tuple) else (key,)
        per_run = g.pivot_table(index=[RUN_ID, "quarter"], columns=METRIC, values=VALUE, observed=True)
        runs = per_run.groupby(level=RUN_ID).mean()
        by_q = per_run.groupby(level="quarter").mean()
        zv = "zero_var_group_frac"
        row = dict(zip(cols, key, strict=True))
        row[ALGORITHM] = names.label_or_name(str(row[ALGORITHM]))
        row.update(
            {
                "runs": len(runs),
                "no-signal groups": f"{runs[zv].mean():.2f}",
                "first quarter": f"{by_q[zv].iloc[0]:.2f}",
                "last quarter": f"{by_q[zv].iloc[-1]:.2f}",
            }
        )
        if "zero_var_solved_frac" in runs:
            row["of which solved by every sample"] = f"{runs['zero_var_solved_frac'].mean():.2f}"
        out.append(row)
    return pd.DataFrame(out)


SIGNAL_NOTE = (
    "Learning signal: a group whose G responses all get the same reward gives every response advantage 0. Groups "
    "no sample solves mean the start is too weak for the task; groups every sample solves are problems RL has "
    "mastered, so their share rises as the policy learns."
)


def signal_section(study: Study) -> list[render.Block]:
    table = signal_table(study)
    return (
        []
        if table.empty
        else [render.h(3, "Learning signal", anchor="signal"), render.p(SIGNAL_NOTE), render.Table(table)]
    )


ALGORITHM_REPS = 2000
"""Bootstrap resamples of the algorithm table's IQM and probability of improvement."""


def algorithm_table(study: Study, gain: gain_.HeldOutGain, *, reps: int = ALGORITHM_REPS) -> tuple[pd.DataFrame, str]:
    """The algorithm table (design.algorithm_table) of the held-out gain per run, the tasks being the configurations
    of the swept axes every algorithm ran alike, the reference the GRPO baseline (else the first algorithm); and the
    note under it. Empty when no run has a held-out gain."""
    if not gain.available:
        return pd.DataFrame(), ""
    per = gain_.per_run(study.long, gain.metric)
    per = per[per[RUN_ID].astype(str).isin(set(study.runs.loc[study.runs["state"] != "failed", RUN_ID].astype(str)))]
    algs = names.order_or_sorted(per[ALGORITHM].astype(str).unique())
    tasks = [a for a in study.axes if a in per]  # a configuration of the other swept axes is a task
    ref = scorecard.grpo_baseline(algs) or algs[0]
    per = per.assign(**{ALGORITHM: pd.Categorical(per[ALGORITHM].astype(str), categories=algs, ordered=True)})
    per = per.sort_values(ALGORITHM, kind="stable")
    t = design.algorithm_table(per, tasks, reference=ref, reps=reps)
    if t.empty:
        return t, ""
    out = pd.DataFrame({"algorithm": [names.label_or_name(a) for a in t["algorithm"]], "n runs": t["n"]})
    fmt = "{:.3f}".format
    out[f"{gain.metric} gain, mean [95% t]"] = [
        f"{fmt(m)} [{fmt(lo)}, {fmt(hi)}]" for m, lo, hi in zip(t["mean"], t["low"], t["high"], strict=True)
    ]
    out["IQM [nominal 95% bootstrap]"] = [
        f"{fmt(m)} [{fmt(lo)}, {fmt(hi)}]" if np.isfinite(lo) else fmt(m)
        for m, lo, hi in zip(t["iqm"], t["iqm_low"], t["iqm_high"], strict=True)
    ]
    out[f"P(> {names.label_or_name(ref)}) [nominal 95% bootstrap]"] = [
        "" if not np.isfinite(p) else f"{p:.2f} [{lo:.2f}, {hi:.2f}]" if np.isfinite(lo) else f"{p:.2f}"
        for p, lo, hi in zip(t["p_improve"], t["p_low"], t["p_high"], strict=True)
    ]
    out["tasks"] = t["tasks"]
    note = design.ALGORITHM_TABLE_NOTE.format(ref=names.label_or_name(ref), reps=reps)
    left = len(per) - int(t["n"].sum())
    what = (
        f"Held-out gain ({gain.metric}: last evaluation minus step 0) per run; tasks: the configurations of "
        + (", ".join(tasks) if tasks else "none (no other swept axis: one task)")
        + " that every algorithm ran"
        + (f" ({left} run(s) of configurations some algorithm did not run are left out)" if left else "")
        + ". "
    )
    return out, what + note


def parity_section(parity: pd.DataFrame | None) -> list[render.Block]:
    """Emulated against real low precision on the machine that made the study (study/tools/parity.py, rule
    precision_parity): the |delta| distributions whose tail C5's mismatch depends on; nothing without the table."""
    if parity is None or parity.empty:
        return []
    shown = parity.copy()
    for c in shown.columns:
        if shown[c].dtype.kind == "f":
            shown[c] = [f"{x:.3g}" for x in shown[c]]
    lines = [
        f"{r['precision']} cross-engine mismatch p99 {r['p99 emulated']:.3g} emulated vs {r['p99 real']:.3g} real "
        f"(ratio {r['p99 emulated/real']:.2f})"
        for _, r in parity[parity["what"] == "mismatch"].iterrows()
    ]
    return [
        render.h(3, "Emulated against real low precision on this machine", anchor="precision-parity"),
        render.p(
            "The runs' low precision is emulated (fp32 compute rounded where a GPU rounds, study/core/precision.py). "
            "Read C5 with the emulation's fidelity: per engine, |log-prob - fp32 log-prob| of the tiny model's "
            "response tokens (fixed random weights, init_std 0.1), and the cross-engine mismatch |trainer - engine| "
            "that pi_old from the rollout engine brings in, real vs emulated on the machine that ran the study "
            "(`python -m study.tools.parity`, rule precision_parity). "
            + "; ".join(lines)
            + ". An emulated tail lighter than the real one understates the mismatch: a real-precision run "
            "(sweeps/precision.yaml) may show a larger drop."
        ),
        render.Table(shown),
    ]


def budget_section(budgets: pd.DataFrame | None) -> list[render.Block]:
    """The cold start's held-out pass@1 at each generation budget (study/tools/budgets.py, rule coldstart_budgets), with
    a line saying whether it rises with the budget; nothing when the study has no such table."""
    if budgets is None or budgets.empty:
        return []
    lines = []
    for name, t in budgets.groupby("coldstart", sort=False):
        v = t.sort_values("max_new_tokens")["pass_at_1"].to_numpy(float)
        rises = bool(np.all(np.diff(v) >= 0) and v[-1] > v[0])
        lo, hi = t["max_new_tokens"].min(), t["max_new_tokens"].max()
        verb = "rises" if rises else "does not rise"
        lines.append(f"{name}: pass@1 {verb} with the budget ({v[0]:.3f} at {lo} tokens, {v[-1]:.3f} at {hi})")
    shown = budgets.copy()
    for c in ("pass_at_1", "truncated", "reference_fits"):
        shown[c] = [f"{x:.3f}" for x in shown[c]]
    return [
        render.h(2, "Generation budget at the cold start", anchor="coldstart-budgets"),
        render.p(
            "Before any RL: the cold start's mean pass@1 on the held-out in_dist set at each max_new_tokens the runs "
            "use (the same problems and sampling seed at every budget; a response cut before its answer scores 0); "
            "truncated = share of samples cut at the budget; reference_fits = share of problems whose reference "
            "worked solution fits. Made by `python -m study.tools.budgets` (Snakemake rule coldstart_budgets). "
            + "; ".join(lines)
            + "."
        ),
        render.Table(shown),
    ]


MAIN_FIGURES = ("figure1_reward", "figure2_clipping", "figure3_routing_replay")
"""The figures the report shows right after its headline; the others follow the scorecard."""


ROUTING_FIGURE = "figure8_routing_volatility"
"""Shown after Figures 1-3 when drawn (a study sweeping an axis besides algorithm), with the Routing Replay claims'
verdicts per configuration beside it."""


ROUTING_CLAIMS = ("C3", "C4")
"""The claims whose per-configuration verdicts sit next to the routing-volatility figure."""


def routing_verdicts(cards: Sequence[scorecard.ClaimResult], claims: Sequence[str] = ROUTING_CLAIMS) -> pd.DataFrame:
    """One row per stratum (configuration) of `claims`: for each claim its verdict there and its evidence (the first
    two lines: the comparison, then for C4 the collapse part); empty when none of them is stratified."""
    by_claim = {c.claim: c for c in cards if c.claim in claims and len(c.strata) > 1}
    labels: list[str] = []
    for c in by_claim.values():
        labels += [s.label for s in c.strata if s.label not in labels]
    rows = []
    for label in labels:
        row: dict[str, str] = {"configuration": label}
        for claim, c in by_claim.items():
            s = next((s for s in c.strata if s.label == label), None)
            row[claim] = s.verdict if s else ""
            ev = [e for e in (s.evidence if s else []) if not e.name.startswith("collapse_rate(") or " - " in e.name]
            row[f"{claim} evidence"] = "; ".join(
                f"{e.name} = {e.estimate:.3g} [{e.low:.3g}, {e.high:.3g}] (n={e.n})" for e in ev[:2]
            )
        rows.append(row)
    return pd.DataFrame(rows)


def routing_section(
    rendered: figures.Rendered, cards: Sequence[scorecard.ClaimResult], out_dir: Path
) -> list[render.Block]:
    """The routing-volatility figure, when drawn, with C3 and C4 per configuration beside it."""
    fig = figure_blocks(rendered, [ROUTING_FIGURE], out_dir)
    if not fig:
        return []
    out: list[render.Block] = [render.h(2, "Routing volatility", anchor="routing-volatility"), *fig]
    verdicts = routing_verdicts(cards)
    if not verdicts.empty:
        out += [
            render.p(
                "C3 (GRPO without Routing Replay is unstable; with it, it converges) and C4 (GSPO needs no Routing "
                "Replay) in each configuration, decided by the rules of the scorecard below:"
            ),
            render.Table(verdicts),
        ]
    return out


OFFPOLICY_FIGURE = "figure9_offpolicy_replay"
"""Shown first, right after the line on the study, when drawn (a study sweeping minibatches per rollout batch), under
the outcome it shows (analysis.claims.offpolicy)."""


def offpolicy_section(
    rendered: figures.Rendered, out_dir: Path, threshold: float = scorecard.RULES.min_volatility
) -> list[render.Block]:
    """The off-policy figure, when drawn, under the sentences that say which outcome the runs show
    (analysis.claims.offpolicy.outcome, with the scorecard's volatility threshold); nothing otherwise."""
    fig = figure_blocks(rendered, [OFFPOLICY_FIGURE], out_dir)
    if not fig:
        return []
    said = offpolicy.outcome(rendered.tables[OFFPOLICY_FIGURE], threshold)
    return [
        render.h(2, "Routing Replay along off-policy updates", anchor="offpolicy"),
        *(render.p(s) for s in said.sentences),
        *(render.p(s) for s in offpolicy.mechanism(rendered.tables[OFFPOLICY_FIGURE])),
        *fig,
    ]


def figure_blocks(rendered: figures.Rendered, names: Sequence[str], out_dir: Path) -> list[render.Block]:
    """Each figure of `names` that was drawn: its PNG, caption and links to its other formats."""
    out: list[render.Block] = []
    for name in names:
        paths = rendered.paths.get(name)
        if not paths:
            continue
        png = next(p for p in paths if p.suffix == ".png")
        rel = {p: p.relative_to(out_dir).as_posix() for p in paths}
        links = tuple(render.Link(p.suffix[1:].upper(), rel[p]) for p in paths if p.suffix != ".png")
        out.append(render.Figure(name, png, rel[png], rendered.captions[name], links))
    return out


def figures_section(rendered: figures.Rendered, table_files: Mapping[str, Path], out_dir: Path) -> list[render.Block]:
    """The figures after the main ones, then every figure's tables (short ones inline, every one linked as CSV),
    then the figures not drawn and why."""
    rest = [n for n in rendered.paths if n not in (*MAIN_FIGURES, ROUTING_FIGURE, OFFPOLICY_FIGURE)]
    out: list[render.Block] = []
    if rest:
        out += [render.h(2, "More figures", anchor="figures"), *figure_blocks(rendered, rest, out_dir)]
    if rendered.skipped:
        sk = pd.DataFrame({"figure": list(rendered.skipped), "why skipped": list(rendered.skipped.values())})
        out += [render.h(3, "Figures not drawn"), render.Table(sk)]
    out.append(render.h(2, "Figure tables", anchor="tables"))
    for name in rendered.paths:
        for tname, df in rendered.tables.get(name, {}).items():
            key = f"{name}.{tname}"
            out.append(
                render.h(4, key, " (", render.Link("CSV", table_files[key].relative_to(out_dir).as_posix()), ")")
            )
            out.append(
                render.Table(df) if len(df) <= render.MAX_INLINE_ROWS else render.p(f"{len(df)} rows: see the CSV.")
            )
    return out


def problems_section(problems: pd.DataFrame, cleared: pd.DataFrame) -> list[render.Block]:
    """The failed, collapsed and missing runs (problem_runs) with the rule that flagged each, or a line saying there
    are none; the collapse rule; the runs whose reward fell but stayed inside their seed band (cleared_runs)."""
    none = "None: every run completed and none was detected as collapsed; no run is unreadable or missing."
    out: list[render.Block] = [
        render.h(2, "Failed, collapsed, unreadable and missing runs", anchor="problems"),
        render.Table(problems) if len(problems) else render.p(none),
        render.p(
            "flagged_by: status.json = the run's own guard (non-finite loss, exploding ratio, reward floor; always a "
            f"collapse); analysis: {collapse.DROP} = {collapse.collapse_rule()} analysis: {collapse.NON_FINITE} = a "
            "NaN or infinite reward."
        ),
    ]
    if len(cleared):
        out += [render.h(3, "Reward fell, inside the seed band: not flagged"), render.Table(cleared)]
    return out
