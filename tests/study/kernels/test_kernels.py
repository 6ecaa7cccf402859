"""The C RMSNorm, RoPE and cross entropy against the torch and megatron code they replace (outputs and gradients),
the inputs each steps aside for (another dtype, hooks, a torch mode, the switch off), and the build: a failing
compiler gives a warning and no kernel, never an error."""

from __future__ import annotations

import pytest
import torch

from study import kernels
from study.kernels import build, cross_entropy, rms_norm, rope


def _counting(function: type) -> tuple[list[int], object]:
    calls, apply = [], function.apply
    function.apply = lambda *a: calls.append(1) or apply(*a)
    return calls, apply


def test_the_kernels_build_here():
    """A C compiler is part of the test environment: every kernel builds (the other tests would pass vacuously on
    their torch paths otherwise)."""
    assert kernels.available()
    assert all(build.load(p.stem) is not None for p in build.CSRC.glob("*.c"))


def test_rms_norm_equals_torchs():
    """Output and gradients to ~1e-6 on the policy's shapes (hidden rows, and (S, B, heads, d) for the q/k norms,
    non-contiguous too); bf16 inputs, hooked modules, a torch mode and the switch off run torch's own forward."""
    g = torch.Generator().manual_seed(0)
    for shape in [(37, 64), (9, 4, 2, 32), (3, 5, 0, 16)]:
        d = shape[-1]
        ref, fused = torch.nn.RMSNorm(d, eps=1e-6), rms_norm.FusedRMSNorm(d, eps=1e-6)
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
    calls, apply = _counting(rms_norm.RMSNormFunction)
    try:
        x = torch.randn(4, 64, generator=g)
        rms_norm.FusedRMSNorm(64)(x)
        assert len(calls) == 1
        low = rms_norm.FusedRMSNorm(64).to(torch.bfloat16)
        assert torch.equal(low(x.bfloat16()), torch.nn.RMSNorm(64).to(torch.bfloat16)(x.bfloat16()))
        hooked = rms_norm.FusedRMSNorm(64)
        hooked.register_forward_pre_hook(lambda _m, args: None)
        hooked(x)
        with _Watch():
            rms_norm.FusedRMSNorm(64)(x)
        assert len(calls) == 1  # neither the bf16, the hooked nor the watched module called the C function
    finally:
        rms_norm.RMSNormFunction.apply = apply


def test_rope_is_megatrons_unfused_code_bit_for_bit():
    """Outputs and gradients equal megatron's unfused bshd RoPE exactly; inputs it does not take return None."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(1)
    freqs = torch.rand(5, 1, 1, 8, generator=g) * 3
    freqs = torch.cat([freqs[..., :4], freqs[..., :4]], dim=-1)  # megatron's [f, f] over the two halves
    t = torch.randn(5, 2, 3, 8, generator=g)
    grad = torch.randn(5, 2, 3, 8, generator=g)
    results = []
    for fn in (lambda x: rope.rope(x, freqs), lambda x: _apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=False)):
        x = t.clone().requires_grad_()
        y = fn(x)
        y.backward(grad)
        results.append((y.detach(), x.grad))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    assert rope.rope(t.bfloat16(), freqs) is None
    assert rope.rope(t[..., :7], freqs) is None  # odd head size
    with _Watch():
        assert rope.rope(t, freqs) is None


def test_cross_entropy_matches_megatrons():
    """Losses and logit gradients to ~1e-6 of megatron's vocab-parallel cross entropy (one tensor-parallel rank);
    inputs it does not take (bf16, targets outside the vocabulary) return None."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from study.policy.model import init_distributed

    init_distributed()  # megatron's loss reduces over the (one-rank) tensor-parallel group
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 3, 300, generator=g) * 4
    target = torch.randint(0, 300, (7, 3), generator=g)
    grad = torch.randn(7, 3, generator=g)
    results = []
    for fn in (cross_entropy.cross_entropy, vocab_parallel_cross_entropy):
        x = logits.clone().requires_grad_()
        loss = fn(x, target)
        loss.backward(grad)
        results.append((loss.detach(), x.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cross_entropy.cross_entropy(logits.bfloat16(), target) is None
    assert cross_entropy.cross_entropy(logits, target + 300) is None


def test_one_rule_for_every_kernel(monkeypatch):
    """`applies` is the rule each entry point asks: fp32 CPU tensors, no torch mode, the switch on."""
    x = torch.randn(3, 4)
    assert kernels.applies(x, x)
    assert not kernels.applies(x, x.bfloat16())
    with _Watch():
        assert not kernels.applies(x)
    monkeypatch.setenv("STUDY_NATIVE", "0")
    assert not kernels.applies(x) and not kernels.available()
    assert cross_entropy.cross_entropy(torch.randn(2, 1, 5), torch.zeros(2, 1, dtype=torch.long)) is None


def test_a_failing_build_warns_and_gives_no_kernel(monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-DSTUDY_TEST_FAILING_BUILD"))  # a new cache key
    build.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="failed"):
            assert build.load("rope") is None
    finally:
        monkeypatch.undo()
        build.load.cache_clear()


class _Watch(torch.overrides.TorchFunctionMode):
    """A torch mode that intercepts every op (emulated precision's rounding is one)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))
