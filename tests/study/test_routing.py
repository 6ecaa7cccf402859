"""Routing record/replay on the Megatron policy, and the routing-volatility metrics (PAPER.md)."""

import pytest
import torch

from study.model_config import preset, route_index_dtype
from study.policy.model import build_policy, token_logp
from study.policy.routing import Routes, RoutingController, routing_volatility

TINY = preset("tiny")


def _batch(b: int = 4, s: int = 33, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))  # (B, S)


def _logp(model, ids: torch.Tensor) -> torch.Tensor:
    return token_logp(model, ids[:, :-1], ids[:, 1:])  # (B, S-1)


def _perturb_routers(ctl: RoutingController, scale: float = 1.0, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in ctl.routers:
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=gen))


@pytest.fixture()
def model():
    return build_policy(TINY, seed=0)


def test_record_then_replay_after_perturbing_the_router(model):
    ctl = RoutingController(model)
    ids = _batch()
    with torch.no_grad(), ctl.recording():
        _logp(model, ids)
    recorded = ctl.routes()
    assert recorded.shape == (4, 32, TINY.num_layers, TINY.moe_top_k) and recorded.experts.dtype == torch.uint8
    _perturb_routers(ctl)
    with torch.no_grad(), ctl.recording():
        free_logp = _logp(model, ids)
    drift = routing_volatility(recorded, ctl.routes())
    assert drift["set_flip_rate"] > 0.5, drift  # free routing moved on most tokens
    with torch.no_grad(), ctl.replaying(recorded):
        replay_logp = _logp(model, ids)
    assert torch.equal(ctl.routes().experts, recorded.experts)  # replay used exactly the recorded experts
    assert not torch.allclose(replay_logp, free_logp)
    # The free routing the replayed forward would have chosen: layer 0 sees the same input as a free forward.
    free = ctl.free_routes()
    assert routing_volatility(recorded, free)["set_flip_rate_l0"] == drift["set_flip_rate_l0"]
    assert ctl.mode == "free"


def test_gate_is_softmax_over_current_logits_of_forced_experts(model):
    """PAPER.md: under replay the gate weights are a softmax over the current router logits of the forced experts."""
    ctl = RoutingController(model)
    ids = _batch(2, 9)
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append((i[0].detach(), o[0].detach()))) for r in ctl.routers]
    # Force each token onto its k *least* preferred experts, so replay visibly is not free routing.
    with torch.no_grad(), ctl.recording():
        _logp(model, ids)
    worst = []
    for router, (hidden, _) in zip(ctl.routers, seen, strict=True):
        router_logits = hidden.reshape(-1, TINY.hidden_size) @ router.weight.T  # (S*B, E)
        worst.append(router_logits.topk(TINY.moe_top_k, largest=False).indices)  # (S*B, k)
    forced = Routes.from_layers(worst, batch=2, seq=8, num_experts=TINY.num_experts)
    seen.clear()
    with torch.no_grad(), ctl.replaying(forced):
        _logp(model, ids)
    for h in hooks:
        h.remove()
    for layer, (router, (hidden, probs)) in enumerate(zip(ctl.routers, seen, strict=True)):
        idx = forced.layer_tokens(layer, probs.device)  # (S*B, k)
        router_logits = hidden.reshape(-1, TINY.hidden_size) @ router.weight.T  # (S*B, E) current logits
        expected = router_logits.gather(1, idx).softmax(-1)  # (S*B, k)
        assert torch.allclose(probs.gather(1, idx), expected, atol=1e-6)
        assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[0]), atol=1e-6)  # nothing off the forced set
    assert torch.equal(ctl.routes().experts, forced.experts)


def test_router_gets_gradients_under_replay(model):
    ctl = RoutingController(model)
    ids = _batch()
    with torch.no_grad(), ctl.recording():
        _logp(model, ids)
    routes = ctl.routes()
    _perturb_routers(ctl)
    with ctl.replaying(routes):
        _logp(model, ids).mean().backward()
    for router in ctl.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_routes_survive_minibatch_resplitting(model):
    ctl = RoutingController(model)
    ids = _batch(6, 17)
    with torch.no_grad(), ctl.recording():
        _logp(model, ids)
    routes = ctl.routes()
    _perturb_routers(ctl)
    with torch.no_grad(), ctl.replaying(routes):
        full = _logp(model, ids)  # (6, 16)
    for idx in (torch.tensor([4, 1]), torch.tensor([0, 5, 2]), torch.tensor([3])):
        with torch.no_grad(), ctl.replaying(routes[idx]):
            part = _logp(model, ids[idx])
        assert torch.equal(ctl.routes().experts, routes.experts[idx])
        assert torch.allclose(part, full[idx], atol=1e-6)
    # Trimming the sequence too (a shorter padded minibatch).
    with torch.no_grad(), ctl.replaying(routes[1:3, :10]):
        part = token_logp(model, ids[1:3, :10], ids[1:3, 1:11])
    assert torch.allclose(part, full[1:3, :10], atol=1e-6)


def test_two_models_do_not_interfere():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    a, b = build_policy(TINY, seed=0), build_policy(TINY, seed=1)
    ca, cb = RoutingController(a), RoutingController(b)
    mine = {id(r.router_replay) for r in ca.routers + cb.routers}
    assert not mine & {id(r) for r in RouterReplay.global_router_replay_instances}
    ids = _batch()
    with torch.no_grad(), ca.recording():
        _logp(a, ids)
    routes_a = ca.routes()
    with torch.no_grad(), cb.recording():
        _logp(b, ids)
    routes_b = cb.routes()
    assert routing_volatility(routes_a, routes_b)["set_flip_rate"] > 0  # different seeds route differently
    with torch.no_grad():
        free_b = _logp(b, ids)
    with torch.no_grad(), ca.replaying(routes_a):
        assert cb.mode == "free"
        assert torch.equal(_logp(b, ids), free_b)  # b is untouched by a's replay
        _logp(a, ids)
        assert torch.equal(ca.routes().experts, routes_a.experts)
    # A second controller on the same model shares its state.
    assert RoutingController(a).mode == "free" and len(RoutingController(a).routers) == TINY.num_layers


def test_replay_errors(model):
    ctl = RoutingController(model)
    ids = _batch(2, 9)
    with pytest.raises(RuntimeError, match="no forward"):
        ctl.routes()
    with torch.no_grad(), ctl.recording():
        _logp(model, ids)
    routes = ctl.routes()
    with pytest.raises(RuntimeError, match=r"\(B, S\)"), torch.no_grad(), ctl.replaying(routes[:1]):
        _logp(model, ids)  # routes for one sample, batch of two
    with pytest.raises(ValueError, match="layers"):
        ctl.replay(Routes(routes.experts[:, :, :1]))
    with pytest.raises(ValueError, match="expert"):
        ctl.replay(Routes(torch.full_like(routes.experts, TINY.num_experts)))
    with pytest.raises(TypeError):
        ctl.replay(routes.experts)
    # A layer whose routes are missing is an error, never a silent fallback to free routing.
    ctl.replay(routes)
    ctl.routers[1].router_replay.target_topk_idx = None
    with pytest.raises(RuntimeError, match="no routes set for MoE layer 1"), torch.no_grad():
        _logp(model, ids)
    ctl.free()
    with pytest.raises(ValueError, match="routing_replay=True"):
        RoutingController(build_policy(TINY.replace(num_layers=1), seed=0, routing_replay=False))


def test_routes_container():
    assert route_index_dtype(4) == torch.uint8 and route_index_dtype(256) == torch.uint8
    assert route_index_dtype(257) == torch.int16 and route_index_dtype(2**16) == torch.int32
    r = Routes(torch.arange(2 * 3 * 2 * 2, dtype=torch.uint8).reshape(2, 3, 2, 2))
    assert r[1].shape == (1, 3, 2, 2) and r[:, 1].shape == (2, 1, 2, 2) and len(r) == 2
    assert torch.equal(Routes.cat([r[1], r[0]]).experts, r.experts[[1, 0]])
    # megatron's token order is sequence-major: (S*B, k) <-> (B, S, L, k)
    per_layer = [r.layer_tokens(layer, torch.device("cpu")) for layer in range(2)]
    assert torch.equal(per_layer[0][1], r.experts[1, 0, 0].long())  # token (s=0, b=1)
    assert torch.equal(Routes.from_layers(per_layer, batch=2, seq=3, num_experts=4).experts, r.experts)
    with pytest.raises(ValueError):
        Routes(torch.zeros(2, 3, 2))
    with pytest.raises(ValueError):
        Routes(torch.zeros(2, 3, 2, 2))


def test_volatility_metrics_hand_made():
    # 1 sample, 3 tokens, 2 layers, k = 2.
    x = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]]])  # (1, 3, 2, 2)
    y = torch.tensor([[[[1, 0], [2, 3]], [[0, 2], [2, 3]], [[2, 3], [3, 0]]]])
    # (token, layer) overlaps: t0: 2, 2 | t1: 1, 2 | t2: 0, 1
    m = routing_volatility(Routes(x), Routes(y))
    assert m["slot_mismatch"] == pytest.approx((0 + 0 + 0.5 + 0 + 1 + 0.5) / 6)
    assert m["set_flip_rate"] == pytest.approx(3 / 6)
    assert m["token_flip_rate"] == pytest.approx(2 / 3)
    assert m["slot_mismatch_l0"] == pytest.approx(1.5 / 3) and m["slot_mismatch_l1"] == pytest.approx(0.5 / 3)
    assert m["set_flip_rate_l0"] == pytest.approx(2 / 3) and m["set_flip_rate_l1"] == pytest.approx(1 / 3)
    assert m["tokens"] == 3
    # Mask: only token 0 (identical sets up to order).
    masked = routing_volatility(x, y, torch.tensor([[True, False, False]]))
    assert masked["slot_mismatch"] == 0 and masked["token_flip_rate"] == 0 and masked["tokens"] == 1
    empty = routing_volatility(x, y, torch.zeros(1, 3, dtype=torch.bool))
    assert empty["tokens"] == 0 and empty["slot_mismatch"] == 0
    assert routing_volatility(x, x)["set_flip_rate"] == 0
    with pytest.raises(ValueError):
        routing_volatility(x, y[:, :2])
    with pytest.raises(ValueError):
        routing_volatility(x, y, torch.ones(1, 2, dtype=torch.bool))


def test_replay_in_bf16():
    model = build_policy(TINY.replace(num_layers=1), seed=0, dtype="bf16")
    ctl = RoutingController(model)
    ids = _batch(2, 17)
    with torch.no_grad(), ctl.recording():
        _logp(model, ids)
    routes = ctl.routes()
    _perturb_routers(ctl)
    with ctl.replaying(routes):
        _logp(model, ids).mean().backward()
    assert torch.equal(ctl.routes().experts, routes.experts)
    assert ctl.routers[0].weight.grad.abs().sum() > 0
