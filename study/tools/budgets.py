"""The cold start's pass@1 at each generation budget: does a longer `max_new_tokens` help before any RL?

    python -m study.tools.budgets COLDSTART_DIR --task chain_sum --knobs '{"terms": [2, 6], "digits": 1}' \
        --budgets 16 32 48 --out results/length_laptop/coldstart_budgets.csv

One row per budget: mean pass@1 of the cold-start policy on the task's in_dist held-out set (the set a run with these
knobs evaluates on), k samples per problem at temperature 1 from the hf engine, every response scored as it stands
(a response cut at the budget before its `####` line scores 0); the share of samples cut at the budget; and the share
of the held-out problems whose reference worked solution fits in the budget (an upper bound of what a policy that
writes the full scratchpad can solve). The sampling seed is the same at every budget, so the rows differ by the
budget, not by the draw. The length study's report shows this table (analysis reads the CSV; the Snakemake rule
`coldstart_budgets` writes it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from runfiles.bounded import load_json, read_json
from study.run.rundir import json_problem

COLUMNS = (
    "coldstart",
    "task",
    "knobs",
    "max_new_tokens",
    "pass_at_1",
    "truncated",
    "reference_fits",
    "problems",
    "samples",
    "eval_s",
)


def budget_table(
    coldstart_dir: str | Path,
    task: str,
    knobs: dict[str, Any],
    budgets: Sequence[int],
    *,
    eval_size: int = 128,
    eval_samples: int = 4,
    seed: int = 0,
    threads: int = 1,
) -> pd.DataFrame:
    """pass@1 of the cold start in `coldstart_dir` at each of `budgets` (rows in budget order; see the module doc)."""
    from study.coldstart.sft import eval_pass_at_1, load_policy, read_policy_file
    from study.core.model_config import model_spec, resolve_model
    from study.data import tasks
    from study.data.tokenizer import TaskTokenizer
    from study.policy.model import build_policy
    from study.rollout import get_engine

    directory = Path(coldstart_dir)
    record_path = directory / "coldstart.json"
    if not record_path.is_file():
        raise FileNotFoundError(f"{directory}: no coldstart.json (not a finished cold start)")
    budgets = sorted({int(b) for b in budgets})
    if not budgets or budgets[0] < 1:
        raise ValueError(f"budgets = {budgets}: need at least one budget, each >= 1")
    record = read_json(record_path)
    cfg = resolve_model(model_spec(record["settings"]["model"]))
    tasks.resolve_knobs(task, **knobs)  # errors name the knob
    items = tasks.eval_set(task, "in_dist", size=eval_size, knobs=knobs)
    tok = TaskTokenizer.load(directory)
    longest = max(len(tok.encode_prompt(i.prompt)) for i in items) + budgets[-1]
    if longest > cfg.max_seq_len:
        raise ValueError(f"budgets: prompt + {budgets[-1]} tokens = {longest} > model.max_seq_len {cfg.max_seq_len}")
    ref_len = [len(tok.encode_response(i.solution)) for i in items]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_policy(cfg, seed=0, dtype="fp32")
        load_policy(model, read_policy_file(directory / "policy.pt"), where=str(directory))
        model.eval()
        engine = get_engine("hf", cfg, dtype="fp32")
        rows = []
        for budget in budgets:
            t = time.perf_counter()
            with torch.no_grad():
                score, truncated = eval_pass_at_1(
                    engine, model, tok, items, k=eval_samples, seed=seed, max_new_tokens=budget
                )
            rows.append(
                {
                    "coldstart": directory.name,
                    "task": task,
                    "knobs": json.dumps(knobs, sort_keys=True),
                    "max_new_tokens": budget,
                    "pass_at_1": score,
                    "truncated": truncated,
                    "reference_fits": sum(n <= budget for n in ref_len) / len(ref_len),
                    "problems": len(items),
                    "samples": eval_samples,
                    "eval_s": round(time.perf_counter() - t, 2),
                }
            )
    finally:
        torch.set_num_threads(before)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.tools.budgets", description=__doc__.split("\n\n")[0])
    parser.add_argument("coldstart", nargs="+", help="cold-start directories (each with coldstart.json, policy.pt)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--knobs", default="{}", help="task knobs as JSON (the runs' task_knobs)")
    parser.add_argument("--budgets", type=int, nargs="+", required=True, help="max_new_tokens values")
    parser.add_argument("--eval-size", type=int, default=128)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True, help="CSV to write (atomically)")
    args = parser.parse_args(argv)
    from study.run.rundir import atomic_write

    try:
        knobs = load_json(args.knobs)
    except ValueError as err:
        parser.error(f"--knobs {args.knobs!r}: {json_problem(err)}")
    if not isinstance(knobs, dict):
        parser.error(f"--knobs {args.knobs!r}: must be a JSON mapping")
    sizes = {"eval_size": args.eval_size, "eval_samples": args.eval_samples, "threads": args.threads}
    tables = [budget_table(d, args.task, knobs, args.budgets, **sizes) for d in args.coldstart]
    table = pd.concat(tables, ignore_index=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(Path(args.out), lambda tmp: table.to_csv(tmp, index=False))
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
