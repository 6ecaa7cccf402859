"""The C core attention (study/kernels/attention.py): outputs and gradients against torch's SDPA on the masks the
policy builds (causal, causal with left padding, and arbitrary holes), grouped-query heads and head sizes with and
without a specialised loop; inputs it does not take, a torch mode or the switch off return None (the caller's SDPA
runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from study.kernels.attention import attention, library


def _sdpa(q, k, v, mask, *, causal, scale):  # type: ignore[no-untyped-def]
    """The reference: study/policy/layers.py's SDPA path on megatron's (S, B, h, d) inputs."""
    s, b, hq, d = q.shape
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if mask is not None:  # megatron's (B, 1, S, S): True = masked; a query always sees itself
        mask, causal = ~mask | torch.eye(s, dtype=torch.bool), False
    out = F.scaled_dot_product_attention(
        qq, kk, vv, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=k.shape[2] != hq
    )
    return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)


def _mask(kind: str, s: int, b: int, gen: torch.Generator) -> torch.Tensor | None:
    if kind in ("causal", "none"):
        return None
    pad = torch.randint(0, s, (b,), generator=gen)  # left padding, up to all but the last position
    real = torch.arange(s)[None] >= pad[:, None]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None] | ~real[:, None, :]
    if kind == "holes":  # masked keys inside a query's span: the kernel's non-dense path
        mask = mask | (torch.rand(b, s, s, generator=gen) < 0.3)
    if kind == "broadcast":  # one (1, 1, S, S) mask for every sequence
        mask = torch.ones(1, s, s, dtype=torch.bool).triu(1)
    return mask[:, None]


@pytest.mark.parametrize(
    "s, b, hq, hk, d, kind",
    [
        (81, 5, 2, 2, 32, "padded"),  # the tiny preset's RL batches
        (37, 3, 4, 2, 32, "causal"),  # grouped-query heads, the causal default
        (6, 2, 2, 1, 64, "none"),  # no mask at all (a non-causal attention)
        (70, 4, 2, 2, 24, "padded"),  # a head size without a specialised loop
        (1, 3, 2, 2, 32, "padded"),
        (130, 2, 4, 4, 128, "padded"),  # several key blocks, the largest specialised head size
        (33, 2, 2, 2, 32, "holes"),
        (20, 3, 2, 2, 32, "broadcast"),
    ],
)
def test_attention_equals_sdpa(s, b, hq, hk, d, kind):
    assert library() is not None, "the C kernels did not build (a C compiler is part of the test environment)"
    gen = torch.Generator().manual_seed(s * 131 + d)
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for h in (hq, hk, hk))
    mask, causal, scale = _mask(kind, s, b, gen), kind != "none", d**-0.5
    grad = torch.randn(s, b, hq * d, generator=gen)
    results = []
    for fn in (attention, _sdpa):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, mask, causal=causal, scale=scale)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=name)


def test_inputs_the_kernel_does_not_take_return_none():
    q = torch.randn(8, 2, 2, 32)
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None].expand(2, 1, 8, 8)
    assert attention(q, q, q, mask, causal=False, scale=1.0) is not None
    half = q.bfloat16()
    assert attention(half, half, half, None, causal=True, scale=1.0) is None  # not fp32
    assert attention(q, q[:5], q[:5], None, causal=True, scale=1.0) is None  # fewer keys than queries
    assert attention(q, q[..., :1, :], q, None, causal=True, scale=1.0) is None  # k and v shapes differ
    assert attention(q, q, q, mask.float(), causal=False, scale=1.0) is None  # an additive (float) mask
    assert attention(q, q, q, mask[:, :, :4], causal=False, scale=1.0) is None  # a mask of another shape
    assert attention(torch.randn(8, 2, 3, 32), q, q, None, causal=True, scale=1.0) is None  # 3 heads over 2

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with Watch():  # a mode that intercepts torch ops must see SDPA's (emulated precision's rounding is one)
        assert attention(q, q, q, mask, causal=False, scale=1.0) is None


def test_the_switch_turns_it_off(monkeypatch):
    q = torch.randn(8, 2, 2, 32)
    monkeypatch.setenv("STUDY_NATIVE", "0")
    assert attention(q, q, q, None, causal=True, scale=1.0) is None
    monkeypatch.setenv("STUDY_NATIVE", "1")
    assert attention(q, q, q, None, causal=True, scale=1.0) is not None
