"""Fixtures of the study/ tests: one CPU thread (megatron's CPU-fallback warnings are filtered in pyproject.toml);
helpers that compare a policy built with a C kernel against the one built with megatron's or torch's code."""

import contextlib
from collections.abc import Iterator

import torch

from study.policy.model import token_logp


@contextlib.contextmanager
def counting(function: type) -> Iterator[list[int]]:
    """Counts the calls of an autograd Function's `apply` inside the block."""
    calls, apply = [], function.apply
    function.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        yield calls
    finally:
        function.apply = apply


def logp_and_grads(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Teacher-forced log-probs of the (B, S) batch under `mask` (1 = real) and every parameter's gradient of their
    masked sum."""
    lp = token_logp(model, ids[:, :-1], ids[:, 1:], attention_mask=mask[:, :-1])
    (-(lp * mask[:, 1:]).sum()).backward()
    return lp.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same_policy(got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict], exact: bool) -> None:
    """Two `logp_and_grads` results agree bit for bit (`exact`) or to ~1e-5."""
    (lp_g, g_g), (lp_w, g_w) = got, want
    assert g_g.keys() == g_w.keys()
    for name, a, b in [("logp", lp_g, lp_w), *((n, g_g[n], g) for n, g in g_w.items())]:
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
