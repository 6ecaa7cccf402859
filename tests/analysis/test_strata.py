"""Stratification on hand-made runs tables: which axes split, which are pooled, how per-stratum verdicts combine."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.runs.tidy import Study
from analysis.stats import strata
from analysis.stats.verdicts import CONTRADICTED, INCONCLUSIVE, NO_DATA, SUPPORTED, Evidence


def _study(rows: list[dict], axes: list[str]) -> Study:
    runs = pd.DataFrame(rows)
    runs.insert(0, "run_id", [f"r{i}" for i in range(len(runs))])
    return Study(long=pd.DataFrame(), runs=runs, layers=pd.DataFrame(), axes=axes, missing=[])


def _groups(st: Study) -> dict[str, pd.Series]:
    return {a: st.runs["algorithm"] == a for a in ("gspo", "grpo")}


def test_stratify_splits_shared_axes_pools_unshared_and_skips_determined() -> None:
    rows = [
        {"algorithm": alg, "len": n, "eps": eps, "prec": p, "dtype": p.split("-")[0], "state": "completed"}
        for alg, eps in (("gspo", 4e-4), ("grpo", 0.27))
        for n in (1024, 256)
        for p in ("fp32", "bf16-emulated")
    ]
    st = _study(rows, ["len", "eps", "prec", "dtype"])
    s = strata.stratify(st, _groups(st))
    assert s.axes == ["len", "prec"] and s.unshared == ["eps"] and s.determined == ["dtype"]
    assert [key for key, _ in s.strata] == [
        {"len": 256, "prec": "bf16-emulated"},
        {"len": 256, "prec": "fp32"},
        {"len": 1024, "prec": "bf16-emulated"},
        {"len": 1024, "prec": "fp32"},
    ]  # numbers in numeric order, values as the runs table holds them
    assert all(int(mask.sum()) == 2 for _, mask in s.strata)  # one run of each algorithm per stratum
    text = s.text(["old_logp_source"])
    assert "4 combinations of len, prec" in text and strata.STRATA_RULE in text
    assert "CONFOUNDED" in text and "eps" in text and "Determined by the stratified axes: dtype" in text
    assert "own axis old_logp_source" in text
    st2 = _study(rows, ["len", "eps", "prec", "dtype"])
    assert strata.stratify(st2, _groups(st2), exclude=["len", "prec", "dtype"]).axes == []


def test_failed_runs_neither_make_strata_nor_data() -> None:
    rows = [
        {"algorithm": "gspo", "len": 256, "state": "completed"},
        {"algorithm": "grpo", "len": 256, "state": "collapsed"},
        {"algorithm": "gspo", "len": 512, "state": "completed"},
        {"algorithm": "grpo", "len": 512, "state": "failed"},
        {"algorithm": "gspo", "len": 999, "state": "failed"},
        {"algorithm": "grpo", "len": 999, "state": "unknown"},
    ]
    st = _study(rows, ["len"])
    assert strata.usable(st.runs).tolist() == [True, True, True, False, False, False]
    s = strata.stratify(st, _groups(st))
    assert [key for key, _ in s.strata] == [{"len": 256}, {"len": 512}]
    seen = []

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        seen.append(int(mask.sum()))
        return SUPPORTED, [Evidence("d", 1.0, 0.5, 1.5, "1 vs 1")]

    out = strata.run_strata(st, s, _groups(st), evaluate)
    assert [x.verdict for x in out] == [SUPPORTED, NO_DATA] and seen == [2]  # no usable grpo run at len=512
    verdict, evidence, reason = strata.outcome(s, out, evaluate)
    assert verdict == SUPPORTED and "(1 without)" in reason
    assert [e.stratum for e in evidence] == ["len=256", "len=512", "pooled over strata, reference only"]
    assert evidence[1].verdict == NO_DATA and str(evidence[0]).endswith("-> supported")


def test_outcome_of_one_stratum_reads_unstratified() -> None:
    st = _study([{"algorithm": "gspo", "state": "completed"}, {"algorithm": "grpo", "state": "completed"}], [])
    s = strata.stratify(st, _groups(st))
    assert s.axes == [] and len(s.strata) == 1 and "one comparison over all of them" in s.text()
    ev = [Evidence("d", 0.1, np.nan, np.nan, "1 vs 1")]
    out = strata.run_strata(st, s, _groups(st), lambda mask: (INCONCLUSIVE, ev))
    assert strata.outcome(s, out, None) == (INCONCLUSIVE, ev, "no interval (fewer than two usable runs per group)")
    none = strata.run_strata(st, s, _groups(st), lambda mask: None)
    assert strata.outcome(s, none, None) == (INCONCLUSIVE, [], "no usable runs of every compared group")


def test_combine_rule() -> None:
    assert strata.combine([SUPPORTED, SUPPORTED, NO_DATA]) == SUPPORTED
    assert strata.combine([SUPPORTED, CONTRADICTED]) == CONTRADICTED
    assert strata.combine([SUPPORTED, INCONCLUSIVE]) == INCONCLUSIVE
    assert strata.combine([NO_DATA, NO_DATA]) == INCONCLUSIVE
    assert strata.combine([]) == INCONCLUSIVE
