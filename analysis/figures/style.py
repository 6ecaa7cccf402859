"""The one matplotlib style of the project: rcParams, figure sizes, colours, axes, atomic saving.

Figures are built on `matplotlib.figure.Figure` directly (no pyplot state, no backend needed) and saved as PNG (for
the HTML report) and PDF + SVG (for papers) with fixed metadata, so that re-rendering unchanged data gives the same
files. Algorithms' labels and colours come from the registry (`analysis.runs.names`): no figure code names an algorithm.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import matplotlib as mpl
import numpy as np
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from runfiles import atomic as files

FORMATS = ("png", "pdf", "svg")
DPI = 200
WIDTH_SINGLE = 3.4  # inches: one column of a two-column paper
WIDTH_DOUBLE = 7.0  # inches: full text width
PANEL_HEIGHT = 2.6
NEUTRAL = "#555555"

RC: dict[str, object] = {
    "font.size": 8,
    "axes.titlesize": 9,
    "axes.labelsize": 8,
    "legend.fontsize": 7,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    "lines.linewidth": 1.4,
    "legend.frameon": False,
    "figure.dpi": 100,
    "savefig.dpi": DPI,
    "savefig.bbox": "tight",
    "pdf.fonttype": 42,  # TrueType in PDFs (editable text)
    "svg.fonttype": "none",
    "svg.hashsalt": "moe-rl-study",  # deterministic SVG ids
}
_METADATA = {"png": {"Software": None}, "pdf": {"CreationDate": None, "Producer": None}, "svg": {"Date": None}}


@contextmanager
def context() -> Iterator[None]:
    """Apply the project's rcParams inside a `with` block."""
    with mpl.rc_context(RC):
        yield


F = TypeVar("F", bound=Callable[..., Any])


def styled(fn: F) -> F:
    """Build a figure inside `context()`: the rcParams apply to every artist the function creates (fonts, lines,
    legends), not only to the Figure object."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def new_figure(ncols: int = 1, nrows: int = 1, *, width: float | None = None, height: float | None = None) -> Figure:
    """A Figure (not pyplot-managed) sized for the paper: one column for a single panel, full width otherwise."""
    with context():
        w = width or (WIDTH_SINGLE if ncols == 1 else WIDTH_DOUBLE)
        h = height or PANEL_HEIGHT * nrows
        return Figure(figsize=(w, h), layout="constrained")


def save(fig: Figure, stem: str | os.PathLike[str], formats: Sequence[str] = FORMATS) -> list[Path]:
    """Write `stem.png/.pdf/.svg` atomically (temporary file, then rename); returns the paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    out = []
    with context():
        for fmt in formats:
            path = stem.with_name(f"{stem.name}.{fmt}")
            files.atomic_write(path, lambda tmp, fmt=fmt: fig.savefig(tmp, format=fmt, metadata=_METADATA.get(fmt)))
            out.append(path)
    return out


def legend_ncols(labels: Sequence[str], width: float = WIDTH_DOUBLE, max_cols: int = 4) -> int:
    """Columns for a legend of `labels` across `width` inches, so that it never needs more room than the figure has
    (at legend.fontsize 7: about 0.055 in per character plus 0.45 in of handle and padding per entry)."""
    if not labels:
        return 1
    per = 0.055 * max(len(lb) for lb in labels) + 0.45
    return max(1, min(max_cols, len(labels), int(width // per)))


CATEGORICAL = (
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#E69F00",
    "#56B4E9",
    "#000000",  # Okabe-Ito, less its yellow
    "#332288",
    "#882255",
    "#44AA99",
    "#999933",
    "#AA4499",
    "#117733",
    "#88CCEE",
    "#CC6677",
    "#777777",  # Paul Tol
)
"""Colour-blind-safe colours with no yellow on white, for what is not an algorithm (algorithms: the registry's)."""


def config_colors(n: int) -> list[str]:
    """n colours for what is not an algorithm (e.g. precision configurations): CATEGORICAL, cycled beyond 16."""
    return [CATEGORICAL[i % len(CATEGORICAL)] for i in range(n)]


# --- axes ---------------------------------------------------------------------------------------------------------
COMPUTE_UNITS = ((1e21, "ZFLOP"), (1e18, "EFLOP"), (1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1.0, "FLOP"))


def compute_unit(largest: float) -> tuple[float, str]:
    """(scale, name) of the FLOP unit in which `largest` compute reads as 1 to 999 (GFLOP, TFLOP, PFLOP, ...), so
    compute axes carry plain numbers."""
    for scale, name in COMPUTE_UNITS:
        if np.isfinite(largest) and largest >= scale:
            return scale, name
    return COMPUTE_UNITS[-1]


def _tick_label(v: float, _pos: object = None) -> str:
    """A log-axis tick label: plain (0.02, 500) between 1e-4 and 1e5, else 2e-06."""
    if v == 0:
        return "0"
    return f"{v:g}" if 1e-4 <= abs(v) < 1e5 else f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e")


class LogTicks(ticker.Locator):
    """Major ticks of a log axis at 1-2-5 x 10^k, thinned to 1-2-3-5-7, 1-3, 1 x 10^k (then every n-th decade) until
    the labels of neighbouring ticks cannot overlap at the axis' drawn length; decided at draw time. On an axis drawn
    from zero (`log_scale(..., zero=...)`: linear from 0 to its first value, logarithmic beyond) 0 is a tick too."""

    SUBS = ((1, 2, 5), (1, 3), (1,))

    def __call__(self) -> list[float]:
        lo, hi = self.axis.get_view_interval()
        return self.tick_values(lo, hi)

    def tick_values(self, vmin: float, vmax: float) -> list[float]:
        lo, hi = sorted((float(vmin), float(vmax)))
        transform = self.axis.get_transform()
        linthresh = getattr(transform, "linthresh", None)  # symlog: linear below linthresh
        zero = linthresh is not None and lo <= 0 < hi
        if zero:
            lo = max(lo, float(linthresh))
        if not (lo > 0 and np.isfinite(hi) and hi > lo):
            return [0.0] if zero else []
        axes = self.axis.axes
        horizontal = self.axis.axis_name == "x"
        length = (axes.bbox.width if horizontal else axes.bbox.height) / axes.figure.dpi  # inches
        size = mpl.font_manager.FontProperties(size=mpl.rcParams[f"{self.axis.axis_name}tick.labelsize"])
        pt = size.get_size_in_points()
        view = sorted(float(v) for v in self.axis.get_view_interval())
        t_lo, t_hi = (float(v) for v in transform.transform(np.array(view)))

        def fits(ticks: list[float]) -> bool:
            if len(ticks) < 2:
                return True
            pos = [(float(t) - t_lo) / (t_hi - t_lo) * length for t in transform.transform(np.array(ticks))]
            gaps = [b - a for a, b in itertools.pairwise(pos)]
            if horizontal:  # half of each neighbour's label width, plus a gap of one character
                widths = [len(_tick_label(t)) * 0.6 * pt / 72 for t in ticks]
                need = [0.5 * (a + b) + pt * 0.6 / 72 for a, b in itertools.pairwise(widths)]
            else:
                need = [1.6 * pt / 72] * len(gaps)
            return all(g >= n for g, n in zip(gaps, need, strict=True))

        head = [0.0] if zero else []
        k0, k1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        eps = 1e-9 * (hi - lo)
        candidates = []
        for subs in self.SUBS:
            candidates.append([m * 10.0**k for k in range(k0, k1 + 1) for m in subs])
        for stride in range(2, max(2, k1 - k0) + 1):
            candidates.append([10.0**k for k in range(k0, k1 + 1) if k % stride == 0])
        chosen: list[float] = []
        for cand in candidates:
            ticks = head + [t for t in cand if lo - eps <= t <= hi + eps]
            if len(ticks) <= 8 + len(head) and fits(ticks):
                chosen = ticks
                break
        if len(chosen) < 2 + len(head):  # a range narrower than 1-2-5 steps: evenly spaced round numbers inside it
            for nbins in (4, 3, 2, 1):
                ticks = head + [float(t) for t in ticker.MaxNLocator(nbins=nbins).tick_values(lo, hi) if lo <= t <= hi]
                if len(ticks) >= len(chosen) and fits(ticks):
                    return ticks
        return chosen or head


def log_scale(ax: Axes, which: str = "x", *, zero: float | None = None) -> None:
    """A log scale on `ax`'s x or y axis whose ticks never overlap and read as plain numbers (LogTicks), with unlabelled
    minor ticks. `zero`: the axis starts at 0, linear from 0 to `zero` (drawn half a decade wide) and logarithmic
    beyond (matplotlib's symlog), so that a value at 0 (the starting policy's evaluation, at compute 0) has a place."""
    if zero is not None and zero > 0:
        (ax.set_xscale if which == "x" else ax.set_yscale)("symlog", linthresh=zero, linscale=0.5)
        (ax.set_xlim if which == "x" else ax.set_ylim)(0, None)
    else:
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(LogTicks())
    axis.set_major_formatter(ticker.FuncFormatter(_tick_label))
    axis.set_minor_formatter(ticker.NullFormatter())
