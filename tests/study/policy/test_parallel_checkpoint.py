"""Checkpoints across layouts (gloo, CPU, world size 2): megatron's distributed checkpointing saves the policy and
megatron's optimizer at one layout and loads them at another (megatron reshards), and the one-process form of the
Adam states (what a one-process run's torch AdamW holds, what state.pt keeps) goes in and out of a sharded
optimizer. In one spawn of two processes (~25 s, most of it importing megatron):
- DP 2 (the distributed optimizer: Adam states sharded over the two ranks) after one update, saved with
  dist_checkpointing, loaded at EP 2: the weights and every Adam state equal the saved ones exactly, and a second
  update from there equals the second update at DP 2 (to 1e-2 x lr, the sums over ranks adding in another order);
- one process's weights and torch AdamW states after its update, sliced into EP 2's shards, saved with
  dist_checkpointing at EP 2 and loaded at DP 2 and at TP 2 (sequence parallel; the fused QKV and gate/up weights
  split over the ranks): equal to one process's exactly.
The Adam states after one update at DP 2 equal one process's to rounding (1e-5 of each tensor's largest entry).
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from study.core.model_config import ParallelLayout
from tests.shared import free_port, set_rank_env
from tests.study.policy.helpers import CFG, ROWS, RUN_SETS, forward, gspo_loss

LR = 1e-3
DP2, EP2, TP2 = ParallelLayout(data=2), ParallelLayout(expert=2, data=2), ParallelLayout(tensor=2)


def _one_process() -> dict:
    """One process: the start weights, one GSPO update (torch fused AdamW, clip 0.5) and its Adam states by name."""
    from study.policy import parallel as P
    from study.policy.model import build_policy
    from study.policy.optim import build_optimizer

    model = build_policy(CFG, seed=3, routing_replay=False)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, lr=LR)
    loss, _ = gspo_loss(forward(model, torch.arange(ROWS)))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
    adam = P.adam_state_by_name(opt.state_dict(), names)
    return {"start": start, "stepped": stepped, "adam": adam, "optimizer": opt.state_dict(), "names": names}


def _update(model, trainer) -> None:
    from study.policy import parallel as P

    trainer.zero_grad()
    loss, _ = gspo_loss(P.gather_rows(forward(model, P.data_rows(ROWS)), ROWS))
    loss.backward()
    assert trainer.step()[0]


def _worker(rank: int, port: int, ref: dict, tmp: str) -> None:
    set_rank_env(rank, port)
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from study.policy import parallel as P
    from study.policy.model import build_policy

    def policy(layout, seed=3):
        model = build_policy(CFG, seed=seed, routing_replay=False, parallel=layout)
        return model, P.ShardedTrainer(model, lr=LR, grad_clip=0.5)

    def snapshot(model, trainer):
        weights = {k: v.clone() for k, v in P.full_weights(model)}  # views of the weights at DP: copied
        return {"weights": weights, "adam": trainer.full_optimizer_state()}

    out = {}

    def second_update(model, trainer, name):
        """The second update at this layout, its weights kept as `name`; then the layout's groups torn down."""
        _update(model, trainer)
        out[name] = P.full_state_dict(model)
        parallel_state.destroy_model_parallel()

    # DP 2: one update from the reference start, saved; then a second update
    model, trainer = policy(DP2)
    P.load_full_state(model, ref["start"])
    _update(model, trainer)
    P.save_distributed(trainer, f"{tmp}/dp2")
    out["dp2"] = snapshot(model, trainer)
    second_update(model, trainer, "dp2_next")
    # EP 2 (other initial weights): DP 2's checkpoint, then the same second update
    model, trainer = policy(EP2, seed=5)
    P.load_distributed(trainer, f"{tmp}/dp2")
    out["dp2->ep2"] = snapshot(model, trainer)
    second_update(model, trainer, "ep2_next")
    # EP 2 from one process's weights and Adam states, saved; loaded at DP 2
    model, trainer = policy(EP2, seed=5)
    P.load_full_state(model, ref["stepped"])
    trainer.load_full_optimizer_state(ref["adam"])
    out["1->ep2"] = snapshot(model, trainer)
    P.save_distributed(trainer, f"{tmp}/ep2")
    parallel_state.destroy_model_parallel()
    for name, layout in (("dp2", DP2), ("tp2", TP2)):
        model, trainer = policy(layout, seed=5)
        P.load_distributed(trainer, f"{tmp}/ep2")
        out[f"1->ep2->{name}"] = snapshot(model, trainer)
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(out, f"{tmp}/out.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def reference():
    return _one_process()


@pytest.fixture(scope="module")
def two_ranks(reference, tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("checkpoints")
    mp.spawn(_worker, args=(free_port(), reference, str(tmp)), nprocs=2)
    return torch.load(tmp / "out.pt", weights_only=False)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _adam_equal(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(_equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.slow
def test_dp2_checkpoint_loads_at_ep2(two_ranks):
    saved, loaded = two_ranks["dp2"], two_ranks["dp2->ep2"]
    assert saved["adam"]["step"] == 1 and _equal(loaded["weights"], saved["weights"])
    assert _adam_equal(loaded["adam"], saved["adam"])
    # the next update from the loaded state: as at DP 2
    moved = max(float((two_ranks["ep2_next"][n] - w).abs().max()) for n, w in two_ranks["dp2_next"].items())
    assert moved <= 1e-2 * LR


@pytest.mark.slow
def test_one_process_states_to_ep2_and_back_through_a_checkpoint(reference, two_ranks):
    for run in ("1->ep2", "1->ep2->dp2", "1->ep2->tp2"):
        got = two_ranks[run]
        assert _equal(got["weights"], reference["stepped"]), run
        assert _adam_equal(got["adam"], reference["adam"]), run


@pytest.mark.slow
def test_dp2_adam_states_equal_one_process(reference, two_ranks):
    got = two_ranks["dp2"]["adam"]
    for key in ("exp_avg", "exp_avg_sq"):
        for name, want in reference["adam"][key].items():
            scale = float(want.abs().max().clamp_min(1e-30))
            assert float((got[key][name] - want).abs().max()) <= 1e-5 * scale, (key, name)


def test_hostile_checkpoint_metadata_is_refused_unrun(tmp_path):
    # a distributed checkpoint's .metadata is a pickle torch reads with pickle.load: checked first, constructing
    # nothing but DCP's metadata classes
    import pickle

    from study.policy import parallel as P

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match=r"\.metadata: not a distributed checkpoint's metadata .*system"):
        P.check_checkpoint_metadata(tmp_path / "ckpt")
    assert not (tmp_path / "ran").exists()
    with pytest.raises(ValueError, match="FileNotFoundError"):
        P.check_checkpoint_metadata(tmp_path)


def test_one_process_adam_state_round_trip(reference):
    # the one-process form <-> a torch AdamW state dict as build_optimizer's: loads into the one-process optimizer
    from study.policy import parallel as P
    from study.policy.model import build_policy
    from study.policy.optim import build_optimizer

    hparams = {"lr": LR, "weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8}
    state = P.one_process_adam_state(reference["adam"], reference["stepped"], hparams)
    model = build_policy(CFG, seed=3, routing_replay=False)
    opt = build_optimizer(model, lr=LR)
    opt.load_state_dict(state)  # the format, groups and shapes of a one-process run's
    assert _adam_equal(P.adam_state_by_name(opt.state_dict(), reference["names"]), reference["adam"])
    assert state["param_groups"] == reference["optimizer"]["param_groups"]
    with pytest.raises(ValueError, match="covers 2 weights, the model has"):
        P.adam_state_by_name(
            {**state, "param_groups": [{**state["param_groups"][0], "params": [0, 1]}]}, reference["names"]
        )


# ---------------------------------------------------------------------------------------------------------------------
# The RL loop resumed under another layout
# ---------------------------------------------------------------------------------------------------------------------
STOP_AFTER_FIRST_CHECKPOINT = """
from study import checkpoint
from study.run import rundir

_save = checkpoint.save


def stop_after(run_dir, parts, log):  # a run killed right after its step-1 checkpoint (every rank alike)
    _save(run_dir, parts, log)
    if log.step == 1:
        raise rundir.Stopped("stopped after the step-1 checkpoint (test)")


checkpoint.save = stop_after
"""


def _one_process_run(results, sets: list[str], *, stop: bool) -> None:
    import subprocess
    import sys

    script = (STOP_AFTER_FIRST_CHECKPOINT if stop else "") + (
        "import sys\nfrom study import rl\nfrom study.run.config import load_config\n"
        "try:\n    rl.run(load_config(preset='tiny', sets=sys.argv[2:]), sys.argv[1], progress=False)\n"
        "except rl.rundir.Stopped:\n    pass\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(results), *sets], check=True, timeout=600, capture_output=True, text=True
    )


def _rl_worker(rank: int, port: int, sets: list[str], results: str, stop: bool) -> None:
    set_rank_env(rank, port)
    if stop:
        exec(STOP_AFTER_FIRST_CHECKPOINT, {})
    from study import rl
    from study.run import rundir
    from study.run.config import load_config

    with contextlib.suppress(rundir.Stopped):
        rl.run(load_config(preset="tiny", sets=sets), results, progress=False)
    torch.distributed.destroy_process_group()


def _two_rank_run(results, sets: list[str], *, stop: bool) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rl_worker, args=(free_port(), sets, str(results), stop), nprocs=2)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, easy_coldstart):  # type: ignore[no-untyped-def]
    """The uninterrupted one-process run of RUN_SETS from the easy cold start, which both resume tests compare with
    (its results dir)."""
    results = tmp_path_factory.mktemp("reference")
    _one_process_run(results, [*RUN_SETS, f"coldstart={easy_coldstart}"], stop=False)
    return results


@pytest.mark.slow
@pytest.mark.xdist_group("reference-run")  # one worker computes reference_run for both
def test_rl_resume_across_layouts(tmp_path, easy_coldstart, reference_run):
    # Two GRPO + Routing Replay steps, checkpointed after each: stopped after step 1 at one layout and resumed at
    # another, step 2 equals the uninterrupted one-process run's (as a whole run at EP 2 does,
    # tests/study/policy/test_parallel.py): one process -> EP 2 (the one-process weights and Adam states sliced into the
    # shards) and DP 2 -> one process (state.pt's one-process form of megatron's distributed checkpoint).
    import json

    import pandas as pd

    from study.run import rundir
    from study.run.config import load_config

    sets = [*RUN_SETS, f"coldstart={easy_coldstart}"]
    ep2, dp2 = ["parallel.expert=2", "parallel.data=2"], ["parallel.data=2"]
    run_id = load_config(preset="tiny", sets=sets).run_id
    want = pd.read_parquet(reference_run / "runs" / run_id / "metrics.parquet")
    # a real update in the run, so the resumed step compares restored weights that moved (which steps have signal, every
    # group's rewards equal or not, depends on the CPU kind's float sums: tests/study/test_rl.py::cpu_kind)
    assert (want["grad_norm"] > 0).any()

    _one_process_run(tmp_path / "one_to_ep2", sets, stop=True)
    _two_rank_run(tmp_path / "dp2_to_one", [*sets, *dp2], stop=True)
    run = tmp_path / "dp2_to_one" / "runs" / run_id
    assert rundir.read_status(run)["state"] == "stopped"
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["dist-step1", "state.pt"]

    _two_rank_run(tmp_path / "one_to_ep2", [*sets, *ep2], stop=False)
    _one_process_run(tmp_path / "dp2_to_one", sets, stop=False)
    for name, resumed in (("one_to_ep2", ep2), ("dp2_to_one", [])):
        run = tmp_path / name / "runs" / run_id
        assert rundir.read_status(run)["state"] == "completed", name
        got = pd.read_parquet(run / "metrics.parquet")
        assert list(got["step"]) == [1, 2]
        for column in ("reward_mean", "response_len_mean", "clip_frac", "tokens_total"):
            assert list(got[column]) == list(want[column]), (name, column)
        for column in ("loss", "grad_norm", "approx_kl", "mismatch_mean_abs", "routing_slot_mismatch"):
            assert list(got[column]) == pytest.approx(list(want[column]), rel=1e-4, abs=1e-6), (name, column)
        manifest = json.loads((run / "manifest.json").read_text())
        layout = load_config(preset="tiny", sets=[*sets, *resumed]).layout.to_dict()
        assert manifest["parallel_resumed"] == [{"step": 1, "parallel": layout}], name


@pytest.mark.slow
@pytest.mark.xdist_group("reference-run")  # one worker computes reference_run for both
def test_a_model_too_large_for_the_one_process_form_resumes_from_its_distributed_checkpoint(
    tmp_path, monkeypatch, easy_coldstart, reference_run
):
    # STUDY_FULL_STATE_MAX_GB = 0: as for a model whose full weights and Adam states would not fit rank 0 (30B: ~366
    # GB), the DP 2 run's state.pt names its distributed checkpoint and holds no one-process form; resumed at DP 2 it
    # equals the uninterrupted one-process run; a one-process resume refuses it, naming why; `study export` reads the
    # weights from the distributed checkpoint, resharded to one process: the one-process run's to rounding.
    import shutil
    import subprocess
    import sys

    import pandas as pd

    from study import checkpoint
    from study.run import rundir
    from study.run.config import load_config
    from study.tools import export

    monkeypatch.setenv("STUDY_FULL_STATE_MAX_GB", "0")  # inherited by the spawned ranks
    sets = [*RUN_SETS, f"coldstart={easy_coldstart}"]
    run_id = load_config(preset="tiny", sets=sets).run_id
    want = pd.read_parquet(reference_run / "runs" / run_id / "metrics.parquet")

    _two_rank_run(tmp_path / "dp2", [*sets, "parallel.data=2"], stop=True)
    run = tmp_path / "dp2" / "runs" / run_id
    state = checkpoint.load(run / "checkpoint" / "state.pt")
    assert state["model"] is None and state["optimizer"] is None and state["distributed"] == "dist-step1"
    shutil.copytree(tmp_path / "dp2", tmp_path / "dp2_to_one", symlinks=True)

    script = (
        "import sys\nfrom study import rl\nfrom study.run.config import load_config\n"
        "rl.run(load_config(preset='tiny', sets=sys.argv[2:]), sys.argv[1], progress=False)\n"
    )
    one = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "dp2_to_one"), *sets], timeout=600, capture_output=True, text=True
    )
    assert one.returncode != 0 and "only in megatron's distributed checkpoint 'dist-step1'" in one.stderr, one.stderr
    assert "resume it at a parallel layout" in one.stderr

    _two_rank_run(tmp_path / "dp2", [*sets, "parallel.data=2"], stop=False)
    assert rundir.read_status(run)["state"] == "completed"
    got = pd.read_parquet(run / "metrics.parquet")
    for column in ("reward_mean", "response_len_mean", "clip_frac", "tokens_total"):
        assert list(got[column]) == list(want[column]), column
    for column in ("loss", "grad_norm", "approx_kl", "mismatch_mean_abs", "routing_slot_mismatch"):
        assert list(got[column]) == pytest.approx(list(want[column]), rel=1e-4, abs=1e-6), column
    assert checkpoint.load(run / "checkpoint" / "state.pt")["model"] is None
    reference = checkpoint.load(reference_run / "runs" / run_id / "checkpoint" / "state.pt")["model"]
    weights, step = export.policy_state(load_config(preset="tiny", sets=sets), run, tmp_path / "dp2", None)
    tensors = {name for name, value in reference.items() if isinstance(value, torch.Tensor)}  # (and extra states)
    assert step == 2 and set(reference) == set(weights) and len(tensors) > 10
    for name in tensors:  # two steps of DP 2 vs one process: the gradient sums in another order
        want = reference[name]
        assert weights[name].shape == want.shape and weights[name].dtype == want.dtype, name
        assert float((weights[name] - want).abs().max()) <= 1e-5 * max(float(want.abs().max()), 1.0), name
    out = export.export(run, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and json.loads((out / "moe_rl_study.json").read_text())["step"] == 2
