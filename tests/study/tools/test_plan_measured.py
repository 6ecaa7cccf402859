"""The planner's CPU-run estimate (study.tools.plan.cpu_run_estimate) against a real run's measured peak RSS, at one
cheap shape: benchmarks/bench_plan.py, the command behind docs/performance.md's table, in fresh processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_plan_is_within_20_percent_of_a_measured_run() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_plan.py"), "--preset", "default", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    for row in rows:
        plan = {k: round(v / 1e9, 3) for k, v in row["plan"].items()}
        what = (
            f"rank {row['rank']}: planned {plan}, measured process {row['baseline'] / 1e9:.3f} GB, peak "
            f"{row['peak'] / 1e9:.3f} GB"
        )
        assert abs(row["error"]) <= 0.2, what
        assert abs(row["error_above_process"]) <= 0.2, what  # the run's own memory, not only the libraries'
    assert proc.returncode == 0
