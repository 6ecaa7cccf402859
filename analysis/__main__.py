"""`python -m analysis report RESULTS_DIR [--study NAME] [--out DIR]`: rebuild a study's report from its run
directories (nothing is rerun) and print the path of index.html."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="rebuild results/<study>/report/index.html (+ index.md) from run directories")
    rep.add_argument("results_dir", help="the results directory (holding runs/{run_id}/)")
    rep.add_argument(
        "--study", default=None, help="study name: its runs are listed in RESULTS_DIR/NAME/run_ids.txt or study.json"
    )
    rep.add_argument("--out", default=None, help="output directory (default RESULTS_DIR/<study or 'all'>/report)")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    from analysis import report

    result = report.report_from_results(args.results_dir, study=args.study, out_dir=args.out)
    print(result.html)
    return 0


if __name__ == "__main__":
    sys.exit(main())
