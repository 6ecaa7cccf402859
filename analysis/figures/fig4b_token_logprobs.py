"""Figure 4b (this study's): trainer vs rollout-engine log-probs of the same tokens and the sequence log-ratio
histogram, from `token_logprob_tables` (`tokens`, `seq_log_ratio`, `seq_log_ratio_hist`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.figures import style
from analysis.figures.common import Made, _legend, emulation_note
from analysis.runs import vocab
from analysis.runs.columns import EMULATED, PRECISION_KEYS, RUN_ID
from analysis.runs.select import MissingData, select
from analysis.runs.tidy import Study


def _precision_label(frame: pd.DataFrame, cols: Sequence[str]) -> pd.Series:
    """ "bf16 / bf16 / rollout" per row from the precision columns (unset values shown as "unset")."""
    if not cols:
        return pd.Series("all runs", index=frame.index)
    parts = [frame[c].astype(object).where(frame[c].notna(), "unset").astype(str) for c in cols]
    out = parts[0]
    for p in parts[1:]:
        out = out + " / " + p
    return out


def token_logprob_tables(
    study: Study, *, axes: Sequence[str] = PRECISION_KEYS, bins: int = 60
) -> dict[str, pd.DataFrame]:
    """Figure 4b's data per precision configuration (`axes` joined by " / ", column `config`):

    - `tokens`: n_runs, n_tokens (plotted), mean and mean |trainer_logp - engine_logp|, Pearson r, emulated;
    - `seq_log_ratio`: n_sequences, mean, std, quantiles 1/50/99% of seq_log_ratio (every sampled sequence);
    - `seq_log_ratio_hist`: bin_left, bin_right, count, fraction. Common equal-width bins over the pooled 0.1-99.9%
      quantile range (widened to include 0); values beyond it are counted in the edge bins, so counts sum to n.
    """
    tok, seq = study.tokens, study.sequences
    if tok.empty or seq.empty:
        raise MissingData(
            "no run wrote token_samples.parquet (runs from before the loop logged token samples have none): "
            "no token log-prob scatter or sequence log-ratio histogram"
        )
    cols = [a for a in axes if a in tok.columns]
    tok_cfg, seq_cfg = _precision_label(tok, cols), _precision_label(seq, cols)
    configs = sorted(seq_cfg.unique())
    diff = tok[vocab.TRAINER_LOGP].to_numpy(np.float64) - tok[vocab.ENGINE_LOGP].to_numpy(np.float64)
    emulated = seq[EMULATED].astype(object)
    tok_rows, seq_rows, hist_rows = [], [], []
    r_all = seq["seq_log_ratio"].to_numpy(np.float64)
    finite = r_all[np.isfinite(r_all)]
    lo, hi = np.quantile(finite, [0.001, 0.999]) if finite.size else (-1.0, 1.0)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo <= 0:
        lo, hi = lo - 1e-6, hi + 1e-6
    edges = np.linspace(lo, hi, bins + 1)
    for cfg in configs:
        tm = (tok_cfg == cfg).to_numpy()
        sm = (seq_cfg == cfg).to_numpy()
        x = tok[vocab.TRAINER_LOGP].to_numpy(np.float64)[tm]
        y, d = tok[vocab.ENGINE_LOGP].to_numpy(np.float64)[tm], diff[tm]
        r = r_all[sm]
        em = emulated[sm]
        tok_rows.append(
            {
                "config": cfg,
                "n_runs": int(seq.loc[sm, RUN_ID].nunique()),
                "n_tokens": int(tm.sum()),
                "diff_mean": float(d.mean()) if d.size else np.nan,
                "abs_diff_mean": float(np.abs(d).mean()) if d.size else np.nan,
                "pearson_r": float(np.corrcoef(x, y)[0, 1]) if d.size > 1 and x.std() > 0 and y.std() > 0 else np.nan,
                "emulated": bool((em == True).any()) if em.notna().any() else None,  # noqa: E712
            }
        )
        rf = r[np.isfinite(r)]
        q = np.quantile(rf, [0.01, 0.5, 0.99]) if rf.size else [np.nan] * 3
        seq_rows.append(
            {
                "config": cfg,
                "n_sequences": int(r.size),
                "mean": float(rf.mean()) if rf.size else np.nan,
                "std": float(rf.std(ddof=1)) if rf.size > 1 else np.nan,
                "q01": q[0],
                "median": q[1],
                "q99": q[2],
            }
        )
        counts, _ = np.histogram(np.clip(rf, edges[0], edges[-1]), bins=edges)
        hist_rows.append(
            pd.DataFrame(
                {
                    "config": cfg,
                    "bin_left": edges[:-1],
                    "bin_right": edges[1:],
                    "count": counts,
                    "fraction": counts / max(1, rf.size),
                }
            )
        )
    return {
        "tokens": pd.DataFrame(tok_rows),
        "seq_log_ratio": pd.DataFrame(seq_rows),
        "seq_log_ratio_hist": pd.concat(hist_rows, ignore_index=True),
    }


@style.styled
def figure4b_token_logprobs(
    study: Study,
    *,
    axes: Sequence[str] = PRECISION_KEYS,
    where: Mapping[str, Any] | None = None,
    bins: int = 60,
    hexbin_above: int = 2000,
    max_panels: int = 8,
) -> Made:
    """Per precision configuration: trainer (pi_old recompute) vs rollout-engine log-prob of the same sampled tokens
    (scatter, or hexbin above `hexbin_above` points, with y = x), and below, the histogram of the per-sequence
    log-ratio mean_t(trainer_logp - engine_logp) of every configuration."""
    st = select(study, where)
    tables = token_logprob_tables(st, axes=axes, bins=bins)
    tok = st.tokens
    cols = [a for a in axes if a in tok.columns]
    tok_cfg = _precision_label(tok, cols).to_numpy()
    summary = tables["tokens"].set_index("config")
    configs = list(summary.index)
    shown = configs[:max_panels]
    ncols = min(4, len(shown))
    nrows = -(-len(shown) // ncols)
    fig = style.new_figure(ncols=max(2, ncols), width=style.WIDTH_DOUBLE, height=2.0 * nrows + 2.2)
    gs = fig.add_gridspec(nrows + 1, ncols, height_ratios=[1.0] * nrows + [1.1])
    x_all = tok[vocab.TRAINER_LOGP].to_numpy(np.float64)
    y_all = tok[vocab.ENGINE_LOGP].to_numpy(np.float64)
    both = np.concatenate([x_all[np.isfinite(x_all)], y_all[np.isfinite(y_all)]])
    lo, hi = (float(np.quantile(both, 0.001)), float(both.max())) if both.size else (-1.0, 0.0)
    pad = 0.05 * max(hi - lo, 1e-3)
    lim = (lo - pad, hi + pad)
    hexbins = False
    for k, cfg in enumerate(shown):
        ax = fig.add_subplot(gs[k // ncols, k % ncols])
        m = tok_cfg == cfg
        x, y = x_all[m], y_all[m]
        if len(x) > hexbin_above:
            ax.hexbin(x, y, gridsize=40, bins="log", mincnt=1, cmap="viridis", extent=(*lim, *lim), linewidths=0)
            hexbins = True
        else:
            ax.scatter(x, y, s=3, alpha=0.5, color=style.NEUTRAL, lw=0)
        ax.plot(lim, lim, ls="--", lw=0.8, color="black", gid="y=x")
        ax.set_xlim(lim)
        ax.set_ylim(lim)
        ax.set_aspect("equal", adjustable="box")
        em = summary.loc[cfg, "emulated"]
        ax.set_title(cfg + (" (emulated)" if pd.notna(em) and bool(em) else ""), fontsize=7)
        ax.text(0.04, 0.96, f"r = {summary.loc[cfg, 'pearson_r']:.4f}", transform=ax.transAxes, va="top", fontsize=6)
        if k % ncols == 0:
            ax.set_ylabel("engine log-prob")
        if k // ncols == nrows - 1 or k + ncols >= len(shown):
            ax.set_xlabel("trainer log-prob")
    ax_h = fig.add_subplot(gs[nrows, :])
    hist = tables["seq_log_ratio_hist"]
    cycle = style.config_colors(len(configs))
    for cfg, color in zip(configs, cycle, strict=True):
        h = hist[hist["config"] == cfg]
        edges = np.r_[h["bin_left"].to_numpy(), h["bin_right"].to_numpy()[-1:]]
        n = int(tables["seq_log_ratio"].set_index("config").loc[cfg, "n_sequences"])
        em = summary.loc[cfg, "emulated"]
        name = f"{cfg}{' (emulated)' if pd.notna(em) and bool(em) else ''} (n={n})"
        ax_h.stairs(h["fraction"].to_numpy(), edges, color=color, lw=1.2, label=name, gid=f"hist-{cfg}")
    ax_h.axvline(0.0, color="black", lw=0.6, ls=":")
    ax_h.set_xlabel("sequence log-ratio mean_t(log pi_trainer - log pi_engine) = log s_i")
    ax_h.set_ylabel("fraction of sequences")
    _legend(fig, [ax_h])
    runs = st.runs[st.runs[RUN_ID].astype(str).isin(set(tok[RUN_ID].astype(str)))]
    steps = sorted(int(v) for v in st.sequences["step"].unique())
    caption = (
        "Figure 4b. Token log-probabilities of the same sampled response tokens in the two engines, per precision "
        f"configuration ({' / '.join(cols) or 'none recorded'}): x = the training engine's pi_old recompute (before "
        "the step's update, the weights the engine sampled with), y = the rollout engine's log-prob; dashed y = x"
        + ("; hexbins coloured by token count (log scale)" if hexbins else "")
        + f". {len(tok)} tokens from {len(runs)} run(s) (a random subset per run when a run logged many), sampled at "
        f"steps {', '.join(map(str, steps[:12]))}{' ...' if len(steps) > 12 else ''} (step 1, every eval step and "
        "the last step; up to 64 sequences each)."
        + (
            f" Only the first {max_panels} of {len(configs)} configurations are scattered."
            if len(configs) > len(shown)
            else ""
        )
        + " Bottom: histogram of the per-sequence log-ratio mean_t(log pi_trainer - log pi_engine), the GSPO "
        "length-normalised (mean over the sequence's tokens, not the sum) log-ratio log s_i that using the engine's "
        f"log-probs as pi_old would add, over all {len(st.sequences)} sampled sequences (every token, no subsampling)."
        + emulation_note(runs)
    )
    return Made(fig, "figure4b_token_logprobs", caption, tables)
