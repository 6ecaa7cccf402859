"""The routing-volatility dial (RunConfig.router_kick, study/policy/kick.py): Gaussian kicks that minibatch m's forwards
route through (the m - 1 drawn after the updates before it), held in the forward only. The kicked forward is the
forward of the kicked weights, gradient included; the weights, the weight sync and the global RNG never carry a
kick; every algorithm of a seed draws the same kicks, another seed others; at 0 nothing is drawn or wrapped (the
golden runs of tests/study/test_rl.py pin the numbers), and the field is validated and recorded."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from study import rl
from study.core.model_config import PRESETS
from study.policy import kick as kick_module
from study.policy.kick import RouterKick, is_kicked
from study.policy.model import build_policy, token_logp
from study.policy.routing import RoutingController, routing_volatility
from study.run.config import load_config
from tests.shared import SCRATCH_STEP

# DAPO: from scratch weights no response earns a reward, and its overlong penalty still gives the updates a gradient
SETS = [*SCRATCH_STEP, "minibatches=4", "algorithm=dapo", "max_new_tokens=24"]
SIGMA = 0.3  # scratch routers: init std 0.02, so a kick of 0.3 moves about half the slots


def _run(results: Path, *sets: str) -> tuple[Path, pd.DataFrame]:
    run_dir = rl.run(load_config(preset="tiny", sets=[*SETS, *sets]), results, progress=False)
    return run_dir, pd.read_parquet(run_dir / "metrics.parquet")


# ---------------------------------------------------------------------------------------------------------------------
# The field
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sets", "error"),
    [
        (["router_kick=-0.1"], r"router_kick = -0.1: must be a finite number in \[0, inf\) \(0 = off\)"),
        (["router_kick=nan"], r"router_kick = nan: must be a finite number in \[0, inf\)"),
        (["router_kick=inf"], r"router_kick = inf: must be a finite number in \[0, inf\)"),
        (["router_kick=strong"], r"router_kick = 'strong': must be float"),
        (
            ["router_kick=0.1", "minibatches=1"],
            r"router_kick = 0.1 moves the routing of minibatches 2..M .* valid: router_kick = 0, or minibatches >= 2",
        ),
        (["router_kick=0.1", "model.num_experts=1", "model.moe_top_k=1"], r"model.num_experts = 1\); valid"),
    ],
)
def test_router_kick_is_validated(sets: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load_config(preset="tiny", sets=sets)


def test_router_kick_names_a_run_only_when_set() -> None:
    # at 0 the run id is the one every run had before the field: finished runs stay finished
    plain, zero = load_config(preset="tiny"), load_config(preset="tiny", sets=["router_kick=0"])
    kicked = load_config(preset="tiny", sets=["router_kick=0.08"])
    assert plain.run_id == zero.run_id != kicked.run_id
    assert kicked.to_dict()["router_kick"] == 0.08  # config.yaml's field: what an analysis labels the regime by


# ---------------------------------------------------------------------------------------------------------------------
# The kicks on a policy
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy() -> tuple[torch.nn.Module, RoutingController, torch.Tensor]:
    """The tiny policy from its init seed, its routing controller, and a batch of token ids (B, S)."""
    model = build_policy(PRESETS["tiny"], seed=3)
    ids = torch.randint(0, PRESETS["tiny"].vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    return model, RoutingController(model), ids


def _forward(
    model: torch.nn.Module, routing: RoutingController, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, S-1) log-probs of `ids` teacher-forced, with gradients, and the free routes (B, S-1, L, k)."""
    with routing.recording():
        logp = token_logp(model, ids[:, :-1], ids[:, 1:])
    return logp, routing.routes().experts


def test_a_kicked_forward_is_the_forward_of_the_kicked_weights(policy: tuple) -> None:
    model, routing, ids = policy
    kick = RouterKick(routing.routers, SIGMA, lambda step, j: 1000 * step + j)
    weights = [r.weight for r in routing.routers]
    before = [w.detach().clone() for w in weights]
    names = [n for n, _ in model.named_parameters()]
    # megatron's DistributedDataParallel hooks each Parameter's gradient accumulator when it wraps the model: the
    # kicked forward's gradient must reach that same accumulator
    accumulated, accumulators = [], [w.expand_as(w).grad_fn.next_functions[0][0] for w in weights]  # kept, as DDP does
    for w, accumulator in zip(weights, accumulators, strict=True):
        accumulator.register_hook(lambda *_, w=w: accumulated.append(w))
    rng = torch.random.get_rng_state()
    with kick.minibatch(step=1, m=2):
        logp, routes = _forward(model, routing, ids)
        assert [n for n, _ in model.named_parameters()] == names
        assert all(
            r.weight is not w and torch.equal(r.weight, w + k)
            for r, w, k in zip(routing.routers, weights, kick.total(1, 2), strict=True)
        )
        model.zero_grad(set_to_none=True)
        logp.sum().backward()
    assert sorted(map(id, accumulated)) == sorted(map(id, weights))  # each once, in the backward's order
    grads = [w.grad.clone() for w in weights]
    assert torch.equal(torch.random.get_rng_state(), rng)  # the kicks have a generator of their own
    # taken back exactly: the same Parameter objects, bit for bit, under their own names
    assert all(r.weight is w for r, w in zip(routing.routers, weights, strict=True))
    assert all(torch.equal(w, b) for w, b in zip(weights, before, strict=True))
    assert [n for n, _ in model.named_parameters()] == names
    assert not any(is_kicked(r) for r in routing.routers)

    # the same forward and gradient as the weights themselves kicked
    expected = [k1 + k2 for k1, k2 in zip(kick.draw(1, 1), kick.draw(1, 2), strict=True)]
    with torch.no_grad():
        for w, k in zip(weights, expected, strict=True):
            w.add_(k)
    try:
        logp_kicked, routes_kicked = _forward(model, routing, ids)
        model.zero_grad(set_to_none=True)
        logp_kicked.sum().backward()
    finally:
        with torch.no_grad():
            for w, b in zip(weights, before, strict=True):
                w.copy_(b)
    assert torch.equal(logp.detach(), logp_kicked.detach()) and torch.equal(routes, routes_kicked)
    assert all(torch.equal(w.grad, g) for w, g in zip(weights, grads, strict=True))
    _, free = _forward(model, routing, ids)
    mask = torch.ones(free.shape[:2])
    assert routing_volatility(free, routes, mask, per_layer=False)["slot_mismatch"] > 0.1  # the kick moved routes


def test_minibatch_m_routes_through_the_kicks_before_it(policy: tuple) -> None:
    _, routing, _ = policy
    kick = RouterKick(routing.routers, 0.05, lambda step, j: 1000 * step + j)
    draws = {j: kick.draw(7, j) for j in (1, 2, 3)}
    for m in (3, 1, 2):  # in any order: each sum is drawn from (step, j) alone
        want = [sum(draws[j][i] for j in range(1, m + 1)) for i in range(len(routing.routers))]
        assert all(torch.allclose(t, w, rtol=0, atol=1e-7) for t, w in zip(kick.total(7, m), want, strict=True))
    assert all(not torch.equal(a, b) for a, b in zip(kick.draw(7, 1), kick.draw(8, 1), strict=True))
    with kick.minibatch(step=7, m=0):  # the first minibatch: pi_old's weights
        assert not any(is_kicked(r) for r in routing.routers)
    with pytest.raises(RuntimeError, match="inside"), kick.minibatch(step=7, m=2):
        raise RuntimeError("inside")
    assert not any(is_kicked(r) for r in routing.routers)  # taken back whatever the block raised


# ---------------------------------------------------------------------------------------------------------------------
# The kicks in the loop
# ---------------------------------------------------------------------------------------------------------------------
def test_the_kicks_are_taken_back_before_the_weight_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At every sync no router is kicked and the engine gets the trainer's router weights; between two syncs those
    moved by the optimizer's steps alone (Adam: about lr per entry and step), never by a kick's 0.3."""
    synced, moved = [], []
    sync = rl._sync_engine

    def checked(parts) -> None:  # type: ignore[no-untyped-def]
        routers = parts.routing.routers
        assert not any(is_kicked(r) for r in routers)
        sync(parts)
        gates = [p for n, p in parts.engine.model.named_parameters() if n.endswith("mlp.gate.weight")]
        synced.append(all(torch.equal(g, r.weight) for g, r in zip(gates, routers, strict=True)))
        now = [r.weight.detach().clone() for r in routers]
        if hasattr(checked, "last"):
            moved.append(max(float((a - b).abs().max()) for a, b in zip(now, checked.last, strict=True)))
        checked.last = now

    monkeypatch.setattr(rl, "_sync_engine", checked)
    run_dir, kicked = _run(tmp_path, f"router_kick={SIGMA}", "steps=2")
    cfg = load_config(preset="tiny", sets=[*SETS, f"router_kick={SIGMA}", "steps=2"])
    assert synced == [True, True, True]  # the start's sync and one a step
    assert len(moved) == 2 and max(moved) < 10 * cfg.minibatches * cfg.lr < SIGMA
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["router_kick"] == SIGMA
    monkeypatch.undo()
    _, plain = _run(tmp_path, "steps=2")
    mb = [f"routing_slot_mismatch_mb{m}" for m in (2, 3, 4)]
    assert (kicked[mb].to_numpy() > 0.2).all() and (plain[mb].to_numpy() < 0.1).all()  # what the updates saw
    assert kicked["reward_mean"][0] == plain["reward_mean"][0]  # step 1's rollouts precede every kick


def test_every_algorithm_of_a_seed_draws_the_same_kicks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[tuple[int, int, list[torch.Tensor]]] = []
    draw = RouterKick.draw

    def recorded(self: RouterKick, step: int, j: int) -> list[torch.Tensor]:
        out = draw(self, step, j)
        drawn.append((step, j, out))
        return out

    monkeypatch.setattr(RouterKick, "draw", recorded)
    kicks = {}
    for algorithm, seed in (("grpo", 3), ("grpo_rr", 3), ("gspo", 3), ("grpo", 4)):
        drawn.clear()
        _run(tmp_path, f"router_kick={SIGMA}", "steps=1", f"algorithm={algorithm}", f"seed={seed}")
        kicks[algorithm, seed] = list(drawn)
    want = kicks["grpo", 3]
    assert [(step, j) for step, j, _ in want] == [(1, 1), (1, 2), (1, 3)]  # after updates 1..M-1 of the step

    def same(a: list, b: list) -> bool:
        return all(
            torch.equal(x, y) for (_, _, xs), (_, _, ys) in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)
        )

    assert same(kicks["grpo_rr", 3], want) and same(kicks["gspo", 3], want)
    assert not any(torch.equal(x, y) for x, y in zip(kicks["grpo", 4][0][2], want[0][2], strict=True))


def test_at_zero_nothing_is_drawn_or_wrapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("router_kick = 0 drew or applied a kick")

    monkeypatch.setattr(RouterKick, "draw", refused)
    monkeypatch.setattr(kick_module, "_kicked_class", refused)
    _, plain = _run(tmp_path, "steps=2")
    assert plain["grad_norm"].gt(0).all() and plain["routing_slot_mismatch"].notna().all()


def test_a_kicked_run_resumes_bit_identically(tmp_path: Path) -> None:
    """The kicks are drawn from (seed, step, minibatch) alone and no kick outlives its minibatch, so a run stopped
    after a checkpoint and resumed draws and applies what the uninterrupted run does."""
    from study.run import rundir

    sets = [*SETS, f"router_kick={SIGMA}", "steps=3", "checkpoint_every=1", "eval_every=1", "eval_size=4"]
    cfg = load_config(preset="tiny", sets=sets)
    whole = pd.read_parquet(rl.run(cfg, tmp_path / "whole", progress=False) / "metrics.parquet")

    def stop(step: int, row: dict[str, float]) -> None:
        if step == 2:
            raise rundir.Stopped("stopped after step 2")

    with pytest.raises(rundir.Stopped):
        rl.run(cfg, tmp_path / "stopped", progress=False, on_eval=stop)
    resumed = pd.read_parquet(rl.run(cfg, tmp_path / "stopped", progress=False) / "metrics.parquet")
    timing = [c for c in whole.columns if c.startswith("time_") or c in ("wall_s", "peak_rss_gb")]
    pd.testing.assert_frame_equal(resumed.drop(columns=timing), whole.drop(columns=timing), check_exact=True)
    kicked = whole["routing_slot_mismatch_mb2"].dropna()  # step 0 (the start) and a step without signal: none
    assert len(kicked) >= 2 and (kicked > 0.2).all()


# ---------------------------------------------------------------------------------------------------------------------
# Across ranks
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_kicked_run_at_tp2_equals_one_process(tmp_path: Path, easy_coldstart: Path) -> None:
    """Each tensor-parallel rank holds a whole copy of every router and draws the same kicks for it: two kicked GRPO +
    Routing Replay steps at TP 2 + SP give the one-process run's metrics, the kicked routing's included."""
    from tests.study.policy.helpers import CLOSE, RUN_SETS, assert_same_run, one_and_layout

    sets = [*RUN_SETS, f"coldstart={easy_coldstart}", "router_kick=0.05"]
    one, two = one_and_layout(tmp_path, sets, ["parallel.tensor=2"])
    a, b = pd.read_parquet(f"{one}/metrics.parquet"), pd.read_parquet(two / "metrics.parquet")
    assert_same_run(a, b, (*CLOSE, "routing_slot_mismatch_mb2", "router_entropy"))
    assert (a["routing_slot_mismatch_mb2"] > 0.05).all() and (a["grad_norm"] > 0).any()
    assert not math.isnan(float(b["routing_slot_mismatch_mb2"].iloc[-1]))


# ---------------------------------------------------------------------------------------------------------------------
# The calibration
# ---------------------------------------------------------------------------------------------------------------------
def _calibration_script():
    import importlib.util

    from tests.shared import ROOT

    spec = importlib.util.spec_from_file_location("calibrate", ROOT / "scripts" / "calibrate_router_kick.py")
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    return calibrate


def test_the_calibration_starts_from_the_studys_own_cold_start() -> None:
    """The calibration's runs start where the study's do: the same cold-start settings (the test split held out of
    the SFT stream), so sigma is chosen on the model the study kicks, not on another cold start."""
    from study.coldstart.store import run_coldstart
    from sweeps.expand import load_sweep
    from tests.shared import ROOT

    sweep = ROOT / "sweeps" / "regime.yaml"
    study = next(iter(load_sweep(sweep).expand().values()))
    (cfg,) = _calibration_script().calibration_runs(sweep, [0.06], ["grpo"], seed=0, steps=60)
    assert run_coldstart(cfg) == run_coldstart(study) and run_coldstart(cfg)["held_out_test"]
    assert (cfg.router_kick, cfg.seed, cfg.steps, cfg.eval_every) == (0.06, 0, 60, 60)


def test_the_calibration_prints_a_row_per_kick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calibrate = _calibration_script()
    small = ["coldstart=scratch", "prompts_per_step=4", "group_size=4", "max_new_tokens=12", "eval_size=4"]
    small.append("eval_test_size=0")
    args = ["--sigmas", "0", str(SIGMA), "--algorithms", "grpo", "--steps", "1", "--results", str(tmp_path)]
    assert calibrate.main([*args, *(f"--set={s}" for s in small)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == list(calibrate.HEADER) and len(lines) == 4
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [r[:2] for r in rows] == [["0", "grpo"], [f"{SIGMA:g}", "grpo"]]
    per_update = [float(r[2].rstrip("%")) for r in rows]
    assert per_update[0] < 10 < per_update[1]  # percent of expert slots after one update
    assert rows[0][4] == rows[1][4]  # one start: the same held-out pass@1 before any kick
