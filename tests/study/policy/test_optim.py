"""study.policy.optim.clip_grad_norm: torch's clip_grad_norm_ bit for bit, without the scaling pass that multiplies
every gradient by 1."""

from __future__ import annotations

import math

import pytest
import torch

from study.policy.optim import clip_grad_norm


def _params(scale: float, *, nan: bool = False) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (7, 300, 4097)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    if nan:
        params[1].grad[3] = math.nan
    return params


@pytest.mark.parametrize(
    ("scale", "max_norm", "nan", "scales"),
    [
        (1e-3, 1.0, False, False),  # norm below the limit: the factor would be 1
        (10.0, 1.0, False, True),  # above: clipped
        (10.0, math.inf, False, False),  # no clipping (grad_clip 0)
        (1.0, 1.0, True, True),  # a NaN gradient: the factor is NaN and scales, as in torch
    ],
)
def test_it_equals_torchs_clip_grad_norm_bit_for_bit(monkeypatch, scale, max_norm, nan, scales) -> None:  # type: ignore[no-untyped-def]
    ours, theirs = _params(scale, nan=nan), _params(scale, nan=nan)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    calls = []
    scale_pass = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: calls.append(1) or scale_pass(*a, **k))
    norm = clip_grad_norm(ours, max_norm)
    assert torch.equal(norm, expected) or (nan and norm.isnan() and expected.isnan())
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.grad.view(torch.int32), b.grad.view(torch.int32))  # the bits, NaNs included
    assert len(calls) == int(scales), "the scaling pass runs only where its factor is not 1"
