"""Routing record/replay on the Megatron policy, the routing-volatility metrics (the GSPO paper), and expert load: load
imbalance and router entropy."""

import math

import pytest
import torch

from study.core.model_config import preset, route_index_dtype
from study.policy.model import build_policy, token_logp
from study.policy.routing import (
    Routes,
    RoutingController,
    expert_load,
    load_imbalance,
    mean_router_entropy,
    response_inputs,
    routing_volatility,
)

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


def _recorded(ctl: RoutingController, model, ids: torch.Tensor) -> Routes:
    """The routes `ctl` records on a forward of `model` over `ids` (no gradients)."""
    with torch.no_grad(), ctl.recording():
        _logp(model, ids)
    return ctl.routes()


@pytest.fixture()
def model():
    return build_policy(TINY, seed=0)


def test_record_then_replay_after_perturbing_the_router(model):
    ctl = RoutingController(model)
    ids = _batch()
    recorded = _recorded(ctl, model, ids)
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
    """The GSPO paper: under replay the gate weights are a softmax over the current router logits of the forced
    experts."""
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
    routes = _recorded(ctl, model, ids)
    _perturb_routers(ctl)
    with ctl.replaying(routes):
        _logp(model, ids).mean().backward()
    for router in ctl.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_routes_survive_minibatch_resplitting(model):
    ctl = RoutingController(model)
    ids = _batch(6, 17)
    routes = _recorded(ctl, model, ids)
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
    routes_a = _recorded(ca, a, ids)
    routes_b = _recorded(cb, b, ids)
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
    routes = _recorded(ctl, model, ids)
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


def test_response_inputs_are_the_positions_that_give_the_responses_logprobs():
    # The pad layout of tests/study/test_rl.py: prompts [5, 6] + response [7, 8, 9], and [1, 2, 3] + [4]; inputs
    # [[5, 6, 7, 8], [1, 2, 3, 0]], pos [[1, 2, 3], [2, 3, 3]], mask [[1, 1, 1], [1, 0, 0]].
    pos = torch.tensor([[1, 2, 3], [2, 3, 3]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    got = response_inputs(pos, mask, 4)
    assert got.tolist() == [[False, True, True, True], [False, False, True, False]]  # the last prompt token on
    # R3's measure over them: token 0 of sample 0 (a prompt token) changed counts nowhere, token 2 of sample 1 counts
    x = torch.zeros(2, 4, 2, 2, dtype=torch.uint8)
    x[..., 1] = 1
    y = x.clone()
    y[0, 0, 0] = torch.tensor([2, 3])  # a prompt token off the response positions
    y[1, 2, 1, 1] = 3  # sample 1's one response position, second layer
    assert routing_volatility(x, y, got)["token_flip_rate"] == pytest.approx(1 / 4)
    assert routing_volatility(x, y)["token_flip_rate"] == pytest.approx(2 / 8)


def test_replay_in_bf16():
    model = build_policy(TINY.replace(num_layers=1), seed=0, dtype="bf16")
    ctl = RoutingController(model)
    ids = _batch(2, 17)
    routes = _recorded(ctl, model, ids)
    _perturb_routers(ctl)
    with ctl.replaying(routes):
        _logp(model, ids).mean().backward()
    assert torch.equal(ctl.routes().experts, routes.experts)
    assert ctl.routers[0].weight.grad.abs().sum() > 0


def test_load_imbalance_hand_made():
    # 1 sample, 4 tokens, 2 layers, k = 2, E = 4. Layer 0: every expert gets 2 of the 8 slots (balanced). Layer 1:
    # every token on experts {0, 1}: 4 slots each against a mean of 8 / 4 = 2, i.e. E / k.
    x = torch.tensor([[[[0, 1], [0, 1]], [[2, 3], [1, 0]], [[1, 0], [0, 1]], [[3, 2], [1, 0]]]], dtype=torch.uint8)
    assert load_imbalance(x, 4).tolist() == [1.0, 2.0]
    assert load_imbalance(Routes(x), 8).tolist() == [2.0, 4.0]  # 4 idle experts more: mean 1, max 2 and 4
    # Pad tokens are left out: a fifth token (masked) sends both layers onto expert 3 and 2 and changes nothing ...
    pad = torch.cat([x, torch.tensor([[[[3, 2], [3, 2]]]], dtype=torch.uint8)], dim=1)  # (1, 5, 2, 2)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert load_imbalance(pad, 4, mask).tolist() == [1.0, 2.0]
    # ... while counted it would: layer 0 expert 2 and 3 get 3 of 10 slots (mean 2.5), layer 1 experts 0, 1 get 4.
    assert load_imbalance(pad, 4).tolist() == pytest.approx([3 / 2.5, 4 / 2.5])
    # top-1, every token on one expert: E.
    assert load_imbalance(torch.full((2, 3, 1, 1), 5), 8).tolist() == [8.0]
    assert math.isnan(load_imbalance(x, 4, torch.zeros(1, 4)).tolist()[0])  # no tokens
    with pytest.raises(ValueError, match="experts"):
        load_imbalance(x, 3)
    with pytest.raises(ValueError, match="mask"):
        load_imbalance(x, 4, torch.ones(1, 3))
    m = expert_load(x, 4)
    assert m == {"expert_load_imbalance": 1.5, "expert_load_imbalance_l0": 1.0, "expert_load_imbalance_l1": 2.0}


def test_mean_router_entropy_hand_made():
    ent = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [9.0, 9.0]]])  # (1, 3, 2): per token and layer
    assert mean_router_entropy(ent).tolist() == pytest.approx([13 / 3, 11 / 3])
    assert mean_router_entropy(ent, torch.tensor([[True, True, False]])).tolist() == [2.0, 1.0]  # pad left out
    x = torch.zeros(1, 3, 2, 1, dtype=torch.long)
    m = expert_load(x, 2, torch.tensor([[1, 1, 0]]), ent)
    assert m["router_entropy"] == 1.5 and m["router_entropy_l0"] == 2.0 and m["router_entropy_l1"] == 1.0
    assert m["expert_load_imbalance"] == 2.0  # top-1 on one of two experts


def _router_logits(ctl: RoutingController, seen: list) -> list[torch.Tensor]:
    return [
        hidden.reshape(-1, router.weight.shape[1]) @ router.weight.T
        for router, hidden in zip(ctl.routers, seen, strict=True)
    ]


@pytest.mark.parametrize("top_k", [TINY.moe_top_k, 1])  # top-1: megatron's top-k ranks the softmax, not the logits
def test_router_entropy_of_the_recorded_forward(top_k: int):
    model = build_policy(TINY.replace(moe_top_k=top_k), seed=0)
    ctl = RoutingController(model)
    ids = _batch(3, 11)
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(i[0].detach())) for r in ctl.routers]
    with pytest.raises(RuntimeError, match="no forward"):
        ctl.router_entropy()
    with torch.no_grad():
        free = _logp(model, ids)
    seen.clear()
    with torch.no_grad(), ctl.recording():
        recorded = _logp(model, ids)
    assert torch.equal(recorded, free)  # recording computes the same values
    ent = ctl.router_entropy()
    assert ent.shape == (3, 10, TINY.num_layers) and ent.dtype == torch.float32
    for layer, logits in enumerate(_router_logits(ctl, seen)):  # (S*B, E), megatron's sequence-major order
        want = torch.distributions.Categorical(logits=logits).entropy().reshape(10, 3).T  # (B, S)
        assert torch.allclose(ent[:, :, layer], want, atol=1e-5)
    assert bool((ent >= 0).all()) and bool((ent <= math.log(TINY.num_experts) + 1e-6).all())
    # Under replay the router still scores every expert: the same weights give the same entropies.
    routes = ctl.routes()
    with torch.no_grad(), ctl.replaying(routes):
        _logp(model, ids)
    assert torch.allclose(ctl.router_entropy(), ent, atol=1e-6)
    for h in hooks:
        h.remove()
    ctl.record()
    with pytest.raises(RuntimeError, match="no forward"):
        ctl.router_entropy()  # setting a mode forgets the last forward's scores
    ctl.free()


def test_router_entropy_of_uniform_and_certain_routers(model):
    ctl = RoutingController(model)
    ids = _batch(2, 9)
    with torch.no_grad():
        for router in ctl.routers:
            router.weight.zero_()  # every logit 0: the uniform softmax
    with torch.no_grad(), ctl.recording():
        _logp(model, ids)
    assert torch.allclose(ctl.router_entropy(), torch.full((2, 8, TINY.num_layers), math.log(TINY.num_experts)))
    with torch.no_grad():
        for router in ctl.routers:
            router.weight[0] = 1e4  # expert 0's logit 1e4 x (sum of the hidden state), the others' still 0
    with torch.no_grad(), ctl.recording():
        _logp(model, ids)
    ent = ctl.router_entropy()  # a positive sum: certain of expert 0; a negative one: uniform over the other E - 1
    certain, rest = ent.abs() < 1e-6, (ent - math.log(TINY.num_experts - 1)).abs() < 1e-6
    assert bool((certain | rest).all()) and bool(certain.any()) and bool(rest.any())
