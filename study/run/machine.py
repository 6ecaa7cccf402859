"""Does a run fit the machine that is about to run it? Checked before anything is written (study.lifecycle.preflight).

The estimate is the planner's (study.run.plan.cpu_run_estimate: the process and what the run loads, the trainer's
weights, grads and AdamW state, one minibatch's activations, the rollout engine's weights, and the larger of the
rollout's and the weight sync's transients),
plus the position tables both engines may build for `model.max_seq_len` positions (cos and sin, fp32, each). It is
compared with the machine's memory: physical RAM (or the cgroup's limit, when lower) plus the visible GPUs' memory
when the run trains on a GPU. A run over it is refused with the estimate, the machine's memory and the field that
drives the estimate, instead of a run directory and a process that swaps or hangs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GiB = float(1 << 30)

POSITION_TABLE_BYTES = 16
"""Bytes per position and head dimension of the rotary tables (cos + sin, fp32, trainer and engine)."""


def machine_bytes(device: str | None = None) -> tuple[float, str]:
    """(bytes of memory this machine gives a run, how they were counted); `device` None: "cuda" when a GPU is
    visible, else "cpu"."""
    import os

    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    what = f"{ram / GiB:.1f} GiB RAM"
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < ram:
            ram, what = float(text), f"{int(text) / GiB:.1f} GiB (cgroup memory limit)"
        break
    total = ram
    if device is None or device.startswith("cuda"):
        try:
            import torch

            gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
        except Exception:  # no CUDA here: the run's own device check reports it
            gpus = []
        if gpus:
            total += float(sum(gpus))
            what += f" + {sum(gpus) / GiB:.1f} GiB on {len(gpus)} GPU(s)"
    return total, what


def _estimate(cfg: Any, *, prompts: int, group: int, new_tokens: int, minibatches: int) -> dict[str, float]:
    from study.run.plan import Workload, cpu_run_estimate

    prompt_len = min(1024, max(1, cfg.max_seq_len - new_tokens))
    work = Workload(prompts=prompts, group_size=group, prompt_len=prompt_len, response_len=new_tokens, micro_batch=1)
    parts = dict(cpu_run_estimate(cfg, work, minibatches=minibatches))
    parts["positions"] = float(cfg.max_seq_len) * cfg.head_dim * POSITION_TABLE_BYTES
    parts["peak"] += parts["positions"]
    return parts


def _knobs(run: Any) -> dict[str, Any]:
    return {
        "prompts": run.prompts_per_step,
        "group": run.group_size,
        "new_tokens": run.max_new_tokens,
        "minibatches": run.minibatches,
    }


def _with_evaluation(cfg: Any, parts: dict[str, float], evals: dict[str, tuple[int, int]]) -> dict[str, float]:
    """`parts` with `evaluation`: the largest held-out evaluation's rollout (each set's prompts x samples in one
    generate), which lands on top where the step's rollout or sync would; the peak takes the largest of the three."""
    new_tokens = parts["new_tokens"]
    evaluation = max(
        _estimate(cfg, prompts=size, group=samples, new_tokens=new_tokens, minibatches=1)["rollout"]
        for size, samples in evals.values()
    )
    before = max(parts["rollout"], parts["sync"])
    return {**parts, "evaluation": evaluation, "peak": parts["peak"] - before + max(before, evaluation)}


def _run_peak(cfg: Any, knobs: dict[str, Any], evals: dict[str, tuple[int, int]]) -> dict[str, float]:
    parts = {**_estimate(cfg, **knobs), "new_tokens": knobs["new_tokens"]}
    parts = _with_evaluation(cfg, parts, evals) if evals else parts
    parts.pop("new_tokens")
    return parts


EVAL_FIELDS = {"validation": ("eval_size", "eval_samples"), "test": ("eval_test_size", "eval_test_samples")}
"""The (problems, samples per problem) fields of each held-out evaluation a run makes: the validation sets at every
evaluation, the test split at the first and the last (RunConfig.eval_plan)."""


def _evals(run: Any) -> dict[str, tuple[int, int]]:
    """(problems, samples) of each held-out evaluation `run` makes, by EVAL_FIELDS' name; none without eval_every."""
    if not run.eval_every:
        return {}
    evals = {name: (getattr(run, size), getattr(run, samples)) for name, (size, samples) in EVAL_FIELDS.items()}
    return {name: shape for name, shape in evals.items() if shape[0] > 0}


def run_estimate(run: Any) -> dict[str, float]:
    """Bytes of `run` (a RunConfig) at its peak, by part: the planner's CPU-run estimate (prompts up to 1024 tokens,
    as `check_run_fits` assumes) plus `positions`, and with held-out evaluations (`eval_every` > 0) the largest
    evaluation's rollout: eval_size x eval_samples sequences, or the test split's eval_test_size x eval_test_samples
    (`evaluation`)."""
    return _run_peak(run.model_config(), _knobs(run), _evals(run))


_MODEL_FIELDS = ("num_experts", "vocab_size", "max_seq_len", "hidden_size", "moe_ffn_hidden_size", "num_layers")
_RUN_FIELDS = {"prompts_per_step": "prompts", "group_size": "group", "max_new_tokens": "new_tokens"}


def _culprit(run: Any) -> str:
    """The field whose value drives the estimate most: the one that, set to 1, shrinks the peak the most."""
    import dataclasses

    cfg, knobs = run.model_config(), _knobs(run)
    trials: dict[str, float] = {}
    tiny = type(cfg)()  # the smallest shape (the tiny preset's fields)
    for name in _MODEL_FIELDS:
        for value in (1, cfg.moe_top_k, getattr(tiny, name)):
            try:
                small = dataclasses.replace(cfg, **{name: min(value, getattr(cfg, name))})
            except ValueError:  # not a valid shape with the other fields: try a larger value
                continue
            trials[f"model.{name} = {getattr(cfg, name)}"] = _run_peak(small, knobs, _evals(run))["peak"]
            break
    for name, knob in _RUN_FIELDS.items():
        smaller = {**knobs, knob: 1, "minibatches": 1}
        trials[f"{name} = {getattr(run, name)}"] = _run_peak(cfg, smaller, _evals(run))["peak"]
    evals = _evals(run)
    for which, (size, samples) in evals.items():
        for i, name in enumerate(EVAL_FIELDS[which]):
            one = (1, samples) if i == 0 else (size, 1)
            trials[f"{name} = {getattr(run, name)}"] = _run_peak(cfg, knobs, {**evals, which: one})["peak"]
    return min(trials, key=trials.__getitem__)


def check_fits(run: Any, *, device: str | None = None) -> None:
    """ValueError naming the field, the estimate and this machine's memory when `run` cannot fit it."""
    parts = run_estimate(run)
    have, what = machine_bytes(device)
    if parts["peak"] > have:
        raise ValueError(
            f"{_culprit(run)}: the run needs about {parts['peak'] / GiB:,.1f} GiB at its peak (the planner's "
            f"estimate, `python -m study plan`), more than this machine's {what}; valid: a smaller value"
        )
