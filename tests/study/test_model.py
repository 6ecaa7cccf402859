"""The Megatron-core MoE policy on CPU: log-probs, training step, determinism, dtypes, padding, bad inputs."""

import pytest
import torch

from study.config import preset
from study.model import (
    DynamicLossScaler,
    build_optimizer,
    build_policy,
    init_distributed,
    logits,
    norm_topk_prob,
    token_logp,
)
from tests.study.conftest import assert_same_policy, counting, logp_and_grads

TINY = preset("tiny")


def _batch(b: int = 3, s: int = 17, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))  # (B, S)


@pytest.fixture(scope="module")
def model():
    return build_policy(TINY, seed=0)


def test_labels_path_matches_log_softmax_gather(model):
    ids = _batch()
    with torch.no_grad():
        logp = token_logp(model, ids[:, :-1], ids[:, 1:])  # (B, T)
        ref = logits(model, ids[:, :-1]).float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T)
    assert logp.dtype == torch.float32 and logp.shape == (3, 16)
    assert (logp - ref).abs().max() <= 1e-6


def test_kept_positions_equal_the_full_forward_gathered_with_gradients(model):
    """`positions` runs the LM head and cross entropy on the kept positions only: the same log-probs and the same
    gradients as the full (B, S) forward followed by a gather, also under left padding."""
    ids = _batch(3, 21, seed=4)
    am = torch.ones(3, 20, dtype=torch.long)
    am[1, :5] = 0  # left padding in one row: the explicit-mask path
    pos = torch.tensor([[3, 7, 19, 19], [5, 6, 7, 8], [0, 1, 2, 18]])
    full = token_logp(model, ids[:, :-1], ids[:, 1:], attention_mask=am)
    kept = token_logp(model, ids[:, :-1], ids[:, 1:], attention_mask=am, positions=pos)
    assert kept.shape == (3, 4) and kept.dtype == torch.float32
    torch.testing.assert_close(kept, full.gather(1, pos), atol=1e-6, rtol=0)
    weights = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    grads = []
    for out in (full.gather(1, pos), kept):
        model.zero_grad(set_to_none=True)
        (out * weights).sum().backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and "output_layer.weight" in grads[1]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-4, msg=name)
    assert not model.output_layer._forward_pre_hooks  # the hook is gone after the call
    with pytest.raises(ValueError, match=r"positions out of range \[0, 20\)"):
        token_logp(model, ids[:, :-1], ids[:, 1:], positions=pos + 1)
    with pytest.raises(ValueError, match=r"positions must be \(B=3, T\) int64"):
        token_logp(model, ids[:, :-1], ids[:, 1:], positions=pos[:2])


def test_logits_shape_and_dtype(model):
    out = logits(model, _batch()[:, :-1])
    assert out.shape == (3, 16, TINY.vocab_size) and out.dtype == torch.float32


def test_train_step_moves_every_parameter():
    model = build_policy(TINY, seed=1)
    opt = build_optimizer(model, lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = _batch(4, 33)
    loss = -token_logp(model, ids[:, :-1], ids[:, 1:]).mean()
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, f"no gradient: {no_grad}"
    opt.step()
    still = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not still, f"unchanged after a step: {still}"
    groups = {n.split(".")[-2] for n in before}  # router, linear_fc1/2, linear_qkv, *_layernorm, ...
    assert {"router", "linear_fc1", "linear_fc2", "linear_qkv", "linear_proj", "q_layernorm", "k_layernorm"} <= groups
    with torch.no_grad():
        assert -token_logp(model, ids[:, :-1], ids[:, 1:]).mean() < loss  # it learned something


def test_same_seed_same_weights_and_logp(model):
    rng_before = torch.get_rng_state()
    again = build_policy(TINY, seed=0)
    assert torch.equal(torch.get_rng_state(), rng_before), "build_policy touched the caller's RNG"
    other = build_policy(TINY, seed=1)
    sd, sd2, sd3 = model.state_dict(), again.state_dict(), other.state_dict()
    weights = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert all(torch.equal(sd[k], sd2[k]) for k in weights)
    assert not torch.equal(sd["decoder.layers.0.mlp.router.weight"], sd3["decoder.layers.0.mlp.router.weight"])
    ids = _batch()
    with torch.no_grad():
        assert torch.equal(token_logp(model, ids[:, :-1], ids[:, 1:]), token_logp(again, ids[:, :-1], ids[:, 1:]))


def test_parameter_names_are_stable(model):
    names = {n for n, _ in model.named_parameters()}
    for expected in (
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "decoder.final_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
    ):
        assert expected in names
    fc1 = dict(model.named_parameters())["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert fc1.shape == (2 * TINY.moe_ffn_hidden_size, TINY.hidden_size)  # [gate; up]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision(model, dtype):
    low = build_policy(TINY, seed=0, dtype=dtype)
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert all(p.dtype == want for p in low.parameters())
    ids = _batch()
    with torch.no_grad():
        lp, ref = token_logp(low, ids[:, :-1], ids[:, 1:]), token_logp(model, ids[:, :-1], ids[:, 1:])
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
    diff = (lp - ref).abs().mean()
    assert 0 < diff < 0.05, f"{dtype} vs fp32 mean |diff| = {diff}"


def test_optimizer_is_fused_adamw_with_the_plain_update():
    """build_optimizer's fused AdamW takes the steps torch's single-tensor AdamW takes, to rounding."""
    model = build_policy(TINY, seed=3)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    assert opt.defaults["fused"]
    params = [p for p in model.parameters() if p.requires_grad]
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    init = [p.detach().clone() for p in params]
    ref = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, eps=1e-8, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        for p, c in zip(params, copies, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            c.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, c in zip(params, copies, strict=True):
        torch.testing.assert_close(p.detach(), c.detach(), rtol=1e-6, atol=1e-7)
    moved = sum(float((c - c0).abs().max()) > 1e-3 for c, c0 in zip(copies, init, strict=True))
    assert moved == len(copies)  # 5 steps of lr 1e-2 moved every tensor: the comparison above is not vacuous


def test_fp16_step_with_loss_scaler():
    model = build_policy(TINY, seed=2, dtype="fp16")
    opt = build_optimizer(model, lr=1e-3)
    assert opt.defaults["eps"] >= 1e-6
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = _batch(2, 17)
    scaler.scale(-token_logp(model, ids[:, :-1], ids[:, 1:]).mean()).backward()
    assert scaler.step(opt, model.parameters())
    assert scaler.scale_value == 2.0**11
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(not torch.equal(p, before[n]) for n, p in model.named_parameters()) == len(before)


def test_loss_scaler_skips_overflow():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = DynamicLossScaler(init_scale=8.0)
    p.grad = torch.tensor([1.0, float("inf"), 0.0], dtype=torch.float16)
    assert not scaler.step(opt, [p])
    assert torch.equal(p.detach(), torch.ones(3, dtype=torch.float16)) and scaler.scale_value == 4.0
    p.grad = torch.tensor([4.0, 0.0, 0.0], dtype=torch.float16)
    assert scaler.step(opt, [p])
    assert p.detach().tolist() == [0.0, 1.0, 1.0]  # grad unscaled to 1.0 before the step


def test_right_padding_needs_no_mask_and_left_padding_matches(model):
    ids = _batch(1, 12)
    with torch.no_grad():
        plain = token_logp(model, ids[:, :-1], ids[:, 1:])  # (1, 11)
        # Right padding: 4 pad tokens after the sequence; the mask is recognised as right-padded.
        right = torch.cat([ids, torch.zeros(1, 4, dtype=ids.dtype)], 1)
        mask = torch.cat([torch.ones(1, 12), torch.zeros(1, 4)], 1)
        lp_r = token_logp(model, right[:, :-1], right[:, 1:], attention_mask=mask[:, :-1])
        assert torch.allclose(lp_r[:, :11], plain, atol=1e-6)
        # Left padding: 4 pads first; positions restart and pad keys are masked.
        left = torch.cat([torch.zeros(1, 4, dtype=ids.dtype), ids], 1)
        mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 12)], 1)
        lp_l = token_logp(model, left[:, :-1], left[:, 1:], attention_mask=mask[:, :-1])
        assert torch.allclose(lp_l[:, 4:], plain, atol=1e-5)
        assert torch.isfinite(lp_l).all()


def test_top1_uses_pre_softmax_router():
    cfg = TINY.replace(num_layers=1, moe_top_k=1)
    assert norm_topk_prob(cfg) is False and norm_topk_prob(TINY) is True
    model = build_policy(cfg, seed=0)
    assert model.config.moe_router_pre_softmax is True
    ids = _batch(2, 9)
    (-token_logp(model, ids[:, :-1], ids[:, 1:]).mean()).backward()
    assert model.decoder.layers[0].mlp.router.weight.grad.abs().sum() > 0


def test_aux_loss_is_off_by_default_and_opt_in(model):
    assert model.config.moe_aux_loss_coeff == 0.0 and model.config.moe_router_load_balancing_type == "none"
    with_aux = build_policy(TINY.replace(num_layers=1, extra={"moe_aux_loss_coeff": 1e-3}), seed=0)
    assert with_aux.config.moe_aux_loss_coeff == 1e-3 and with_aux.config.moe_router_load_balancing_type == "aux_loss"


def test_bad_inputs(model):
    with pytest.raises(ValueError, match="dtype"):
        build_policy(TINY, seed=0, dtype="fp8")
    with pytest.raises(ValueError, match="seed"):
        build_policy(TINY, seed=-1)
    with pytest.raises(ValueError, match="core_attention = 'flash'; valid: fused, sdpa, megatron"):
        build_policy(TINY, seed=0, core_attention="flash")
    with pytest.raises(ValueError, match="experts = 'grouped'; valid: fused, megatron"):
        build_policy(TINY, seed=0, experts="grouped")
    with pytest.raises(TypeError):
        build_policy({"num_layers": 2}, seed=0)
    with pytest.raises(ValueError, match="moe_top_k"):
        TINY.replace(moe_top_k=5)
    with pytest.raises(ValueError, match="out of range"):
        token_logp(model, torch.full((1, 4), TINY.vocab_size), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        logits(model, torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="targets shape"):
        token_logp(model, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        logits(model, torch.zeros(1, 4))
    with pytest.raises(ValueError, match="already initialised"):
        init_distributed(tensor_parallel=2)
    init_distributed()  # idempotent with the initialised sizes


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_core_attention_equals_megatron_dot_product_attention(model, masked):
    # the policy's core attention (torch SDPA) against megatron's own DotProductAttention on the same inputs, with
    # the causal default and with an explicit causal-and-padding mask (left padding: rows 0-2 of sequence 1 are pads)
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from study.model import positions_and_mask, sdpa_core_attention

    core = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(core, sdpa_core_attention())
    ref = DotProductAttention(core.config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    s, b, h, d = 11, 2, TINY.num_attention_heads, TINY.head_dim
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for _ in range(3))
    mask = None
    if masked:
        real = torch.ones(b, s, dtype=torch.long)
        real[1, :3] = 0
        _, mask = positions_and_mask(torch.zeros(b, s, dtype=torch.long), real)
    got, want = core(q, k, v, mask), ref(q, k, v, mask)
    assert got.shape == want.shape == (s, b, h * d)
    keep = torch.ones(s, b, dtype=torch.bool)
    if masked:
        keep[:3, 1] = False  # pad queries: garbage on both sides, masked out of every loss
    assert (got - want)[keep].abs().max() <= 1e-5
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_experts_equal_megatrons_sequential_mlp(dtype):
    """The policy's experts (SequentialMLP's per-expert MLPs as one autograd Function, study/moe_experts.py) give
    megatron's SequentialMLP's log-probs and every gradient bit for bit, on a left-padded batch with every expert
    routed to. In bf16 the routing probs stay fp32 (megatron casts the scaled activations back), and the experts run
    megatron's own forward."""
    from study.moe_experts import ExpertsFunction, fused_sequential_mlp

    ids = _batch(4, 21, seed=3)
    mask = torch.ones_like(ids)
    mask[:2, :5] = 0
    out, counts = {}, []
    apply = ExpertsFunction.apply
    ExpertsFunction.apply = lambda *a: counts.append(a[2]) or apply(*a)  # tokens per expert of each call
    try:
        for experts in ("fused", "megatron"):
            m = build_policy(TINY, seed=0, dtype=dtype, experts=experts)
            assert isinstance(m.decoder.layers[0].mlp.experts, fused_sequential_mlp()) == (experts == "fused")
            out[experts] = logp_and_grads(m, ids, mask)
    finally:
        ExpertsFunction.apply = apply
    if dtype == "fp32":  # the Function ran in every layer, with every expert busy
        assert len(counts) == TINY.num_layers and all(min(c) > 0 for c in counts)
    else:
        assert not counts
    assert_same_policy(out["fused"], out["megatron"], exact=True)


def test_fused_experts_step_aside_for_hooks():
    """A hook on any expert submodule (emulated precision's rounding is one) sends the experts back to megatron's
    own forward, which the hook then sees."""
    from study.moe_experts import ExpertsFunction

    m = build_policy(TINY.replace(num_layers=1), seed=0)
    seen, calls = [], []
    m.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.register_forward_hook(lambda *a: seen.append(1))
    apply = ExpertsFunction.apply
    ExpertsFunction.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        token_logp(m, _batch(2, 9)[:, :-1], _batch(2, 9)[:, 1:])
    finally:
        ExpertsFunction.apply = apply
    assert seen and not calls


def test_fused_rms_norm_equals_torchs():
    """The C RMSNorm (study/norms.py) gives torch's RMSNorm's output and gradients to ~1e-6 on the policy's shapes
    (hidden rows, and (S, B, heads, d) for the q/k norms, non-contiguous too); bf16 inputs and hooked modules run
    torch's own forward."""
    from study.norms import FusedRMSNorm, RMSNormFunction, library

    assert library() is not None, "the C kernels did not build (a C compiler is part of the test environment)"
    g = torch.Generator().manual_seed(0)
    for shape in [(37, 64), (9, 4, 2, 32), (3, 5, 0, 16)]:
        d = shape[-1]
        ref, fused = torch.nn.RMSNorm(d, eps=1e-6), FusedRMSNorm(d, eps=1e-6)
        with torch.no_grad():
            ref.weight.copy_(torch.randn(d, generator=g))
            fused.weight.copy_(ref.weight)
        x = torch.randn(*shape[:-1], d * 2, generator=g)[..., ::2]  # a strided view, as megatron's q/k slices are
        grad = torch.randn(shape, generator=g)
        outs = []
        for m in (ref, fused):
            xi = x.clone().requires_grad_()
            y = m(xi)
            y.backward(grad)
            outs.append((y.detach(), xi.grad, m.weight.grad))
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    calls = []
    apply = RMSNormFunction.apply
    RMSNormFunction.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        x = torch.randn(4, 64, generator=g)
        FusedRMSNorm(64)(x)
        assert len(calls) == 1
        low = FusedRMSNorm(64).to(torch.bfloat16)
        assert torch.equal(low(x.bfloat16()), torch.nn.RMSNorm(64).to(torch.bfloat16)(x.bfloat16()))
        hooked = FusedRMSNorm(64)
        hooked.register_forward_pre_hook(lambda _m, args: None)
        hooked(x)
        assert len(calls) == 1  # neither the bf16 nor the hooked module called the C function
    finally:
        RMSNormFunction.apply = apply


def test_fused_norms_policy_matches_torch_norms():
    """The policy with the C norms gives the torch-norm policy's log-probs and gradients to ~1e-5 (same weights),
    and its layers' norms are the C ones."""
    from study.norms import FusedRMSNorm

    ids = _batch(3, 19, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    out = {}
    for norms in ("fused", "megatron"):
        m = build_policy(TINY, seed=0, norms=norms)
        layer = m.decoder.layers[0]
        kinds = {type(layer.input_layernorm), type(layer.pre_mlp_layernorm), type(layer.self_attention.q_layernorm)}
        assert kinds == ({FusedRMSNorm} if norms == "fused" else {torch.nn.RMSNorm})
        out[norms] = logp_and_grads(m, ids, mask)
    assert_same_policy(out["fused"], out["megatron"], exact=False)
    with pytest.raises(ValueError, match="norms = 'apex'; valid: fused, megatron"):
        build_policy(TINY, seed=0, norms="apex")


def test_fused_rope_is_megatrons_bit_for_bit():
    """RoPE in C through megatron's fused-RoPE slot (study/rope.py) gives the unfused megatron policy's log-probs
    and every gradient bit for bit on a left-padded batch; q and k of every layer went through the C function, and
    inputs it does not take (bf16, interleaved) run megatron's unfused code."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from study.rope import RopeFunction, fused_rope, library

    assert library() is not None, "the C kernels did not build (a C compiler is part of the test environment)"
    ids = _batch(3, 19, seed=6)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = {}
    with counting(RopeFunction) as calls:
        for rope in ("fused", "megatron"):
            m = build_policy(TINY, seed=0, rope=rope)
            assert m.config.apply_rope_fusion == (rope == "fused")
            out[rope] = logp_and_grads(m, ids, mask)
        assert len(calls) == 2 * TINY.num_layers  # q and k of each layer, in the fused policy only
        g = torch.Generator().manual_seed(1)
        freqs = torch.rand(5, 1, 1, 8, generator=g)
        t = torch.randn(5, 2, 3, 8, generator=g)
        for x, interleaved in ((t.bfloat16(), False), (t, True)):
            want = _apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=interleaved)
            assert torch.equal(fused_rope(x, freqs, interleaved), want)
        assert len(calls) == 2 * TINY.num_layers
    assert_same_policy(out["fused"], out["megatron"], exact=True)
    with pytest.raises(ValueError, match="rope = 'yarn'; valid: fused, megatron"):
        build_policy(TINY, seed=0, rope="yarn")


def test_fused_cross_entropy_matches_megatrons():
    """The language-model loss in C (study/cross_entropy.py) gives megatron's vocab-parallel cross entropy's losses
    and logit gradients to ~1e-6, and the policy with it the megatron-loss policy's log-probs and gradients to ~1e-5;
    inputs it does not take (bf16, targets outside the vocabulary) return None, the caller then runs megatron's."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from study.cross_entropy import CrossEntropyFunction, cross_entropy, library
    from study.model import fused_loss_gpt_model

    assert library() is not None, "the C kernels did not build (a C compiler is part of the test environment)"
    init_distributed()  # megatron's loss reduces over the (one-rank) tensor-parallel group
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 3, 300, generator=g) * 4
    target = torch.randint(0, 300, (7, 3), generator=g)
    grad = torch.randn(7, 3, generator=g)
    results = []
    for fn in (cross_entropy, vocab_parallel_cross_entropy):
        x = logits.clone().requires_grad_()
        loss = fn(x, target)
        loss.backward(grad)
        results.append((loss.detach(), x.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cross_entropy(logits.bfloat16(), target) is None
    assert cross_entropy(logits, target + 300) is None

    ids = _batch(3, 17, seed=8)
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    out = {}
    with counting(CrossEntropyFunction) as calls:
        for kind in ("fused", "megatron"):
            m = build_policy(TINY, seed=0, cross_entropy=kind)
            assert isinstance(m, fused_loss_gpt_model()) == (kind == "fused")
            out[kind] = logp_and_grads(m, ids, mask)
    assert len(calls) == 1  # the fused policy's loss; megatron's policy ran its own
    assert_same_policy(out["fused"], out["megatron"], exact=False)
    with pytest.raises(ValueError, match="cross_entropy = 'te'; valid: fused, megatron"):
        build_policy(TINY, seed=0, cross_entropy="te")
