"""The paper's figures from a loaded study (analysis.runs.tidy.Study), one module per figure. No function here names an
algorithm.

Each `figureN_*` returns a `Made`: the matplotlib Figure, a file name, a caption, and the tables behind it (for the
report). FIGURES lists them in the report's order (a new figure is a module here and its entry there); `make_all`
renders every figure whose data the study has and says why it skipped the others.

1. reward and each held-out eval vs training compute, per configuration, seed mean with a t band; the
   held-out panels begin at compute 0 with the starting policy's evaluation (the step-0 row) when runs have one;
2. average clipped-token fraction per algorithm (log scale; total, low, high) and clip fraction over training;
3. with vs without Routing Replay: algorithms that share a loss function and differ by `routing`, one panel per
   loss, every run drawn, collapsed runs marked with an x;
4. precision: final reward and mismatch metrics per (train dtype, rollout dtype, pi_old source) configuration;
4b. precision, per token: trainer vs rollout-engine log-probs of the same sampled tokens (scatter / hexbin per
   configuration) and the histogram of per-sequence log-ratios (from `token_samples.parquet`; skipped, saying why,
   when no run wrote one);
5. length: final reward and efficiency vs maximum generation length;
6. routing volatility: expert-slot mismatch per layer and over training; its relation to the clip fraction;
7. compute-scaling fits (analysis.stats.fit): points, curve, extrapolation, and the table of A, B, C_mid;
8. routing volatility: per configuration of the non-algorithm swept axes, the gaps the claims compare (Routing Replay
   partner minus the algorithm, GSPO minus the GRPO baseline) in final reward and held-out gain against the measured
   expert-slot mismatch, and expert load imbalance and router entropy at the same x;
9. Routing Replay along off-policy updates (minibatches per rollout batch): the MoE's routing volatility, the held-out
   gain per algorithm beside the dense control, and what dropping Routing Replay costs against the volatility.

Metric and axis names: analysis.runs.vocab.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.figures import style
from analysis.figures.common import Made
from analysis.figures.fig1_reward import figure1_reward
from analysis.figures.fig2_clipping import figure2_clipping
from analysis.figures.fig3_routing_replay import figure3_routing_replay
from analysis.figures.fig4_precision import figure4_precision
from analysis.figures.fig4b_token_logprobs import figure4b_token_logprobs
from analysis.figures.fig5_length import figure5_length
from analysis.figures.fig6_routing import figure6_routing
from analysis.figures.fig7_fits import figure7_fits
from analysis.figures.fig8_routing_volatility import figure8_routing_volatility
from analysis.figures.fig9_offpolicy_replay import figure9_offpolicy_replay
from analysis.runs.columns import RUN_ID
from analysis.runs.select import MissingData, routed, select
from analysis.runs.tidy import Study

FIGURES: dict[str, Callable[[Study], Made]] = {
    fn.__name__: fn
    for fn in (
        figure1_reward,
        figure2_clipping,
        figure3_routing_replay,
        figure4_precision,
        figure4b_token_logprobs,
        figure5_length,
        figure6_routing,
        figure7_fits,
        figure8_routing_volatility,
        figure9_offpolicy_replay,
    )
}
"""Every figure, in the report's order: its name (the function's, and its files') -> the function."""
INDEX = "figures.json"
"""A figures directory's index (`python -m analysis figures`): figure name -> files, caption and tables, the skipped
figures with the reason, and the fingerprint of the data they were drawn from."""
TABLES = "tables"
"""Subdirectory of a figures directory holding each figure's tables, NAME.TABLE.csv."""


def data_fingerprint(study: Study) -> str:
    """A hash of what a study's figures are drawn from, per run: id, state, rows, last step and compute, and the
    missing and unreadable run ids (with the reason). Run directories only grow (a resumed run appends steps), so
    equal fingerprints mean figures drawn from one can be reused for the other (`analysis.report.build.build_report(
    figures_dir=...)`)."""
    import hashlib
    import json

    cols = [RUN_ID, "state", "n_steps", "last_step", "last_compute"]
    rows = study.runs[cols].astype(str).sort_values(RUN_ID).values.tolist()
    unread = sorted(zip(study.unreadable[RUN_ID].astype(str), study.unreadable["reason"].astype(str), strict=True))
    text = json.dumps({"runs": rows, "missing": sorted(map(str, study.missing)), "unreadable": unread})
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Rendered:
    """What `make_all` wrote, and why it skipped what it skipped."""

    paths: dict[str, list[Path]]
    captions: dict[str, str]
    tables: dict[str, dict[str, pd.DataFrame]]
    skipped: dict[str, str]


def make_all(study: Study, out_dir: str | os.PathLike[str], *, only: Sequence[str] | None = None) -> Rendered:
    """Render every figure the study has data for into `out_dir` (PNG, PDF, SVG); skipped ones say why (a figure
    whose data is missing, MissingData; or one that failed on these runs, with the error)."""
    out = Rendered({}, {}, {}, {})
    for name, fn in FIGURES.items():
        if only is not None and name not in only:
            continue
        try:
            made = fn(study)
        except MissingData as exc:
            out.skipped[name] = str(exc)
            continue
        except Exception as exc:  # a figure that cannot be drawn from these runs never stops the others
            out.skipped[name] = f"could not be drawn from these runs: {type(exc).__name__}: {exc}"
            continue
        out.paths[name] = style.save(made.fig, Path(out_dir) / made.name)
        out.captions[name] = made.caption
        out.tables[name] = made.tables
    return out


__all__ = [
    "FIGURES",
    "INDEX",
    "TABLES",
    "Made",
    "MissingData",
    "Rendered",
    "data_fingerprint",
    "figure1_reward",
    "figure2_clipping",
    "figure3_routing_replay",
    "figure4_precision",
    "figure4b_token_logprobs",
    "figure5_length",
    "figure6_routing",
    "figure7_fits",
    "figure8_routing_volatility",
    "figure9_offpolicy_replay",
    "make_all",
    "routed",
    "select",
]
