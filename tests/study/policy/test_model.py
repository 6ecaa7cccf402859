"""The Megatron-core MoE policy on CPU: log-probs, training step, determinism, dtypes, padding, bad inputs."""

import contextlib

import pytest
import torch

from study.core.model_config import preset
from study.policy.model import build_policy, init_distributed, logits, norm_topk_prob, token_logp
from study.policy.optim import DynamicLossScaler, build_optimizer
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


@pytest.mark.parametrize("temperature", [0.7, 1.4])
def test_temperature_scores_the_tempered_distribution(model, temperature):
    """token_logp at T is log_softmax(logits / T) gathered, on the full path and the kept-positions path; the hook
    that divides the output layer's input is gone after the call; a non-positive T is refused."""
    ids = _batch(3, 21, seed=2)
    pos = torch.tensor([[3, 7, 19, 19], [5, 6, 7, 8], [0, 1, 2, 18]])
    with torch.no_grad():
        ref = (logits(model, ids[:, :-1]).float() / temperature).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        full = token_logp(model, ids[:, :-1], ids[:, 1:], temperature=temperature)
        kept = token_logp(model, ids[:, :-1], ids[:, 1:], positions=pos, temperature=temperature)
        raw = token_logp(model, ids[:, :-1], ids[:, 1:])
    assert (full - ref).abs().max() <= 1e-5 and (kept - ref.gather(1, pos)).abs().max() <= 1e-5
    assert (raw - ref).abs().max() > 1e-2  # temperature 1 is another distribution
    assert not model.output_layer._forward_pre_hooks
    with pytest.raises(ValueError, match=r"temperature = 0\.0: must be finite and > 0"):
        token_logp(model, ids[:, :-1], ids[:, 1:], temperature=0.0)


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

    from study.policy.layers import sdpa_core_attention
    from study.policy.model import positions_and_mask

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
    """The fast layers' experts (SequentialMLP's per-expert MLPs as one autograd Function, study/policy/experts.py)
    give megatron's SequentialMLP's log-probs and every gradient bit for bit, on a left-padded batch with every expert
    routed to. In bf16 the routing probs stay fp32 (megatron casts the scaled activations back), and the experts run
    megatron's own forward."""
    from study.policy.experts import ExpertsFunction, fused_sequential_mlp

    ids = _batch(4, 21, seed=3)
    mask = torch.ones_like(ids)
    mask[:2, :5] = 0
    out = {}
    with counting(ExpertsFunction) as counts:
        for experts in ("fused", "megatron"):
            m = build_policy(TINY, seed=0, dtype=dtype, layers="megatron")
            if experts == "fused":  # the same module, its forward the fast layers' (nothing else changes)
                for layer in m.decoder.layers:
                    layer.mlp.experts.__class__ = fused_sequential_mlp()
            out[experts] = logp_and_grads(m, ids, mask)
    assert len(counts) == (TINY.num_layers if dtype == "fp32" else 0)  # the Function ran in every fp32 layer
    assert_same_policy(out["fused"], out["megatron"], exact=True)
    assert isinstance(build_policy(TINY, seed=0).decoder.layers[0].mlp.experts, fused_sequential_mlp())


def test_fused_experts_step_aside_for_hooks():
    """A hook on any expert submodule (emulated precision's rounding is one) sends the experts back to megatron's
    own forward, which the hook then sees."""
    from study.policy.experts import ExpertsFunction

    m = build_policy(TINY.replace(num_layers=1), seed=0)
    seen = []
    m.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.register_forward_hook(lambda *a: seen.append(1))
    with counting(ExpertsFunction) as calls:
        token_logp(m, _batch(2, 9)[:, :-1], _batch(2, 9)[:, 1:])
    assert seen and not calls


def _kernel_calls() -> dict[str, type]:
    from study.kernels.attention import AttentionFunction
    from study.kernels.cross_entropy import CrossEntropyFunction
    from study.kernels.rms_norm import RMSNormFunction
    from study.kernels.rope import RopeFunction

    return {
        "attention": AttentionFunction,
        "rope": RopeFunction,
        "rms_norm": RMSNormFunction,
        "cross_entropy": CrossEntropyFunction,
    }


@pytest.mark.parametrize("switch", ["1", "0"])
def test_fast_layers_match_megatrons(switch, monkeypatch):
    """The fast layers (study/policy/layers.py) give megatron's local spec's log-probs and every gradient to ~1e-5 on
    a left-padded batch, with the C kernels (each called where the layers use it: attention once a layer, RoPE on q
    and k, the four layer norms, the loss once) and with `STUDY_NATIVE=0` (none called: the torch paths)."""
    from study.kernels.rms_norm import FusedRMSNorm
    from study.policy.layers import fused_core_attention, gpt_model

    monkeypatch.setenv("STUDY_NATIVE", switch)
    ids = _batch(3, 19, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    out = {}
    with contextlib.ExitStack() as stack:
        calls = {name: stack.enter_context(counting(fn)) for name, fn in _kernel_calls().items()}
        for layers in ("fast", "megatron"):
            m = build_policy(TINY, seed=0, layers=layers)
            layer = m.decoder.layers[0]
            assert isinstance(m, gpt_model()) == (layers == "fast")
            assert isinstance(layer.self_attention.core_attention, fused_core_attention()) == (layers == "fast")
            assert isinstance(layer.self_attention.q_layernorm, FusedRMSNorm) == (layers == "fast")
            assert m.config.apply_rope_fusion == (layers == "fast")
            # predictions from real inputs only: a pad query's output is garbage that differs by attention
            keep = mask[:, :-1] * mask[:, 1:]
            lp = token_logp(m, ids[:, :-1], ids[:, 1:], attention_mask=mask[:, :-1])
            (-(lp * keep).sum()).backward()
            out[layers] = (lp.detach() * keep, {n: p.grad for n, p in m.named_parameters()})
    on = switch == "1"
    n = TINY.num_layers
    assert {k: len(v) for k, v in calls.items()} == {
        "attention": n * on,
        "rope": 2 * n * on,
        "rms_norm": 4 * n * on,
        "cross_entropy": on,
    }
    assert_same_policy(out["fast"], out["megatron"], exact=False)
    with pytest.raises(ValueError, match="layers = 'apex'; valid: fast, megatron"):
        build_policy(TINY, seed=0, layers="apex")


def test_emulated_precision_keeps_the_torch_paths():
    """Emulated low precision rounds the torch ops the kernels would hide (study/core/precision.py): with it on, no C
    kernel runs in the policy's forward and backward."""
    from study.core.precision import apply_precision

    m = build_policy(TINY, seed=0)
    apply_precision(m, "bf16-emulated")
    ids = _batch(2, 9)
    with contextlib.ExitStack() as stack:
        calls = [stack.enter_context(counting(fn)) for fn in _kernel_calls().values()]
        logp_and_grads(m, ids, torch.ones_like(ids))
    assert calls == [[], [], [], []]
