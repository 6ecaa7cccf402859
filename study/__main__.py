"""`study run|resume|coldstart|status|export|plan` (or `python -m study ...`): one RL run, a resumed run, the cold-start
checkpoint, the state of a study's runs, a run's policy as a Hugging Face checkpoint, or the memory and layout plan of
a model on a GPU cluster."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

TRACKERS_HELP = (
    "live trackers besides TensorBoard (always on), comma-separated: tensorboard, wandb, mlflow (default: the "
    "STUDY_TRACKERS variable, else tensorboard); not part of the run id"
)


def main(argv: list[str] | None = None) -> int:
    prog = "study" if Path(sys.argv[0]).name == "study" else "python -m study"  # the console script, or -m
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run_p = sub.add_parser("run", help="run one RL configuration (skipped if finished, resumed if interrupted)")
    run_p.add_argument("config", nargs="?", help="YAML file of RunConfig fields")
    run_p.add_argument("--preset", help="start from a preset: tiny (tests, smoke) or default (the embedded study)")
    run_p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set algorithm=gspo --set hparams.eps_high=5e-3",
    )
    run_p.add_argument("--results", default="results", help="results directory (runs go to RESULTS/runs/RUN_ID)")
    run_p.add_argument("--quiet", action="store_true", help="no progress bar")
    run_p.add_argument("--trackers", default=None, metavar="LIST", help=TRACKERS_HELP)
    run_p.add_argument("--study", default="", help="study name the trackers group the run under (default: none)")

    resume_p = sub.add_parser("resume", help="continue a killed run from its last checkpoint")
    resume_p.add_argument("run_dir")
    resume_p.add_argument("--quiet", action="store_true")
    resume_p.add_argument(
        "--trackers",
        default=None,
        metavar="LIST",
        help="as for run; default: the trackers the run recorded (its trackers.json), or STUDY_TRACKERS when set",
    )

    sub.add_parser(
        "coldstart", help="make (or reuse) the cold-start checkpoint; see `coldstart --help`", add_help=False
    )

    sub.add_parser(
        "status",
        help="one line per run: state, progress, reward, eval, time left, why it failed; see `status --help`",
        add_help=False,
    )
    sub.add_parser("export", help="a run's policy as a Hugging Face checkpoint; see `export --help`", add_help=False)
    sub.add_parser("plan", help="memory, step time and GPU-hours per layout; see `plan --help`", add_help=False)

    args, rest = parser.parse_known_args(argv)
    if args.command == "plan":
        from study.tools.plan import plan_main

        return plan_main(rest)
    if args.command == "coldstart":
        from study.coldstart import coldstart_main

        return coldstart_main(rest)
    if args.command == "status":
        from study.run.status import main as status_main

        return status_main(rest)
    if args.command == "export":
        from study.tools.export import main as export_main

        return export_main(rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")

    from study import rl
    from study.run import rundir
    from study.run.config import load_config
    from study.run.trackers import parse_trackers, saved_tracking, study_tracking

    started = time.time()
    run_dir = Path(args.run_dir) if args.command == "resume" else None
    try:
        if args.command == "run":
            cfg = load_config(args.config, preset=args.preset, sets=args.sets)  # config errors: before any compute
            trackers = parse_trackers(args.trackers)
            if args.config:  # a study's resolved config (RESULTS/STUDY/configs/ID.yaml): its study and axis values
                tracking = study_tracking(args.config, trackers, args.study or None)
            else:
                tracking = study_tracking_of(cfg, trackers, args.study)
            run_dir = Path(args.results) / "runs" / cfg.run_id
            rl.run(cfg, args.results, progress=not args.quiet, tracking=tracking)
        else:
            trackers = parse_trackers(args.trackers) if args.trackers else None
            tracking = saved_tracking(args.run_dir, trackers) if trackers else None
            rl.resume(args.run_dir, progress=not args.quiet, tracking=tracking)
    except (ValueError, OSError, rundir.RunLocked) as err:  # bad input or damaged state (RunStateError): one line
        print(f"error: {clip(str(err))}", file=sys.stderr)
        failure = None if run_dir is None else run_dir / rundir.FAILURE_FILE
        if failure is not None and failure.is_file() and failure.stat().st_mtime >= started:
            print(f"(the run failed; its traceback is in {failure})", file=sys.stderr)
        return 2
    except (rundir.Stopped, KeyboardInterrupt) as err:  # recorded `stopped` by the run: one line, no traceback
        why = str(err) or type(err).__name__
        where = f"{run_dir}; resume with `python -m study resume {run_dir}`" if run_dir is not None else "the run"
        print(f"stopped ({why}): {where}", file=sys.stderr)
        return 128 + err.signum if isinstance(err, rundir.Terminated) else 130
    status = rundir.read_status(Path(run_dir))
    print(f"{status['state']}: {run_dir}")
    return 0


MAX_ERROR_CHARS = 2000
"""An error line longer than this (a huge value quoted in it) is printed with its middle left out."""


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text`, or its start and end with the middle replaced by a note of how much was left out."""
    if len(text) <= limit:
        return text
    head, tail = text[: limit * 3 // 4], text[-limit // 4 :]
    return f"{head} ... ({len(text) - len(head) - len(tail)} characters left out) ... {tail}"


def study_tracking_of(cfg, trackers, study):  # type: ignore[no-untyped-def]
    """Tracking of a run given by preset and --set: its study (if named) and its algorithm and seed as tags."""
    from study.run.trackers import Tracking, axis_values

    return Tracking(trackers, study or "", axis_values(cfg.to_dict(), []))


def cli() -> int:
    """The `study` command (pyproject.toml's console script) and `python -m study`: `main` in a process with the malloc
    tunables of study/core/hugepages.py (re-executed once; STUDY_HUGEPAGES=0: not)."""
    from study.core.hugepages import reexec

    reexec()
    return main()


if __name__ == "__main__":
    sys.exit(cli())
