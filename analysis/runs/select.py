"""Choosing a study's runs and reading their configurations: a selection by axis values (`select`, `only`), the
routed runs (`routed`: without the dense controls), the swept axes that still vary, the configurations the usable runs
form, a run's model (MoE or its dense control), and the error a table or figure raises when the study lacks what it
needs (`MissingData`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.runs import vocab
from analysis.runs.columns import RUN_ID
from analysis.runs.natural import natural_keys
from analysis.runs.tidy import Study


class MissingData(ValueError):
    """The study lacks the metric or axis a figure needs (message says which, and what is there)."""


def select(study: Study, where: Mapping[str, Any] | None) -> Study:
    """The runs of `study` whose axis values match `where` (e.g. {"max_new_tokens": 512})."""
    if not where:
        return study
    ids = set(study.runs[RUN_ID].astype(str))
    for key, value in where.items():
        if key not in study.runs.columns:
            raise MissingData(f"cannot select on {key!r}: not a column; axes are {study.axes}")
        ids &= set(study.runs.loc[equal(study.runs[key], value), RUN_ID].astype(str))
    return only(study, ids)


def routed(study: Study) -> Study:
    """`study` without its dense-control runs (a model of one expert: nothing to route, so no routing to measure),
    for the routing figures; unchanged when it has none or has nothing else."""
    ids = study.runs[RUN_ID].astype(str).tolist()
    moe = {r for r, m in zip(ids, model_of(study, ids), strict=True) if m == MOE}
    return study if not moe or len(moe) == len(ids) else only(study, moe)


def only(study: Study, ids: set[str]) -> Study:
    """`study` restricted to the runs `ids`."""
    long, runs, layers, tokens, seqs = study.long, study.runs, study.layers, study.tokens, study.sequences
    long = long[long[RUN_ID].astype(str).isin(ids)]
    layers = layers[layers[RUN_ID].astype(str).isin(ids)]
    runs = runs[runs[RUN_ID].astype(str).isin(ids)]
    tokens = tokens[tokens[RUN_ID].astype(str).isin(ids)] if len(tokens) else tokens
    seqs = seqs[seqs[RUN_ID].astype(str).isin(ids)] if len(seqs) else seqs
    return Study(
        long=long,
        runs=runs,
        layers=layers,
        axes=study.axes,
        missing=study.missing,
        configs=study.configs,
        manifests=study.manifests,
        tokens=tokens,
        sequences=seqs,
    )


def varying(study: Study) -> list[str]:
    """Swept axes that still take more than one value in (a selection of) the study."""
    return [a for a in study.axes if study.runs[a].nunique(dropna=False) > 1]


def need_metric(study: Study, metric: str) -> None:
    if metric not in study.metrics:
        raise MissingData(f"metric {metric!r} not logged; present: {', '.join(study.metrics)}")


def need_axis(study: Study, axis: str) -> None:
    if axis not in study.axes:
        raise MissingData(f"axis {axis!r} is not swept in this study; swept axes: {study.axes or 'none'}")


def key(values: Sequence[Any]) -> tuple[Any, ...]:
    """Axis values as a lookup key: NaN (an axis a run's config lacks, e.g. a model field only a dense control sets)
    as None, which equals itself (NaN does not, so a tuple holding one would never be found again)."""
    return tuple(None if isinstance(v, float) and np.isnan(v) else v for v in values)


def equal(column: pd.Series, value: Any) -> np.ndarray:
    """Rows of `column` equal to `value`, NaN matching NaN (an axis a run's config lacks: `key`)."""
    if isinstance(value, float) and np.isnan(value):
        return column.isna().to_numpy()
    return (column == value).to_numpy()


def configurations(study: Study, axes: Sequence[str]) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """The value combinations of `axes` among the usable runs (natural order) and run_id -> its combination's index."""
    runs = study.runs[~study.runs["state"].isin(["failed", "unknown"])]
    keys = sorted({key(r) for r in runs[list(axes)].itertuples(index=False, name=None)}, key=natural_keys)
    index = {k: i for i, k in enumerate(keys)}
    of = {str(rid): index[key(v)] for rid, *v in runs[[RUN_ID, *axes]].itertuples(index=False, name=None)}
    return keys, of


def short(v: Any) -> str:
    """An axis value as a tick label: numbers as %g (30, not 30.0), the rest as text."""
    try:
        return f"{float(v):g}"
    except (TypeError, ValueError):
        return str(v)


MOE, DENSE = "MoE", "dense"
"""A run's model (`model_of`; the `model` column of Figure 9's tables): the MoE, or its dense control (a run whose
model has one expert)."""


def model_of(study: Study, run_ids: Sequence[str]) -> list[str]:
    """DENSE for a run whose config has one expert (vocab.NUM_EXPERTS_KEY = 1), else MOE."""
    return [
        DENSE if study.configs.get(str(r), {}).get(vocab.NUM_EXPERTS_KEY) in (1, 1.0, "1") else MOE for r in run_ids
    ]
