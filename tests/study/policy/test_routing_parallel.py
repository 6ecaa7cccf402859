"""Routing Replay under tensor parallelism with sequence parallelism (gloo, CPU) against one process with the same
weights (study/policy/parallel.py load_full_state): each TP rank's routers see its half of the sequence, the
controller gathers the recorded routes back to the one-process (B, S, L, k) and hands each rank its half under
replay (study/policy/routing.py). At TP 2 (world 2) and TP 2 x DP 2 (world 4: two TP groups with their own rows, so
a gather or slice over the world instead of the TP group fails): the recorded routes and the free routes under replay
equal one process's exactly; log-probs (free, kept positions, replayed) and router entropies to 2e-6 (measured at
TP 2: 4.8e-7 / 9.5e-7 replayed, entropies 2.4e-7: the TP sums add in another order); every gradient of a replayed
forward, after megatron's reduction, to 5e-6 of the tensor's largest entry (measured 7.7e-7). And a 2-step GRPO +
Routing Replay RL run at parallel {tensor: 2} gives the one-process run's metrics. That run's tiny random cold start
earns no reward, so its advantages, loss and gradient norm are 0 (as in test_parallel.py's EP 2 run): it checks the
rollouts, pi_old's recorded routes, the replayed forwards (approx_kl, routing volatility), expert load and router
entropy at TP; the gradient under replay is checked by the first test. ~10 s + ~20 s + 30-60 s on the shared 2-core
machine.
"""

from __future__ import annotations

import pytest
import torch

from study.core.model_config import PRESETS, ParallelLayout
from tests.shared import free_port, set_rank_env
from tests.study.policy.helpers import CLOSE, RUN_SETS, assert_same_run, one_and_layout

CFG = PRESETS["tiny"]
ROWS, WIDTH, KEEP = 3, 17, 5  # S = 16 splits over 2 ranks; T = 5 kept positions pads to 6 (model.token_logp)


def _inputs() -> dict[str, torch.Tensor]:
    """A fixed batch: ids, targets, right-padded mask, kept positions, and routes to force that free routing would
    not choose (random top-k sets)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (ROWS, WIDTH), generator=g)
    am = torch.ones(ROWS, WIDTH - 1, dtype=torch.long)
    am[2, 9:] = 0
    pos = torch.stack([torch.arange(KEEP) + 3 * r for r in range(ROWS)])
    scores = torch.rand(ROWS, WIDTH - 1, CFG.num_layers, CFG.num_experts, generator=g)
    forced = scores.topk(CFG.moe_top_k, dim=-1).indices.to(torch.uint8)
    return {"ids": tokens[:, :-1], "tgt": tokens[:, 1:], "am": am, "pos": pos, "forced": forced}


def _passes(model, rows: torch.Tensor, trainer=None) -> dict[str, torch.Tensor]:
    """The batch's `rows`: record, then replay `forced`: log-probs (all positions and the kept ones), routes, free
    routes, entropies, and every weight's gradient of a replayed forward (`trainer`: a layout's ShardedTrainer
    reduces them over the ranks: the full batch's gradient)."""
    from study.policy.model import token_logp
    from study.policy.routing import Routes, RoutingController

    x, ctl, out = {k: v[rows] for k, v in _inputs().items()}, RoutingController(model), {}
    with torch.no_grad():
        with ctl.recording():
            out["logp"] = token_logp(model, x["ids"], x["tgt"], attention_mask=x["am"])
        out["routes"], out["entropy"] = ctl.routes().experts, ctl.router_entropy()
        with ctl.recording():
            out["logp_kept"] = token_logp(model, x["ids"], x["tgt"], attention_mask=x["am"], positions=x["pos"])
        out["routes_kept"] = ctl.routes().experts
        with ctl.replaying(Routes(x["forced"])):
            out["logp_replay"] = token_logp(model, x["ids"], x["tgt"], attention_mask=x["am"], positions=x["pos"])
        out["forced_used"], out["free_under_replay"] = ctl.routes().experts, ctl.free_routes().experts
        out["entropy_replay"] = ctl.router_entropy()
    # the gradient of a replayed forward (the routers learn through the forced experts' gates): megatron's reduction
    # over the ranks (sequence-parallel routers and norms summed over TP, every weight over DP) under a layout
    if trainer is not None:
        trainer.zero_grad()
    with ctl.replaying(Routes(x["forced"])):
        logp = token_logp(model, x["ids"], x["tgt"], attention_mask=x["am"], positions=x["pos"])
    (logp * torch.linspace(-1.0, 1.0, ROWS * KEEP).view(ROWS, KEEP)[rows]).sum().backward()
    if trainer is None:
        out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    else:
        from study.policy import parallel as P

        trainer.reduce()
        out["grads"] = dict(P.full_weights(model, grads=True))
    return out


# name -> (world size, layout): TP 2 alone (its group is the world) and TP 2 x DP 2 (two TP groups of two ranks, each
# with its own rows: the gathers and slices must follow the TP group, not the world)
LAYOUTS = {"tp2": (2, ParallelLayout(tensor=2)), "tp2dp2": (4, ParallelLayout(tensor=2, data=2))}


def _worker(rank: int, port: int, name: str, state: dict, out: str) -> None:
    world, layout = LAYOUTS[name]
    set_rank_env(rank, port, world)
    torch.set_num_threads(1)
    from study.policy import parallel as P
    from study.policy.model import build_policy
    from study.policy.routing import Routes, RoutingController

    model = build_policy(CFG, seed=3, parallel=layout)
    assert model.config.sequence_parallel
    P.load_full_state(model, state)
    rows = P.data_rows(ROWS)
    # megatron's replicated optimizer: its gradients are all-reduced (the distributed one's reduce-scattered, each
    # data-parallel rank holding its shard's), so every rank holds the full reduced gradients to compare
    got = _passes(model, rows, P.ShardedTrainer(model, lr=1e-3, distributed_optimizer=False))
    got["rows"] = rows
    x = _inputs()
    try:  # an odd sequence cannot split over the two ranks: refused, naming the field
        RoutingController(model).replay(Routes(x["forced"][:, :15]))
    except ValueError as e:
        got["odd_error"] = str(e)
    torch.save(got, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def one():
    from study.policy.model import build_policy

    model = build_policy(CFG, seed=3)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return state, _passes(model, torch.arange(ROWS))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tp2_routes_record_and_replay_equal_one_process(name, one, tmp_path):
    import torch.multiprocessing as mp

    state, one = one
    world = LAYOUTS[name][0]
    mp.spawn(_worker, args=(free_port(), name, state, str(tmp_path)), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert sorted(int(i) for got in ranks[::2] for i in got["rows"]) == list(range(ROWS))  # TP rank 0 of each group
    x = _inputs()
    assert one["routes"].shape == (ROWS, WIDTH - 1, CFG.num_layers, CFG.moe_top_k)
    assert torch.equal(one["forced_used"].long(), x["forced"].long())
    assert not torch.equal(one["free_under_replay"], x["forced"])  # the forced routes are not free routing's
    # replay changed the function (so the comparisons below can tell a wrong slice from a right one)
    kept_free = one["logp"].gather(1, x["pos"])
    assert torch.allclose(one["logp_kept"], kept_free, atol=1e-6)
    assert float((one["logp_replay"] - kept_free).abs().max()) > 1e-2
    for got in ranks:
        rows = got["rows"]
        for key in ("routes", "routes_kept", "free_under_replay"):
            assert torch.equal(got[key], one[key][rows]), key
        assert torch.equal(got["forced_used"].long(), x["forced"][rows].long())  # every token its own forced experts
        for key in ("logp", "logp_kept", "logp_replay", "entropy", "entropy_replay"):
            diff = float((got[key] - one[key][rows]).abs().max())
            assert diff <= 2e-6, (key, diff)
        assert "parallel.tensor = 2" in got["odd_error"]
    router = [n for n in one["grads"] if n.endswith("router.weight")]
    assert router and all(float(one["grads"][n].abs().max()) > 0 for n in router)  # the routers learn under replay
    for n, want in one["grads"].items():  # the sums over ranks add in another order: 5e-6 of the largest entry
        got = ranks[0]["grads"][n]
        assert got.shape == want.shape and float((got - want).abs().max()) <= 5e-6 * float(want.abs().max()), n


@pytest.mark.slow
def test_rl_run_at_tp2_equals_one_process(tmp_path, easy_coldstart):
    # Two GRPO + Routing Replay steps at TP 2 + SP against the same run at one process: same rollouts (rank 0's
    # engine, fed the gathered weights), same losses, clip fractions, gradient norms and routing metrics to rounding.
    import pandas as pd

    # sync_check_every: after each weight sync every rank runs the trainer's forward (collective), rank 0's engine
    # scores the same sequences
    sets = [*RUN_SETS, f"coldstart={easy_coldstart}", "sync_check_every=1"]
    one, two = one_and_layout(tmp_path, sets, ["parallel.tensor=2"])
    a, b = pd.read_parquet(f"{one}/metrics.parquet"), pd.read_parquet(two / "metrics.parquet")
    assert_same_run(
        a,
        b,
        (
            *CLOSE,
            "expert_load_imbalance",
            "router_entropy",
            "routing_token_changed_frac",
            "ratio_gt2_frac",
            "grad_norm_spike",
            "routing_slot_mismatch_mb2",
            "grad_norm_mb1",
        ),
    )
    assert (a["grad_norm"] > 0).any()  # a real update (which steps: test_rl.py::cpu_kind)
    assert max(b["sync_parity_max_abs"]) < 1e-4 and max(a["sync_parity_max_abs"]) < 1e-4  # fp32 engine and trainer
    la, lb = pd.read_parquet(f"{one}/routing_layers.parquet"), pd.read_parquet(two / "routing_layers.parquet")
    assert lb.drop(columns="step").to_numpy() == pytest.approx(
        la.drop(columns="step").to_numpy(), rel=1e-4, abs=1e-6, nan_ok=True
    )


@pytest.mark.slow
def test_rl_run_at_tp2_ep4_world4_equals_one_process(tmp_path, easy_coldstart):
    # Tensor and expert parallelism together, as the paper's model runs (verl: TP 4 x EP 4; here TP 2 + SP, the dense
    # weights data parallel over 2, the 4 experts one per rank across both tensor-parallel groups: megatron's MoE
    # parallel folding), four processes: two GRPO + Routing Replay steps equal the one-process run's to rounding.
    import pandas as pd

    from study.run.config import load_config

    sets = [*RUN_SETS, f"coldstart={easy_coldstart}", "sync_check_every=1"]
    layout = ["parallel.tensor=2", "parallel.data=2", "parallel.expert=4"]
    one, four = one_and_layout(tmp_path, sets, layout, world=4)
    cfg = load_config(preset="tiny", sets=[*sets, *layout])
    assert cfg.layout.world_size == 4 and cfg.layout.expert_data == 1
    a, b = pd.read_parquet(f"{one}/metrics.parquet"), pd.read_parquet(four / "metrics.parquet")
    assert_same_run(a, b, (*CLOSE, "expert_load_imbalance", "router_entropy"))
    assert (a["grad_norm"] > 0).any()  # a real update (which steps: test_rl.py::cpu_kind)
    assert max(b["sync_parity_max_abs"]) < 1e-4  # the weights rank 0's engine got from 4 shards are the model's
    dist = four / "checkpoint" / "dist-step2"
    assert {p.name.split("_")[2] for p in dist.glob("__*_*.distcp")} == {"0", "1", "2", "3"}  # every rank's shards
