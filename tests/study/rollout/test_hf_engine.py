"""The `hf` rollout engine on the Megatron policy's weights: seeded reproducible sampling, its log-probs equal a
teacher-forced recompute (its own and Megatron's), finish reasons, and routed experts (R3) equal to the experts
Megatron routes the same tokens to."""

from __future__ import annotations

import pytest
import torch

from study.core import weights as W
from study.rollout import Rollout, engine_names, get_engine, register_engine
from study.rollout.hf import HFEngine
from tests.study.rollout.conftest import (
    CFG,
    STOPS,
    build_megatron,
    check_tempered_sampling,
    megatron_logp,
    random_prompts,
)


@pytest.fixture(scope="module")
def megatron():
    return build_megatron(CFG, seed=0)


@pytest.fixture(scope="module")
def engine(megatron) -> HFEngine:
    eng = get_engine("hf", CFG)
    eng.load_weights(W.megatron_to_hf(megatron, CFG))
    return eng


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, CFG.vocab_size, seed=11)


@pytest.fixture(scope="module")
def rollout(engine, prompts) -> Rollout:
    return engine.generate(prompts, 3, seed=123, max_new_tokens=12, stop_token_ids=STOPS, return_routes=True)


def test_registry():
    assert {"hf", "vllm"} <= set(engine_names())
    with pytest.raises(ValueError, match="valid: hf, vllm"):
        get_engine("sglang", CFG)
    with pytest.raises(ValueError, match="already registered"):
        register_engine("hf")(HFEngine)


def test_layout_and_finish_reasons(rollout, prompts):
    assert rollout.prompt_index == [p for p in range(len(prompts)) for _ in range(3)]
    assert set(rollout.finish_reasons) == {"stop", "length"}
    for toks, lp, reason in zip(rollout.tokens, rollout.logprobs, rollout.finish_reasons, strict=True):
        assert lp.dtype == torch.float32 and lp.shape == (len(toks),) and bool((lp <= 0).all())
        stops_at = [i for i, t in enumerate(toks) if t in STOPS]
        if reason == "stop":
            assert stops_at == [len(toks) - 1]  # the stop token ends the response and is kept
        else:
            assert not stops_at and len(toks) == 12


def test_seeded_sampling_is_reproducible(engine, prompts, rollout):
    first = engine.generate(prompts, 3, seed=123, max_new_tokens=12, stop_token_ids=STOPS)
    again = engine.generate(prompts, 3, seed=123, max_new_tokens=12, stop_token_ids=STOPS)
    assert again.tokens == first.tokens == rollout.tokens  # the fixture ran with another thread count
    assert all(torch.equal(a, b) for a, b in zip(again.logprobs, first.logprobs, strict=True))
    other = engine.generate(prompts, 3, seed=124, max_new_tokens=12, stop_token_ids=STOPS)
    assert other.tokens != rollout.tokens
    # the n samples of one prompt differ from each other
    assert len({tuple(t) for t in rollout.tokens[:3]}) > 1


def test_logprobs_equal_teacher_forced_recompute(engine, megatron, rollout, prompts):
    ps = [prompts[i] for i in rollout.prompt_index]
    own, _ = engine.score(ps, rollout.tokens)
    mg = megatron_logp(megatron, ps, rollout.tokens)
    got = torch.cat(rollout.logprobs)
    d_own = (got - torch.cat(own)).abs()
    d_mg = (got - torch.cat(mg)).abs()
    assert d_own.mean() <= 1e-5 and d_mg.mean() <= 1e-5, (d_own.mean(), d_mg.mean())
    assert d_own.max() <= 1e-4 and d_mg.max() <= 1e-4


@pytest.mark.parametrize("native", [True, False])
def test_logprobs_are_of_the_tempered_distribution_and_greedy_is_argmax(engine, megatron, prompts, native):
    """At temperature T the engine's log-probs are of softmax(logits / T), the distribution it sampled from, equal to
    the trainer's token_logp at the same T (C sampling loop and torch loop); `score` stays raw."""
    engine.native_decode = native
    try:
        hot = engine.generate(prompts[:3], 4, seed=5, temperature=1.7, max_new_tokens=10, stop_token_ids=STOPS)
    finally:
        engine.native_decode = True
    ps = [prompts[i] for i in hot.prompt_index]
    got = torch.cat(hot.logprobs)
    tempered = torch.cat(megatron_logp(megatron, ps, hot.tokens, temperature=1.7))
    raw, _ = engine.score(ps, hot.tokens)
    assert (got - tempered).abs().mean() <= 1e-5 and (got - tempered).abs().max() <= 1e-4
    assert (got - torch.cat(raw)).abs().max() > 1e-2  # the raw log-probs are another distribution's
    greedy = engine.generate(prompts[:2], 2, seed=5, temperature=0.0, max_new_tokens=8)
    assert greedy.tokens[0] == greedy.tokens[1]
    seq = torch.tensor(prompts[0] + greedy.tokens[0])[None]
    with torch.no_grad():
        logits = engine.model(input_ids=seq[:, :-1]).logits[0, len(prompts[0]) - 1 :]  # (T, V)
    assert logits.argmax(-1).tolist() == greedy.tokens[0]


def test_routes_shape_and_equal_to_megatron_routing(engine, megatron, rollout, prompts):
    from study.policy.model import token_logp
    from study.policy.routing import RoutingController

    ctl = RoutingController(megatron)
    assert engine.routes_supported and rollout.routes is not None
    for i, (toks, routes) in enumerate(zip(rollout.tokens, rollout.routes, strict=True)):
        prompt = prompts[rollout.prompt_index[i]]
        seq = torch.tensor(prompt + toks)[None]  # (1, S)
        assert routes.shape == (seq.shape[1] - 1, CFG.num_layers, CFG.moe_top_k) and routes.dtype == torch.uint8
        with torch.no_grad(), ctl.recording():
            token_logp(megatron, seq[:, :-1], seq[:, 1:])
        mg = ctl.routes().experts[0]  # (S - 1, L, k)
        assert torch.equal(routes.sort(-1).values, mg.sort(-1).values.to(routes.dtype)), i
    # and the hook-recorded routes equal a teacher-forced forward's
    _, scored = engine.score([prompts[i] for i in rollout.prompt_index], rollout.tokens, return_routes=True)
    assert all(torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(scored, rollout.routes, strict=True))


def test_load_weights_changes_the_function(megatron, prompts):
    eng = HFEngine(CFG)
    state = W.megatron_to_hf(megatron, CFG)
    eng.load_weights(state)
    before = eng.generate(prompts, 2, seed=1, max_new_tokens=6)
    state["lm_head.weight"] = state["lm_head.weight"] * 3.0
    eng.load_weights(state)
    after = eng.generate(prompts, 2, seed=1, max_new_tokens=6)
    assert before.tokens != after.tokens or not all(
        torch.allclose(a, b) for a, b in zip(before.logprobs, after.logprobs, strict=True)
    )
    assert all(torch.equal(v, eng.state_dict_hf()[k]) for k, v in state.items())
    del state["model.norm.weight"]
    with pytest.raises(KeyError):
        eng.load_weights(state)


def test_bad_arguments_raise(engine):
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([[1, 2]], 1, seed=0, max_new_tokens=CFG.max_seq_len)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1, seed=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[CFG.vocab_size]], 1, seed=0, max_new_tokens=4)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.4])
def test_sampler_draws_from_the_tempered_distribution(temperature):
    check_tempered_sampling(temperature, sampler="torch")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_sdpa(masked, dtype):
    """The engine's decode-step attention (grouped query heads, no KV copy) computes transformers' sdpa attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from study.rollout.hf import decode_attention

    class Attn:  # what the attention functions read from the module
        num_key_value_groups, is_causal = 2, True

    g = torch.Generator().manual_seed(0)
    n, heads, kv_heads, length, d = 6, 4, 2, 11, 32
    q, k, v = (
        torch.randn(n, h, s, d, generator=g).to(dtype) for h, s in ((heads, 1), (kv_heads, length), (kv_heads, length))
    )
    mask = (torch.rand(n, 1, 1, length, generator=g) > 0.4) if masked else None
    if mask is not None:
        mask[..., -1] = True  # the current token always sees itself
    want, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=d**-0.5)
    got, weights = decode_attention(Attn(), q, k, v, mask, scaling=d**-0.5)
    assert weights is None and got.shape == want.shape == (n, 1, heads, d) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if mask is not None:  # a masked key changes nothing: move its value far away
        v2 = v.clone()
        v2[~mask[:, 0, 0].unsqueeze(1).expand(n, kv_heads, length)] = 1e4
        torch.testing.assert_close(decode_attention(Attn(), q, k, v2, mask, scaling=d**-0.5)[0], got)


def test_decode_attention_matches_sdpa_in_generate(engine, prompts, rollout):
    """Swapping the engine's attention back to transformers' sdpa samples the same tokens with the same log-probs
    (left-padded prompts: the decode steps carry a key-padding mask)."""
    assert engine.model.config._attn_implementation == "study_decode"
    engine.model.config._attn_implementation = "sdpa"
    try:
        ref = engine.generate(prompts, 3, seed=123, max_new_tokens=12, stop_token_ids=STOPS)
    finally:
        engine.model.config._attn_implementation = "study_decode"
    assert ref.tokens == rollout.tokens
    for a, b in zip(ref.logprobs, rollout.logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("dtype", "experts"), [("fp32", None), ("bf16", None), ("fp32", "eager")])
def test_fused_decode_step_equals_the_modules(megatron, prompts, dtype, experts, monkeypatch):
    """The engine's fused decode step (one GEMM for q/k/v, ops on the modules' parameters) samples the same tokens
    with the same log-probs and routes as transformers' decoder layers, bit for bit, on left-padded prompts; with
    the default `grouped_mm` experts it computes them itself, with any other it calls the experts module."""
    from study.rollout import hf

    eng = get_engine("hf", CFG, dtype=dtype, experts_implementation=experts, native_decode=False)
    eng.load_weights(W.megatron_to_hf(megatron, CFG))
    assert hf._FusedDecoder.eligible(eng.model, eng.precision)
    assert (hf._FusedDecoder._grouped_mm(eng.model.model.layers[0].mlp.experts) is None) == (experts == "eager")
    calls = []
    step = hf._FusedDecoder.step
    monkeypatch.setattr(hf._FusedDecoder, "step", lambda self, *a: calls.append(1) or step(self, *a))
    kw = dict(seed=5, max_new_tokens=10, stop_token_ids=STOPS, return_routes=True)
    fused = eng.generate(prompts, 3, **kw)
    assert len(calls) >= 5  # the fused step ran (the rollout stops early only when every sample has stopped)
    monkeypatch.setattr(hf._FusedDecoder, "eligible", staticmethod(lambda *a: False))
    modules = eng.generate(prompts, 3, **kw)
    assert fused.tokens == modules.tokens and fused.finish_reasons == modules.finish_reasons
    for a, b in zip(fused.logprobs, modules.logprobs, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fused.routes, modules.routes, strict=True):
        assert torch.equal(a, b)


def test_fused_decode_step_only_where_it_is_exact():
    """Emulated precisions (rounding hooks inside the modules), another attention or a hook on a layer keep the
    modules' decode step."""
    from study.rollout import hf

    emulated = get_engine("hf", CFG, dtype="bf16", precision="bf16-emulated")
    assert emulated.precision.emulated and not hf._FusedDecoder.eligible(emulated.model, emulated.precision)
    eng = get_engine("hf", CFG)
    assert hf._FusedDecoder.eligible(eng.model, eng.precision)
    eng.model.config._attn_implementation = "sdpa"
    assert not hf._FusedDecoder.eligible(eng.model, eng.precision)
    eng.model.config._attn_implementation = hf.DECODE_ATTENTION
    handle = eng.model.model.layers[0].mlp.experts.register_forward_hook(lambda *a: None)
    assert not hf._FusedDecoder.eligible(eng.model, eng.precision)
    handle.remove()
    assert hf._FusedDecoder.eligible(eng.model, eng.precision)
