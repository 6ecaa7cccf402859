"""The experts as grouped GEMMs (study/policy/experts.py `GroupedExpertsFunction`) against megatron's SequentialMLP on
the CPU, where torch's grouped GEMM loops over the same matmuls: the output and every gradient (the input's, the
routing probs', each expert's weights') bit for bit, in fp32 and in bf16 (fp32 routing probs: megatron's casts).
On one layer with experts left without rows and row counts of no alignment, on the whole policy under free routing
and routing replay, and at expert parallelism 2 (gloo) through megatron's DDP, distributed optimizer and distributed
checkpoint. Perturbing one expert's rows moves that expert's gradient only. The weights keep their names, the HF
weight map and the checkpoints. Each comparison counts the grouped Function's calls, so a path that stepped aside to
megatron's own cannot pass for it.
"""

from __future__ import annotations

import io

import pytest
import torch

from study.core.model_config import TORCH_DTYPES, ParallelLayout, preset
from study.policy.experts import GroupedExpertsFunction, grouped_sequential_mlp, stacked
from study.policy.model import build_policy
from tests.shared import free_port, set_rank_env
from tests.study.conftest import assert_same_policy, counting, logp_and_grads
from tests.study.policy.helpers import CFG, update_at_layout

TINY = preset("tiny")
COUNTS = {  # rows per expert of the tiny preset's four
    "even": [8, 8, 8, 8],
    "unaligned, one empty": [5, 0, 13, 7],
    "one row each": [1, 1, 1, 1],
    "one expert": [0, 0, 9, 0],
}


def _experts(dtype: str, cfg=TINY):  # type: ignore[no-untyped-def]
    """Layer 0's experts of the megatron policy (SequentialMLP) and the grouped module holding the same weights."""
    ref = build_policy(cfg, seed=0, dtype=dtype, layers="megatron").decoder.layers[0].mlp.experts
    grouped = build_policy(cfg, seed=0, dtype=dtype, experts="grouped").decoder.layers[0].mlp.experts
    grouped.load_state_dict(ref.state_dict())
    assert type(grouped) is grouped_sequential_mlp() and type(ref).__name__ == "SequentialMLP"
    return ref, grouped


def _inputs(counts: list[int], dtype: str, cfg=TINY, seed: int = 0):  # type: ignore[no-untyped-def]
    """Permuted rows (N, H), routing probs (N,) in fp32 (the router's dtype in bf16 too) and an output grad."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    x = torch.randn(n, cfg.hidden_size, generator=g).to(TORCH_DTYPES[dtype])
    probs = torch.rand(n, generator=g)
    grad = torch.randn(n, cfg.hidden_size, generator=g).to(TORCH_DTYPES[dtype])
    return x, probs, grad


def _call(module, x, counts, probs, grad) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The output of one call of the experts and every gradient of <output, grad>: the input's, the probs', each
    expert's weights' (by parameter name)."""
    x, probs = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, bias = module(x, torch.tensor(counts), probs)
    assert bias is None
    out.backward(grad)
    return {"out": out.detach(), "x": x.grad, "probs": probs.grad, **{n: p.grad for n, p in module.named_parameters()}}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
def test_grouped_experts_equal_sequential_mlp(dtype, counts):
    """One layer's experts: output and every gradient bit for bit; an expert without rows gets a zero gradient, as
    from megatron's empty matmul."""
    ref, grouped = _experts(dtype)
    x, probs, grad = _inputs(counts, dtype)
    want = _call(ref, x, counts, probs, grad)
    with counting(GroupedExpertsFunction) as calls:
        got = _call(grouped, x, counts, probs, grad)
    assert len(calls) == 1
    _assert_equal(got, want)
    for e, n in enumerate(counts):
        for proj in ("linear_fc1", "linear_fc2"):
            moved = bool(got[f"local_experts.{e}.{proj}.weight"].ne(0).any())
            assert moved == (n > 0), (e, proj)


@pytest.mark.parametrize(
    ("dtype", "width", "counts", "grouped"),
    [
        ("fp32", 36, [5, 0, 13, 7], True),  # 144-byte rows: the GEMM takes them (36 is no multiple of a vector)
        ("bf16", 36, [5, 0, 13, 7], False),  # 72-byte rows: not whole 16-byte units, megatron's own forward
        ("fp32", 128, [0, 0, 0, 0], False),  # no rows at all (an expert-parallel rank may get none)
    ],
)
def test_grouped_experts_step_aside_where_the_gemm_cannot_run(dtype, width, counts, grouped):
    ref, module = _experts(dtype, TINY.replace(moe_ffn_hidden_size=width))
    x, probs, grad = _inputs(counts, dtype)
    want = _call(ref, x, counts, probs, grad)
    with counting(GroupedExpertsFunction) as calls:
        got = _call(module, x, counts, probs, grad)
    assert len(calls) == int(grouped)
    _assert_equal(got, want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_perturbing_one_experts_rows_moves_only_its_gradient(dtype):
    """Expert 2's rows changed: its weights' gradients and its rows' output, input and probs gradients move; every
    other expert's, and every other row's, stay bit for bit (a wrong group boundary would leak across)."""
    counts = [5, 0, 13, 7]
    rows = slice(5, 18)  # expert 2's
    _, grouped = _experts(dtype)
    x, probs, grad = _inputs(counts, dtype)
    moved_x = x.clone()
    moved_x[rows] += torch.randn(13, TINY.hidden_size, generator=torch.Generator().manual_seed(9)).to(x.dtype)
    with counting(GroupedExpertsFunction) as calls:
        base, moved = _call(grouped, x, counts, probs, grad), _call(grouped, moved_x, counts, probs, grad)
    assert len(calls) == 2
    for e in range(TINY.num_experts):
        for proj in ("linear_fc1", "linear_fc2"):
            name = f"local_experts.{e}.{proj}.weight"
            assert torch.equal(base[name], moved[name]) == (e != 2), name
    outside = torch.ones(sum(counts), dtype=torch.bool)
    outside[rows] = False
    for name in ("out", "x", "probs"):
        assert torch.equal(base[name][outside], moved[name][outside]), name
        assert not torch.equal(base[name][rows], moved[name][rows]), name


def _megatron_and_grouped(dtype: str, routing_replay: bool = False):  # type: ignore[no-untyped-def]
    """Two megatron-layer policies with the same weights, the second's experts the grouped module (nothing else
    changes: the rest of the layers stays megatron's reference)."""
    models = [build_policy(TINY, seed=0, dtype=dtype, layers="megatron", routing_replay=routing_replay) for _ in "ab"]
    for layer in models[1].decoder.layers:
        layer.mlp.experts.__class__ = grouped_sequential_mlp()
        layer.mlp.experts.stack_weights()
    return models


def _batch(b: int = 4, s: int = 21, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, TINY.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[:2, :5] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grouped_experts_give_the_policys_logp_and_gradients(dtype):
    """The whole policy, free routing, on a left-padded batch: log-probs and every parameter's gradient bit for bit,
    the grouped Function run in every layer."""
    ids, mask = _batch()
    ref, grouped = _megatron_and_grouped(dtype)
    want = logp_and_grads(ref, ids, mask)
    with counting(GroupedExpertsFunction) as calls:
        got = logp_and_grads(grouped, ids, mask)
    assert len(calls) == TINY.num_layers
    assert_same_policy(got, want, exact=True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grouped_experts_under_routing_replay(dtype):
    """Routes replayed onto every token's pair among experts 0-2, so expert 3 gets no token in any layer: the policy's
    log-probs and gradients (the routers' through the forced gates too) bit for bit, expert 3's gradients zero."""
    from study.core.model_config import route_index_dtype
    from study.policy.routing import Routes, RoutingController

    ids, mask = _batch()
    g = torch.Generator().manual_seed(4)
    b, t = ids.shape[0], ids.shape[1] - 1
    first = torch.randint(0, 3, (b, t, TINY.num_layers), generator=g)
    second = (first + 1 + torch.randint(0, 2, first.shape, generator=g)) % 3  # another of 0-2
    routes = Routes(torch.stack([first, second], dim=-1).to(route_index_dtype(TINY.num_experts)))  # (B, T, L, 2)
    out = []
    with counting(GroupedExpertsFunction) as calls:
        for model in _megatron_and_grouped(dtype, routing_replay=True):
            ctl = RoutingController(model)
            with ctl.replaying(routes):
                out.append(logp_and_grads(model, ids, mask))
            assert torch.equal(ctl.routes().experts, routes.experts)
    assert len(calls) == TINY.num_layers
    assert_same_policy(out[1], out[0], exact=True)
    grads = out[1][1]
    for layer in range(TINY.num_layers):
        prefix = f"decoder.layers.{layer}.mlp.experts.local_experts"
        assert not grads[f"{prefix}.3.linear_fc1.weight"].any() and grads[f"{prefix}.2.linear_fc1.weight"].any()


def test_the_experts_switch():
    """build_policy's `experts` and RunConfig.experts: auto is grouped on CUDA and the per-expert Function on the
    CPU; an unknown value is refused naming the valid ones; the field is a runtime choice, not in the run id."""
    from study.policy.experts import fused_sequential_mlp
    from study.policy.model import device_paths
    from study.run.config import RunConfig

    def module(**kw):  # type: ignore[no-untyped-def]
        return type(build_policy(TINY.replace(num_layers=1), seed=0, **kw).decoder.layers[0].mlp.experts)

    assert module() is fused_sequential_mlp() and module(experts="sequential") is fused_sequential_mlp()
    assert module(experts="grouped") is grouped_sequential_mlp()
    assert device_paths(cuda=True)["experts"] == "grouped" and device_paths(cuda=False)["experts"] == "sequential"
    with pytest.raises(ValueError, match=r"experts = 'looped'; valid: auto, grouped, sequential"):
        build_policy(TINY, seed=0, experts="looped")
    with pytest.raises(ValueError, match=r"experts = 'grouped' needs layers = 'fast'"):
        build_policy(TINY, seed=0, layers="megatron", experts="grouped")
    with pytest.raises(ValueError, match=r"experts = 'looped'; valid: auto, grouped, sequential"):
        RunConfig.from_dict({"experts": "looped"})
    cfg = RunConfig.from_dict({})
    assert cfg.experts == "auto" and cfg.replace(experts="grouped").run_id == cfg.run_id


def test_grouped_weights_keep_names_weight_map_and_checkpoints():
    """The grouped policy's weights are views of one buffer per projection and layer (read in place by the GEMM,
    through an optimizer step too), under the same names, shapes and values as the per-expert policy's; its HF weight
    map, its saved state (same size: no storage written twice) and one update equal the per-expert policy's."""
    from study.core.weights import megatron_to_hf
    from study.policy.optim import build_optimizer

    ids, mask = _batch()
    models = {name: build_policy(TINY, seed=0, experts=name) for name in ("grouped", "sequential")}
    names = {k: [(n, p.shape) for n, p in m.named_parameters()] for k, m in models.items()}
    assert names["grouped"] == names["sequential"]
    hf = {k: megatron_to_hf(m, TINY) for k, m in models.items()}
    assert hf["grouped"].keys() == hf["sequential"].keys()
    assert all(torch.equal(hf["grouped"][k], v) for k, v in hf["sequential"].items())
    saved = {}
    for k, m in models.items():
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)
        saved[k] = buf.getvalue()
    assert abs(len(saved["grouped"]) - len(saved["sequential"])) < 0.01 * len(saved["sequential"])
    loaded, want = torch.load(io.BytesIO(saved["grouped"]), weights_only=True), models["sequential"].state_dict()
    assert loaded.keys() == want.keys()
    assert all(torch.equal(loaded[k], v) if v is not None else loaded[k] is None for k, v in want.items())

    def in_place(model) -> bool:  # type: ignore[no-untyped-def]
        for layer in model.decoder.layers:
            for proj in ("linear_fc1", "linear_fc2"):
                weights = [getattr(e, proj).weight for e in layer.mlp.experts.local_experts]
                if stacked(weights).data_ptr() != weights[0].data_ptr():
                    return False
        return True

    assert in_place(models["grouped"]) and not in_place(models["sequential"])
    for m in models.values():
        opt = build_optimizer(m, lr=1e-3)
        logp_and_grads(m, ids, mask)
        opt.step()
    assert in_place(models["grouped"])
    stepped = {k: dict(m.named_parameters()) for k, m in models.items()}
    assert all(torch.equal(stepped["grouped"][n], p) for n, p in stepped["sequential"].items())


def test_stacked_copies_weights_out_of_place():
    """Weights not laid out one after another in one storage are stacked into a copy, and the grouped Function on
    them equals the one on the buffer's views."""
    _, grouped = _experts("fp32")
    counts = [5, 0, 13, 7]
    x, probs, grad = _inputs(counts, "fp32")
    want = _call(grouped, x, counts, probs, grad)
    for e in grouped.local_experts:  # each weight in a storage of its own, as megatron's DDP buffers may place them
        for proj in (e.linear_fc1, e.linear_fc2):
            proj.weight.data = proj.weight.detach().clone()
    weights = [e.linear_fc1.weight for e in grouped.local_experts]
    assert stacked(weights).data_ptr() != weights[0].data_ptr()
    assert torch.equal(stacked(weights), torch.stack([w.detach() for w in weights]))
    with counting(GroupedExpertsFunction) as calls:
        got = _call(grouped, x, counts, probs, grad)
    assert len(calls) == 1
    _assert_equal(got, want)


# ---------------------------------------------------------------------------------------------------------------------
# Expert parallelism 2 (gloo, two ranks): megatron's DDP, distributed optimizer and distributed checkpoint
# ---------------------------------------------------------------------------------------------------------------------
EP2 = ParallelLayout(expert=2, data=2)


def _ep_worker(rank: int, port: int, start: dict, tmp: str) -> None:
    """At EP 2 (two of the four experts per rank), per path: one GSPO update through megatron's DDP and distributed
    optimizer (log-probs, reduced gradients, weights after it); the grouped run's distributed checkpoint is then
    loaded by a per-expert trainer."""
    set_rank_env(rank, port)
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from study.policy import parallel as P

    out: dict = {}
    for experts in ("grouped", "sequential"):
        model = build_policy(CFG, seed=3, routing_replay=False, parallel=EP2, experts=experts)
        P.load_full_state(model, start)
        trainer = P.ShardedTrainer(model, lr=1e-3, grad_clip=0.5)
        with counting(GroupedExpertsFunction) as calls:
            update = update_at_layout(model, trainer)
        out[experts] = {**update, "calls": len(calls), "stepped": P.full_state_dict(model)}
        if experts == "grouped":
            P.save_distributed(trainer, f"{tmp}/grouped")
        parallel_state.destroy_model_parallel()
    model = build_policy(CFG, seed=5, routing_replay=False, parallel=EP2, experts="sequential")
    P.load_distributed(P.ShardedTrainer(model, lr=1e-3, grad_clip=0.5), f"{tmp}/grouped")
    out["loaded"] = P.full_state_dict(model)
    parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(out, f"{tmp}/out.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_grouped_experts_at_expert_parallelism(tmp_path):
    import torch.multiprocessing as mp

    start = {n: p.detach().clone() for n, p in build_policy(CFG, seed=3, routing_replay=False).named_parameters()}
    mp.spawn(_ep_worker, args=(free_port(), start, str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    grouped, sequential = got["grouped"], got["sequential"]
    assert grouped["calls"] == CFG.num_layers and sequential["calls"] == 0
    assert grouped["took_step"] and sequential["took_step"]
    assert torch.equal(grouped["logp"], sequential["logp"])
    for key in ("grads", "stepped"):
        assert grouped[key].keys() == sequential[key].keys()
        assert all(torch.equal(grouped[key][n], w) for n, w in sequential[key].items()), key
    assert not all(torch.equal(grouped["stepped"][n], w) for n, w in start.items())  # the update moved the weights
    assert all(torch.equal(got["loaded"][n], w) for n, w in grouped["stepped"].items())
