"""The policy across two ranks (gloo, CPU) against one process on the same global batch: expert parallelism (EP 2,
its dense weights data parallel over the same two ranks), tensor parallelism with sequence parallelism (TP 2), and
data parallelism (DP 2). Per layout, in one two-process run: the per-token log-probs, every gradient after
megatron's reduction, one GSPO update (loss, clip fraction, global grad norm, updated weights) and the full-weight
export (names, shapes, values) equal the one-process model's.

The update at a layout is megatron's optimizer (study/policy/compat.py point 6 runs it on the CPU), with its
distributed optimizer (Adam states sharded over the data-parallel ranks) and with its replicated one; the
reference is one process's torch fused AdamW + clip_grad_norm_. On the CPU megatron's inner Adam is torch's AdamW
(single-tensor path, no TransformerEngine or apex here), the same arithmetic as the fused kernel up to the order of
its operations. And bf16 weights at DP 2: megatron's fp32 main parameters against one process's AdamW on fp32 copies
of the bf16 weights.

Tolerance: log-probs and losses to 2e-6 absolute, gradients to 5e-6 of the tensor's largest entry, updated weights
to 1e-2 x lr (measured: log-probs bit for bit at EP 2 and DP 2, 5e-7 at TP 2; gradients <= 1e-6 relative: the sums
over ranks and over sequence shards add in another order; grad norm within 3e-7 relative; Adam's first step,
lr x g / (|g| + eps), turns the gradients' rounding into 1.2e-4 lr (EP 2, DP 2) and 3.6e-3 lr (TP 2) on tiny
entries, the same with the distributed and the replicated optimizer). bf16: every weight within one bf16 rounding
step plus 2 lr (an update's sign on a gradient near eps), at most 1% differing at all (measured: bit-identical).
The export equals the one-process weights exactly. The six runs and the bf16 one share one spawn of two processes
(~25 s on a shared CPU, most of it importing megatron).
"""

from __future__ import annotations

import pytest
import torch

from study.core.model_config import ParallelLayout
from tests.shared import free_port, set_rank_env
from tests.study.policy.helpers import (
    CFG,
    CLOSE,
    ROWS,
    RUN_SETS,
    assert_same_run,
    forward,
    gspo_loss,
    one_and_layout,
    update_at_layout,
    update_record,
)


def _one_process() -> dict:
    """The one-process reference: weights, log-probs, gradients of the GSPO loss, grad norm and the AdamW + clip
    step's new weights."""
    from study.policy.model import build_policy
    from study.policy.optim import build_optimizer

    model = build_policy(CFG, seed=3, routing_replay=False)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    logp = forward(model, torch.arange(ROWS))
    loss, metrics = gspo_loss(logp)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, lr=1e-3)
    norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5))
    opt.step()
    stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
    return update_record(logp, loss, metrics, grads, state=state, norm=norm, stepped=stepped)


LAYOUTS = {"ep2": ParallelLayout(expert=2, data=2), "tp2sp": ParallelLayout(tensor=2), "dp2": ParallelLayout(data=2)}
# name -> (layout, megatron's distributed optimizer): each layout with the distributed optimizer (the default: Adam
# states sharded over the data-parallel ranks) and with megatron's replicated one, whose gradients are all-reduced
# (the distributed optimizer's are reduce-scattered: each data-parallel rank holds its shard's, so the gradients
# are compared in the replicated runs)
RUNS = {
    **{name: (layout, True) for name, layout in LAYOUTS.items()},
    **{f"{name}-replicated": (layout, False) for name, layout in LAYOUTS.items()},
}


def _adam_numel(trainer) -> int:
    """How many weights this rank's Adam states cover (exp_avg entries over megatron's chained optimizers)."""
    return sum(s["exp_avg"].numel() for o in trainer.optimizer.chained_optimizers for s in o.optimizer.state.values())


def _worker(rank: int, port: int, ref: dict, out: str) -> None:
    """Every run of RUNS in turn in the same two processes (megatron's parallel state rebuilt for each: the imports,
    not the checks, are most of a spawn's time), then the bf16 run; rank 0 saves each run's results."""
    set_rank_env(rank, port)
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from study.core.weights import megatron_to_hf
    from study.policy import parallel as P
    from study.policy.model import build_policy

    results = {}
    for name, (layout, distributed) in RUNS.items():
        model = build_policy(CFG, seed=3, routing_replay=False, parallel=layout)
        P.load_full_state(model, ref["state"])
        export = {k: v.clone() for k, v in P.full_hf_weights(model)}  # views of the weights: copied
        trainer = P.ShardedTrainer(model, lr=1e-3, grad_clip=0.5, distributed_optimizer=distributed)
        update = update_at_layout(model, trainer)
        adam = torch.tensor(_adam_numel(trainer))
        torch.distributed.all_reduce(adam)
        results[name] = {
            **update,
            "stepped": P.full_state_dict(model),
            "export_same": _same(export, megatron_to_hf(ref["state"], CFG)),
            "optimizers": [type(o).__name__ for o in trainer.optimizer.chained_optimizers],
            "adam_numel": (_adam_numel(trainer), int(adam)),
        }
        parallel_state.destroy_model_parallel()
    # bf16 weights, fp32 main parameters in megatron's distributed optimizer (DP 2): one update
    model = build_policy(CFG, seed=3, routing_replay=False, dtype="bf16", parallel=LAYOUTS["dp2"])
    P.load_full_state(model, {k: v.bfloat16() for k, v in ref["state"].items()})
    trainer = P.ShardedTrainer(model, lr=1e-3, grad_clip=0.5)
    trainer.zero_grad()
    loss, _ = gspo_loss(P.gather_rows(forward(model, P.data_rows(ROWS)).float(), ROWS))
    loss.backward()
    stepped, norm = trainer.step()
    mains = [p for o in trainer.optimizer.chained_optimizers for g in o.optimizer.param_groups for p in g["params"]]
    results["bf16"] = {
        "took_step": stepped,
        "norm": norm,
        "stepped": P.full_state_dict(model),
        "main_dtypes": {str(p.dtype) for p in mains},
    }
    parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference():
    return _one_process()


@pytest.fixture(scope="module")
def reference_bf16(reference):
    """One process, the reference weights in bf16: fp32 copies of them stepped by torch's AdamW on the bf16
    gradients (clipped by their global norm), rounded back to bf16: what fp32 main parameters compute."""
    from study.policy.model import build_policy
    from study.policy.optim import build_optimizer

    model = build_policy(CFG, seed=3, routing_replay=False, dtype="bf16")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(reference["state"][n])
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, _ = gspo_loss(forward(model, torch.arange(ROWS)).float())
    loss.backward()
    mains = {n: torch.nn.Parameter(p.detach().float()) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        mains[n].grad = p.grad.float()
    norm = float(torch.nn.utils.clip_grad_norm_(list(mains.values()), 0.5))
    holder = torch.nn.Module()
    holder.params = torch.nn.ParameterList(mains.values())
    build_optimizer(holder, lr=1e-3).step()
    return {"start": start, "norm": norm, "stepped": {n: p.detach().bfloat16() for n, p in mains.items()}}


@pytest.fixture(scope="module")
def two_ranks(reference, tmp_path_factory):
    """Each layout's results at world size 2 (one spawn of two processes for all of them)."""
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("two_ranks") / "rank0.pt")
    mp.spawn(_worker, args=(free_port(), reference, out), nprocs=2)
    return torch.load(out, weights_only=False)


def _close(got: dict, want: dict, rel: float) -> list[str]:
    bad = []
    for name, w in want.items():
        scale = float(w.abs().max().clamp_min(1e-12))
        if got[name].shape != w.shape or float((got[name] - w).abs().max()) > rel * scale:
            bad.append(name)
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_two_ranks_equal_one_process(run, reference, two_ranks):
    got = two_ranks[run]
    assert torch.allclose(got["logp"], reference["logp"][got["rows"]], atol=2e-6, rtol=0)
    assert abs(got["loss"] - reference["loss"]) <= 2e-6
    assert got["metrics"]["clip_frac"] == reference["metrics"]["clip_frac"] and 0 < got["metrics"]["clip_frac"] < 1
    _, distributed = RUNS[run]
    if not distributed:  # every gradient whole on every rank
        assert _close(got["grads"], reference["grads"], 5e-6) == []
    assert got["took_step"] and abs(got["norm"] - reference["norm"]) <= 1e-6 * reference["norm"]
    assert reference["norm"] > 0.5  # the clip acted
    # megatron's optimizer, dense and expert weights chained; its inner Adam is torch's AdamW (single-tensor on the
    # CPU), the reference torch's fused AdamW: the same update up to rounding. Adam's first step is
    # lr x g / (|g| + eps): a gradient's rounding moves its tiny entries' updates most
    kind = "DistributedOptimizer" if distributed else "FP32Optimizer"
    assert got["optimizers"] == [kind, kind]
    moved = max(float((got["stepped"][n] - w).abs().max()) for n, w in reference["stepped"].items())
    assert moved <= 1e-2 * 1e-3  # lr = 1e-3; measured (megatron's optimizer) in the module doc
    assert got["export_same"]
    mine, total = got["adam_numel"]
    weights = sum(w.numel() for w in reference["state"].values())
    if run == "dp2":  # ZeRO-1: each rank holds the Adam states of its share of the weights
        assert total == weights and mine < weights
    elif run == "dp2-replicated":
        assert mine == weights and total == 2 * weights


@pytest.mark.slow
def test_bf16_fp32_main_params_distributed(reference_bf16, two_ranks):
    # bf16 weights at DP 2: megatron's distributed optimizer keeps fp32 main parameters (its shards), steps them and
    # writes them back rounded to bf16. Against one process's fp32-main-parameter AdamW on its bf16 gradients.
    got = two_ranks["bf16"]
    assert got["took_step"] and got["main_dtypes"] == {"torch.float32"}
    assert got["norm"] == pytest.approx(reference_bf16["norm"], rel=1e-2)  # bf16 gradients, rows in other batches
    changed = differ = 0
    for name, want in reference_bf16["stepped"].items():
        have = got["stepped"][name]
        assert have.dtype == torch.bfloat16
        # one bf16 rounding step of the new weight (2^-8 relative), plus the update's own spread (2 lr)
        tol = want.float().abs() * 2**-8 + 2 * 1e-3
        assert bool(((have.float() - want.float()).abs() <= tol).all()), name
        differ += int((have != want).sum())
        changed += int((have != reference_bf16["start"][name]).sum())
    n = sum(w.numel() for w in reference_bf16["stepped"].values())
    assert changed > 0.5 * n  # the weights moved
    assert differ <= 0.01 * n  # measured: none (bit-identical)


def test_layout_validation():
    with pytest.raises(ValueError, match=r"parallel.pipeline = 2: pipeline parallelism is not supported"):
        ParallelLayout.from_mapping({"pipeline": 2})
    with pytest.raises(ValueError, match=r"parallel.context"):
        ParallelLayout(context=2)
    with pytest.raises(ValueError, match="unknown field"):
        ParallelLayout.from_mapping({"tensors": 2})
    with pytest.raises(ValueError, match="must divide the world size"):
        ParallelLayout(expert=2)
    with pytest.raises(ValueError, match=r"num_experts = 4 is not divisible by parallel.expert = 8"):
        ParallelLayout(expert=8, data=8).check_model(CFG)
    with pytest.raises(ValueError, match=r"num_attention_heads = 2 is not divisible by parallel.tensor = 4"):
        ParallelLayout(tensor=4).check_model(CFG)
    assert ParallelLayout(expert=2, data=2).expert_data == 1 and ParallelLayout(tensor=2).world_size == 2


# ---------------------------------------------------------------------------------------------------------------------
# The RL loop across two ranks
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_rl_run_at_ep2_equals_one_process(tmp_path, easy_coldstart):
    # Two GRPO + Routing Replay steps at EP 2 (dense weights data parallel over the same two ranks) against the same
    # run at one process: the same rollouts (one engine, rank 0's, fed the gathered weights), and the same losses,
    # clip fractions, gradient norms and routing metrics to rounding. Rank 0 alone writes the run directory, and
    # its checkpoint holds the one-process names and shapes.
    import pandas as pd

    from study.run.config import load_config

    sets = [*RUN_SETS, f"coldstart={easy_coldstart}"]
    layout = ["parallel.expert=2", "parallel.data=2"]
    one, two = one_and_layout(tmp_path, sets, layout)
    cfg = load_config(preset="tiny", sets=[*sets, *layout])
    assert str(one).endswith(cfg.run_id)  # the layout is not in the run id
    a, b = pd.read_parquet(f"{one}/metrics.parquet"), pd.read_parquet(two / "metrics.parquet")
    assert_same_run(a, b, CLOSE)
    assert (a["grad_norm"] > 0).any() and (
        a["reward_mean"] > 0
    ).any()  # a real update (which steps: test_rl.py::cpu_kind)
    assert sorted(p.name for p in (two / "checkpoint").iterdir()) == ["dist-step2", "state.pt"]
    state = torch.load(two / "checkpoint" / "state.pt", weights_only=False)["model"]
    start = torch.load(f"{easy_coldstart}/policy.pt", weights_only=True)
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in start.items()}
    import json

    assert json.loads((two / "manifest.json").read_text())["parallel"]["expert"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_megatron_optimizer_on_cuda():
    # On CUDA the shards step through megatron's distributed optimizer (fp32 main parameters for bf16): one process,
    # one update of the bf16 policy; its global grad norm is torch's over the same gradients and the weights move.
    from study.policy import parallel as P
    from study.policy.model import build_policy

    model = build_policy(CFG, seed=3, routing_replay=False, dtype="bf16", parallel=ParallelLayout())
    trainer = P.ShardedTrainer(model, lr=1e-3, grad_clip=1.0)
    assert {type(o).__name__ for o in trainer.optimizer.chained_optimizers} == {"DistributedOptimizer"}
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    trainer.zero_grad()
    loss, _ = gspo_loss(forward(model, torch.arange(ROWS)).float().cpu())
    loss.backward()
    trainer.reduce()
    want = float(torch.linalg.vector_norm(torch.stack([p.main_grad.float().norm() for p in model.parameters()])))
    trainer.reduce = lambda: None
    stepped, norm = trainer.step()
    assert stepped and norm == pytest.approx(want, rel=1e-3)
    assert all(not torch.equal(p.detach().float(), before[n]) for n, p in model.named_parameters())
