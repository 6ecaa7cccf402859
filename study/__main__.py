"""`python -m study run|resume|coldstart`: one RL run, a resumed run, or the cold-start checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run_p = sub.add_parser("run", help="run one RL configuration (skipped if finished, resumed if interrupted)")
    run_p.add_argument("config", nargs="?", help="YAML file of RunConfig fields")
    run_p.add_argument("--preset", help="start from a preset: tiny (tests, smoke) or default (the embedded study)")
    run_p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field, e.g. --set algorithm=gspo --set hparams.eps_high=5e-3")  # fmt: skip
    run_p.add_argument("--results", default="results", help="results directory (runs go to RESULTS/runs/RUN_ID)")
    run_p.add_argument("--quiet", action="store_true", help="no progress bar")

    resume_p = sub.add_parser("resume", help="continue a killed run from its last checkpoint")
    resume_p.add_argument("run_dir")
    resume_p.add_argument("--quiet", action="store_true")

    sub.add_parser(
        "coldstart", help="make (or reuse) the cold-start checkpoint; see `coldstart --help`", add_help=False
    )

    args, rest = parser.parse_known_args(argv)
    if args.command == "coldstart":
        from study.coldstart import coldstart_main

        return coldstart_main(rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")

    from study import rl
    from study.run import rundir
    from study.run.config import load_config

    if args.command == "run":
        try:
            cfg = load_config(args.config, preset=args.preset, sets=args.sets)
        except (ValueError, FileNotFoundError) as err:  # config errors: before any compute, no traceback
            print(f"error: {err}", file=sys.stderr)
            return 2
        run_dir = rl.run(cfg, args.results, progress=not args.quiet)
    else:
        run_dir = rl.resume(args.run_dir, progress=not args.quiet)
    status = rundir.read_status(Path(run_dir))
    print(f"{status['state']}: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
