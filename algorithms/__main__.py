"""`python -m algorithms [--json]`: the registered variants, their routing, ratio level and default hyper-parameters
(--json: every variant's `Spec`, what algorithms.catalog reads)."""

import json
import sys
from collections.abc import Mapping

import algorithms


def main(argv: list[str]) -> None:
    if argv == ["--json"]:
        specs = {name: vars(algorithms.get(name).spec) for name in algorithms.names()}
        print(json.dumps(specs, default=lambda o: dict(o) if isinstance(o, Mapping) else vars(o)))  # Range: vars
        return
    rows = [("name", "label", "routing", "ratio", "rollout_logp", "hyper-parameters")]
    for name in algorithms.names():
        alg = algorithms.get(name)
        hp = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in alg.hparams.items())
        rows.append((name, alg.label, alg.routing, alg.ratio_level, "yes" if alg.needs_rollout_logp else "-", hp))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main(sys.argv[1:])
