"""Step time of the policy's update at world size 2 (gloo, CPU) against one process on the same global batch, what
the collectives cost, and Routing Replay's cost under expert parallelism.

    python benchmarks/bench_parallel.py [--preset default] [--rows 16] [--seq 96] [--iters 5]

One update = forward of this rank's rows (routes recorded), log-probs gathered, a token-mean loss, backward,
megatron's gradient reduction, global-norm clip, AdamW step. Timed separately on the ranks: the gradient reduction
(`ShardedTrainer.reduce`), the all-gather of the log-probs and of the recorded routes (what Routing Replay adds to a
step: under EP each rank's (b, S, L, k) routes gathered over the data-parallel ranks; under TP + SP each rank's
(b, S/TP, L, k) sequence shard gathered over the tensor-parallel group by `RoutingController.routes()`, for the
volatility metrics), and the full-weight export (the rollout engine's weight sync). One thread per rank; the medians
of `--iters` updates.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch

from study.core.model_config import PRESETS, ParallelLayout, route_index_dtype


def _batch(cfg, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=g), torch.ones(rows, seq)


def _median(f, iters: int) -> float:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def one_process(preset: str, rows: int, seq: int, iters: int) -> float:
    from study.policy.model import build_policy, token_logp
    from study.policy.optim import build_optimizer
    from study.policy.routing import RoutingController

    torch.set_num_threads(1)
    cfg = PRESETS[preset]
    model = build_policy(cfg, seed=0)
    routing = RoutingController(model)
    opt = build_optimizer(model, lr=1e-5)
    ids, mask = _batch(cfg, rows, seq)

    def update() -> None:
        with routing.recording():
            lp = token_logp(model, ids[:, :-1], ids[:, 1:])
        routing.routes()
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()

    update()
    return _median(update, iters)


def _worker(rank: int, port: int, layout: ParallelLayout, preset: str, rows: int, seq: int, iters: int, out) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from study.policy import parallel as P
    from study.policy.model import build_policy, token_logp
    from study.policy.routing import Routes, RoutingController

    cfg = PRESETS[preset]
    model = build_policy(cfg, seed=0, parallel=layout)
    routing = RoutingController(model)
    trainer = P.ShardedTrainer(model, lr=1e-5, grad_clip=1.0)
    ids, mask = _batch(cfg, rows, seq)
    local = P.data_rows(rows)
    state: dict = {}

    def update() -> None:
        with routing.recording():
            lp = token_logp(model, ids[local, :-1], ids[local, 1:])
        t = time.perf_counter()
        state["routes"] = routing.routes()  # under TP + SP: all-gathered over the TP group (study/policy/routing.py)
        full = P.gather_rows(lp, rows)
        Routes(P.gather_rows(state["routes"].experts, rows))
        state.setdefault("gather", []).append(time.perf_counter() - t)
        loss = -(full * mask).sum() / mask.sum()
        trainer.zero_grad()
        loss.backward()
        t = time.perf_counter()
        trainer.reduce()
        state.setdefault("reduce", []).append(time.perf_counter() - t)
        trainer.reduce, reduce = (lambda: None), trainer.reduce
        trainer.step()
        trainer.reduce = reduce

    update()
    state.clear()
    step = _median(update, iters)
    routes = state["routes"].experts  # this rank's rows, whole sequences
    t_routes = _median(lambda: P.gather_rows(routing.routes().experts, rows), iters)  # TP gather, then DP rows
    t_export = _median(lambda: dict(P.full_hf_weights(model)), max(2, iters // 2))
    if rank == 0:
        out.put(
            {
                "step": step,
                "reduce": statistics.median(state["reduce"]),
                "gather": statistics.median(state["gather"]),
                "routes_gather": t_routes,
                "export": t_export,
                # what a rank's routers hold: its rows' routes, under sequence parallelism its sequence shard's
                "route_bytes_local": routes.numel() * routes.element_size() // layout.tensor,
                "route_bytes_rows": routes.numel() * routes.element_size(),
                "route_shape": tuple(routes.shape),
            }
        )
    torch.distributed.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="default")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--layouts", default="ep2,dp2,tp2", help="comma-separated: ep2, dp2, tp2")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    print(f"preset {args.preset}, global batch {args.rows} x {args.seq} tokens, one thread per rank")
    print(f"world 1: update {one_process(args.preset, args.rows, args.seq, args.iters) * 1e3:.0f} ms")
    ctx = mp.get_context("spawn")
    layouts = {"ep2": ParallelLayout(expert=2, data=2), "dp2": ParallelLayout(data=2), "tp2": ParallelLayout(tensor=2)}
    for name in args.layouts.split(","):
        layout = layouts[name]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.Queue()
        mp.spawn(_worker, args=(port, layout, args.preset, args.rows, args.seq, args.iters, q), nprocs=2)
        r = q.get()
        tokens = args.rows * args.seq
        per = r["route_bytes_rows"] / (r["route_shape"][0] * r["route_shape"][1] * cfg.num_layers * cfg.moe_top_k)
        print(
            f"world 2 {layout.to_dict()}: update {r['step'] * 1e3:.0f} ms (gradient reduction "
            f"{r['reduce'] * 1e3:.1f} ms, log-prob + route gathers {r['gather'] * 1e3:.1f} ms), full-weight export "
            f"{r['export'] * 1e3:.0f} ms; routes: {per:.0f} byte per token, layer and slot "
            f"({route_index_dtype(cfg.num_experts)}), {r['route_bytes_local']} bytes held per rank, all-gather of "
            f"the step's {tokens} tokens' routes {r['routes_gather'] * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
