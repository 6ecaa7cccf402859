"""The one matplotlib style of the project: rcParams, figure sizes, algorithm colours/labels, atomic saving.

Figures are built on `matplotlib.figure.Figure` directly (no pyplot state, no backend needed) and saved as PNG (for
the HTML report) and PDF + SVG (for papers) with fixed metadata, so that re-rendering unchanged data gives the same
files. Labels and colours come from the algorithm registry (`registry()`): no figure code names an algorithm.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import matplotlib as mpl
from matplotlib.figure import Figure

from analysis import files

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


def registry() -> ModuleType:
    """The algorithm registry (the `algorithms` package), imported on first use because it imports torch: colours,
    labels and order here, routing modes and Routing Replay partners (`replay_partner`, `routing_variants`) for the
    figures and the scorecard."""
    import algorithms

    return algorithms


def color(name: str) -> str:
    """The registry colour of algorithm `name` (unknown names raise, listing the valid ones)."""
    return registry().get(name).color


def label(name: str) -> str:
    """The registry label of algorithm `name`."""
    return registry().get(name).label


def order(names: Iterable[str]) -> list[str]:
    """`names` in registry order (the legend and bar order of every figure)."""
    reg = {n: i for i, n in enumerate(registry().names())}
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in reg]
    if unknown:
        registry().get(unknown[0])  # raises with the valid names
    return sorted(names, key=reg.__getitem__)


def config_colors(n: int) -> list[str]:
    """n distinct colours for what is not an algorithm (e.g. precision configurations): tab10, tab20 beyond 10."""
    cmap = mpl.colormaps["tab10" if n <= 10 else "tab20"]
    return [mpl.colors.to_hex(cmap(i % cmap.N)) for i in range(n)]
