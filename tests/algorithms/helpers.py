"""The shared hand-derived batch of the loss tests: one group of G = 2 responses, padded to T = 3.
    response 0: 3 tokens, advantage A_0 = +2
    response 1: 2 tokens (+1 padding position), advantage A_1 = -1
Token ratios w = pi_theta / pi_old are set through logp = old_logp + log w; padding holds garbage (logp = 50) that
must not leak into any value or gradient.
"""

import math

import torch

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([2.0, -1.0])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -0.7]])
PAD = 50.0


def batch(w: list[list[float]], old: torch.Tensor = OLD) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp with grad, old_logp) such that exp(logp - old_logp) = w on response tokens."""
    logw = torch.tensor([[math.log(x) for x in row] + [0.0] * (3 - len(row)) for row in w])
    logp = torch.where(MASK.bool(), old + logw, PAD).requires_grad_(True)
    return logp, old


def grad_of(loss: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, logp)
    return g


# Ratios for the token-level variants: both clipping sides active (1.5 with A > 0, 0.5 with A < 0).
W_TOKEN = [[1.5, 0.9, 1.0], [0.5, 1.1]]
