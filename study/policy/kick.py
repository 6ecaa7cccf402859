"""The routing-volatility dial (RunConfig.router_kick): Gaussian kicks to the MoE routers inside a step, so that one
update of a small MoE moves about as many expert slots as one update of the paper's 48-layer MoE (~10%).

Within step s of M minibatches (`RouterKick.minibatch(s, m)`, m = 0..M-1):
1. after minibatch m's optimizer step a kick k_{s,m+1} is drawn, one N(0, sigma^2) entry per router weight entry, from
   a generator of its own seeded by (run seed, s, m + 1): every algorithm of a seed draws the same kicks, no other
   random draw of the run moves, and every rank holding a copy of a router draws the same kick for it;
2. minibatch m's forwards (its update's, and routing_attribution's) route with W + k_{s,1} + ... + k_{s,m}: the
   first minibatch none, minibatch m the m kicks of the m updates before it;
3. the kicks are in those forwards only (each router's `weight` read as W + kick while the minibatch runs), never in
   the weights W: the optimizer steps W with the kicked forward's gradient (the sum's gradient is W's), and
   the weight sync, the held-out evaluations, the checkpoints and the next step's pi_old see W alone. Taking the
   kicks back is exact by construction.

Under Routing Replay the replayed routes override the kicked routers' top-k (the gates still softmax the kicked
logits of the forced experts), and the free routing measured alongside is the kicked one: the columns
routing_slot_mismatch_mb2..mbM are the slot mismatches the update forwards saw. That is the paper's mechanism at its
size: the routing the update sees has moved since pi_old, and replay pins it back.

An emulation, not a reproduction: the paper's routing moves because every weight moves after an update, and the
rollout policy of the next step carries that move; here the routers alone are moved, within a step, by noise that is
no gradient, and the rollout policy never carries it. docs/studies/regime.md has the calibration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch


def _kicked_weight(router: torch.nn.Module) -> torch.Tensor:
    """A kicked router's `weight` as its forward reads it: its Parameter plus its kick, computed at each read (so each
    forward's graph is its own and the gradient reaches the Parameter itself)."""
    return router._parameters["weight"] + router.__dict__["_router_kick"]


_KICKED_CLASSES: dict[type, type] = {}


def _kicked_class(cls: type) -> type:
    """`cls` with its `weight` read as `_kicked_weight` (a property on a subclass: what a parametrization does, minus
    its re-registration of the Parameter, which would swap the Parameter's gradient accumulator for a new one and cut
    megatron's DistributedDataParallel hooks off from its gradient)."""
    if cls not in _KICKED_CLASSES:
        _KICKED_CLASSES[cls] = type(f"Kicked{cls.__name__}", (cls,), {"weight": property(_kicked_weight)})
    return _KICKED_CLASSES[cls]


def is_kicked(router: torch.nn.Module) -> bool:
    """Whether `router`'s forwards read a kicked weight now."""
    return type(router) in _KICKED_CLASSES.values()


class RouterKick:
    """The kicks of a run (module docstring): `sigma` (RunConfig.router_kick, in the router weights' units; 0: off,
    nothing drawn, no weight kicked), the `routers` (modules with a `weight`, study.policy.routing.RoutingController's
    order) and `seed_of(step, j)`, the seed of step `step`'s j-th kick."""

    def __init__(self, routers: Sequence[torch.nn.Module], sigma: float, seed_of: Callable[[int, int], int]) -> None:
        self.routers, self.sigma, self.seed_of = list(routers), sigma, seed_of
        self._step, self._count = -1, 0  # the step and the number of kicks summed in `_sum`
        self._sum: list[torch.Tensor] = []  # per router: the sum of the step's kicks so far, in its weight's dtype

    def draw(self, step: int, j: int) -> list[torch.Tensor]:
        """Step `step`'s kick j (j >= 1: the kick after its j-th update), one tensor per router (fp32, on the CPU)."""
        generator = torch.Generator().manual_seed(self.seed_of(step, j))
        return [self.sigma * torch.randn(r.weight.shape, generator=generator) for r in self.routers]

    def total(self, step: int, m: int) -> list[torch.Tensor]:
        """The kicks minibatch m (0-based) of step `step` routes through, summed: k_1 + ... + k_m, per router in its
        weight's dtype and device (the sum in fp32)."""
        if step != self._step or m < self._count:
            self._step, self._count = step, 0
            self._sum = [torch.zeros(r.weight.shape) for r in self.routers]
        while self._count < m:
            self._count += 1
            self._sum = [s + k for s, k in zip(self._sum, self.draw(step, self._count), strict=True)]
        return [
            s.to(dtype=r.weight.dtype, device=r.weight.device) for s, r in zip(self._sum, self.routers, strict=True)
        ]

    @contextlib.contextmanager
    def minibatch(self, step: int, m: int) -> Iterator[None]:
        """Minibatch m's forwards inside the block route through the m kicks of the step so far (nothing when sigma
        is 0 or m is 0): each router's `weight` reads as its Parameter plus the kicks, the Parameter itself (its name,
        value, optimizer state and gradient hooks) untouched; the routers read their Parameters again after the block,
        whatever it raised."""
        if not self.sigma or m == 0:
            yield
            return
        kicked = []
        try:
            for router, kick in zip(self.routers, self.total(step, m), strict=True):
                router.__dict__["_router_kick"] = kick
                router.__class__ = _kicked_class(type(router))
                kicked.append(router)
            yield
        finally:
            for router in kicked:
                router.__class__ = type(router).__bases__[0]
                del router.__dict__["_router_kick"]
