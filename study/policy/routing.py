"""Routing record and replay (the paper's Routing Replay, "R2", and R3) and routing-volatility metrics.

megatron-core's `TransformerConfig(moe_enable_routing_replay=True)` gives every TopKRouter a `router_replay`
object whose action (RECORD / REPLAY_FORWARD / REPLAY_BACKWARD) decides the top-k. This module drives it per
model:

1. `RoutingController(model)` swaps each router's replay object for `_LayerReplay`, a subclass bound to that
   router only, and removes megatron's from `RouterReplay.global_router_replay_instances`. That list is
   class-level and shared by every model built with the flag (policy, reference, a second seed...); its static
   setters would drive all of them at once. Nothing here touches the global list's API.
2. Modes: "free" (the router chooses; nothing kept), "record" (the router chooses; the choice is kept and read with
   `routes()`), "replay" (the given `Routes` are forced). Under replay the gate weights are still a softmax over
   the *current* router logits of the forced experts (megatron gathers the logits at the forced indices, then the
   softmax of `topk_routing_with_score_function` runs over them), so the router keeps learning: PAPER.md's
   requirement, checked in tests/study/policy/test_routing.py.
3. In record and replay modes every router also keeps the top-k it would have chosen freely (`free_routes()`),
   so routing volatility can be measured on the very forward pass that was replayed, and a reference to the scores
   it ranked (`router_entropy()`: the entropy of its softmax over all experts, computed only when asked).
4. Replay without routes, or with routes of another batch shape, layer count or top-k, raises. There is no silent
   fallback to free routing.

Token layout: megatron routes (S*B) tokens in sequence-major order; `Routes` stores them sample-major, (B, S, L, k),
so `routes[idx]` follows any re-split of the batch along B. Routing of a token depends on that token only (no
capacity factor, no token dropping), which is what makes the re-split valid.

Sequence parallelism (tensor parallelism > 1; build_policy(parallel=...) turns it on): the embedding splits megatron's
[S, B, H] activations along S into TP contiguous chunks (megatron/core/tensor_parallel/mappings.py
`_split_along_first_dim`, and the reduce-scatter of the vocabulary-parallel embedding: TP rank r keeps sequence
positions r*S/TP .. (r+1)*S/TP - 1 of every row), so each rank's routers see (S/TP * B) tokens, which are rows
r*S*B/TP .. (r+1)*S*B/TP - 1 of the one-process (S*B) sequence-major order. Hence, with S divisible by TP (megatron
asserts it):
- replay hands each rank's routers that slice of the full routes (no communication);
- `routes()`, `free_routes()` and `router_entropy()` all-gather each layer's (S/TP * B) rows over the tensor-parallel
  group back to the one-process (B, S, L, k) / (B, S, L): collectives, so every rank of the TP group must call them
  in the same order (the RL loop does). The metrics computed from them (volatility, expert load, entropy) are then
  over all tokens, the same on every rank.
Under expert parallelism alone (or data parallelism) every router sees whole sequences of its rank's rows: nothing to
gather here (the RL loop gathers rows over the data-parallel ranks, study/policy/parallel.py `gather_rows`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from study.core.model_config import route_index_dtype

Mode = Literal["free", "record", "replay"]
MODES: tuple[str, ...] = ("free", "record", "replay")


@dataclass(frozen=True)
class Routes:
    """Top-k expert ids per token and MoE layer: `experts` (B, S, L, k), compact integers.

    Index it like the batch: `routes[idx]` (idx over B, e.g. a minibatch's sample indices) keeps (B', S, L, k);
    `routes[idx, :s]` also trims the sequence. Order within the k slots is the router's (descending score) and is
    irrelevant to replay and to the metrics.
    """

    experts: torch.Tensor  # (B, S, L, k)

    def __post_init__(self) -> None:
        if self.experts.dim() != 4:
            raise ValueError(f"Routes.experts must be (B, S, layers, k), got shape {tuple(self.experts.shape)}")
        if self.experts.dtype.is_floating_point or self.experts.dtype == torch.bool:
            raise ValueError(f"Routes.experts must be an integer tensor, got {self.experts.dtype}")

    def __getitem__(self, idx: Any) -> Routes:
        if not isinstance(idx, tuple):
            idx = (idx,)
        if len(idx) > 2:
            raise IndexError("Routes index over (batch, sequence) only")
        if any(isinstance(i, int) for i in idx):
            idx = tuple(slice(i, i + 1) if isinstance(i, int) else i for i in idx)  # keep 4 dims
        return Routes(self.experts[idx])

    def __len__(self) -> int:
        return self.experts.shape[0]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, S, layers, k)."""
        b, s, n_layers, k = self.experts.shape
        return b, s, n_layers, k

    @property
    def num_layers(self) -> int:
        return self.experts.shape[2]

    @property
    def top_k(self) -> int:
        return self.experts.shape[3]

    def to(self, device: torch.device | str) -> Routes:
        return Routes(self.experts.to(device))

    @staticmethod
    def cat(parts: Sequence[Routes]) -> Routes:
        """Concatenate along the batch."""
        return Routes(torch.cat([p.experts for p in parts], dim=0))

    @staticmethod
    def from_layers(per_layer: Sequence[torch.Tensor], batch: int, seq: int, num_experts: int) -> Routes:
        """From megatron's per-layer (S*B, k) indices (sequence-major) to (B, S, L, k)."""
        layers = [t.detach().reshape(seq, batch, -1).transpose(0, 1) for t in per_layer]  # (B, S, k) each
        return Routes(torch.stack(layers, dim=2).to(route_index_dtype(num_experts)).cpu())  # (B, S, L, k)

    def layer_tokens(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer `layer` in megatron's token order: (S*B, k) int64."""
        b, s, _, k = self.shape
        return self.experts[:, :, layer].transpose(0, 1).reshape(s * b, k).to(device=device, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------------------------
# Per-router replay object
# ---------------------------------------------------------------------------------------------------------------------
def _router_replay_classes() -> tuple[type, Any]:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


def _make_layer_replay_class() -> type:
    RouterReplay, Action = _router_replay_classes()

    class _LayerReplay(RouterReplay):
        """megatron's RouterReplay for one router, kept out of the class-level instance list, strict about
        missing routes, and keeping the free top-k in record and replay modes."""

        def __init__(self) -> None:  # deliberately not super().__init__(): it appends to the global list
            self.target_topk_idx: torch.Tensor | None = None  # (S*B, k) int64, forced experts
            self.recorded_topk_idx: torch.Tensor | None = None  # (S*B, k), experts used by the last forward
            self.free_topk_idx: torch.Tensor | None = None  # (S*B, k), experts free routing would have chosen
            self.router_scores: torch.Tensor | None = None  # (S*B, E) detached, the scores top-k ranked
            self.scores_kind: str | None = None  # "logits" / "probs" (pre-softmax) / None (no softmax router)
            self.router_replay_action = None
            self.replay_backward_list: list[torch.Tensor] = []
            self.layer = -1

        def set_target_indices(self, topk_indices: torch.Tensor) -> None:
            # megatron's version also appends to replay_backward_list (for activation recompute, unused here),
            # which would grow by one tensor per replayed batch.
            self.target_topk_idx = topk_indices

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            action = self.router_replay_action
            if action is None:
                return default_compute_topk(scores, topk, num_groups, group_topk)
            if action == Action.RECORD:
                probs, top = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                self.recorded_topk_idx = self.free_topk_idx = top.detach()
                self.router_scores = scores.detach()  # a reference, no copy: the entropy is computed on request
                return probs, top
            if action == Action.REPLAY_FORWARD:
                target = self.target_topk_idx
                if target is None:
                    raise RuntimeError(f"routing replay: no routes set for MoE layer {self.layer}")
                if tuple(target.shape) != (scores.shape[0], topk):
                    raise RuntimeError(
                        f"routing replay: MoE layer {self.layer} routes {tuple(target.shape)} do not match the "
                        f"{scores.shape[0]} tokens x top-{topk} of this forward"
                    )
                with torch.no_grad():
                    _, free = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
                self.free_topk_idx = free
                self.router_scores = scores.detach()
                # megatron: probs = scores.gather(1, target); the caller then softmaxes over the k gathered logits.
                probs, top = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
                self.recorded_topk_idx = top
                return probs, top
            raise RuntimeError(f"routing replay: action {action} is not supported (no activation recompute here)")

    return _LayerReplay


_LAYER_REPLAY_CLASS: type | None = None


def _layer_replay_class() -> type:
    global _LAYER_REPLAY_CLASS
    if _LAYER_REPLAY_CLASS is None:
        _LAYER_REPLAY_CLASS = _make_layer_replay_class()
    return _LAYER_REPLAY_CLASS


# ---------------------------------------------------------------------------------------------------------------------
# Controller
# ---------------------------------------------------------------------------------------------------------------------
class RoutingController:
    """Routing mode of one model (free / record / replay). Bind it once: `ctl = RoutingController(model)`.

    Typical RL use (Routing Replay):
        with torch.no_grad(), ctl.recording():             # pi_old recompute
            old_logp = token_logp(model, ids, targets)
        routes = ctl.routes()                              # (B, S, L, k)
        for idx in minibatches:
            with ctl.replaying(routes[idx]):               # pi_theta, same experts
                logp = token_logp(model, ids[idx], targets[idx])
            free = ctl.free_routes()                       # what the router would choose now
    Several controllers on one model share its state (the mode lives on the routers).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        RouterReplay, _ = _router_replay_classes()
        layer_cls = _layer_replay_class()
        self.model = model
        self.routers: list[Any] = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ValueError("model has no MoE routers (TopKRouter)")
        for i, router in enumerate(self.routers):
            replay = router.router_replay
            if replay is None:
                raise ValueError(
                    "model was built without routing replay: build_policy(..., routing_replay=True) "
                    "(TransformerConfig.moe_enable_routing_replay)"
                )
            if not isinstance(replay, layer_cls):
                instances = RouterReplay.global_router_replay_instances
                for j in reversed(range(len(instances))):
                    if instances[j] is replay:
                        del instances[j]
                router.router_replay = layer_cls()
            router.router_replay.layer = i
            router.router_replay.scores_kind = _scores_kind(router)
        self.num_experts: int = int(self.routers[0].config.num_moe_experts)
        self.top_k: int = int(self.routers[0].topk)
        self._sp_group, self._sp_size, self._sp_rank = _sequence_parallel_group(self.routers[0].config)
        if not hasattr(model, "_study_routing"):
            model._study_routing = _ModelState()
            model.register_forward_pre_hook(_pre_forward, with_kwargs=True)
        self._state: _ModelState = model._study_routing

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def _replays(self) -> list[Any]:
        return [r.router_replay for r in self.routers]

    @property
    def mode(self) -> Mode:
        _, Action = _router_replay_classes()
        action = self._replays[0].router_replay_action
        return {None: "free", Action.RECORD: "record", Action.REPLAY_FORWARD: "replay"}[action]

    # -- mode setters ------------------------------------------------------------------------------------------------
    def free(self) -> None:
        """Free routing, nothing kept (rollouts, evaluation)."""
        self._set(None, None)

    def record(self) -> None:
        """Free routing; the experts of every forward are kept until the next one (`routes()`)."""
        _, Action = _router_replay_classes()
        self._set(Action.RECORD, None)

    def replay(self, routes: Routes) -> None:
        """Force `routes` (B, S, L, k) in every following forward, whose input must be (B, S)."""
        if not isinstance(routes, Routes):
            raise TypeError(f"routes must be Routes, got {type(routes).__name__}")
        b, s, n_layers, k = routes.shape
        if s % self._sp_size:
            raise ValueError(
                f"routes of a sequence of {s} under sequence parallelism over {self._sp_size} ranks: "
                f"the sequence length must be divisible by parallel.tensor = {self._sp_size}"
            )
        if n_layers != self.num_layers or k != self.top_k:
            raise ValueError(
                f"routes have {n_layers} layers x top-{k}, the model {self.num_layers} layers x top-{self.top_k}"
            )
        if routes.experts.numel() and int(routes.experts.max()) >= self.num_experts:
            raise ValueError(f"routes name expert {int(routes.experts.max())}; the model has {self.num_experts}")
        _, Action = _router_replay_classes()
        device = self.routers[0].weight.device
        share = s * b // self._sp_size  # this rank's rows of the sequence-major order (module doc)
        rows = slice(self._sp_rank * share, (self._sp_rank + 1) * share)
        for layer, replay in enumerate(self._replays):
            replay.set_target_indices(routes.layer_tokens(layer, device)[rows])
        self._set(Action.REPLAY_FORWARD, (b, s))

    def _set(self, action: Any, replay_shape: tuple[int, int] | None) -> None:
        for replay in self._replays:
            replay.router_replay_action = action
            replay.recorded_topk_idx = replay.free_topk_idx = replay.router_scores = None
            if replay_shape is None:
                replay.target_topk_idx = None
        self._state.active = action is not None
        self._state.replay_shape = replay_shape
        self._state.result_shape = None

    # -- context managers --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator[RoutingController]:
        """Record inside the block, free routing after it."""
        self.record()
        try:
            yield self
        finally:
            self._keep_results_then_free()

    @contextlib.contextmanager
    def replaying(self, routes: Routes) -> Iterator[RoutingController]:
        """Replay `routes` inside the block, free routing after it."""
        self.replay(routes)
        try:
            yield self
        finally:
            self._keep_results_then_free()

    def _keep_results_then_free(self) -> None:
        for replay in self._replays:
            replay.router_replay_action = None
            replay.target_topk_idx = None
        self._state.active = False
        self._state.replay_shape = None

    # -- results -----------------------------------------------------------------------------------------------------
    def routes(self) -> Routes:
        """Experts used by the last forward in record or replay mode (B, S, L, k)."""
        return self._collect("recorded_topk_idx", "routes()")

    def free_routes(self) -> Routes:
        """Experts free routing would have chosen in the last forward in record or replay mode (B, S, L, k)."""
        return self._collect("free_topk_idx", "free_routes()")

    def _collect(self, attr: str, what: str) -> Routes:
        per_layer = self._full_layers([getattr(r, attr) for r in self._replays], what)
        b, s = self._state.result_shape
        return Routes.from_layers(per_layer, b, s, self.num_experts)

    def _full_layers(self, per_layer: list[torch.Tensor | None], what: str) -> list[torch.Tensor]:
        """Each layer's (S*B, ...) rows of the last forward in one-process order: this rank's own, or under sequence
        parallelism every tensor-parallel rank's share all-gathered (a collective: module doc)."""
        shape = self._state.result_shape
        if any(t is None for t in per_layer) or shape is None:
            raise RuntimeError(f"{what}: no forward ran in record or replay mode since the mode was set")
        b, s = shape
        if any(t.shape[0] * self._sp_size != b * s for t in per_layer):
            raise RuntimeError(
                f"{what}: routers saw a different token count than the last input {shape}"
                + (f" split over {self._sp_size} sequence-parallel ranks" if self._sp_size > 1 else "")
            )
        if self._sp_size == 1:
            return per_layer
        return _gather_first_dim(per_layer, self._sp_group)

    def router_entropy(self) -> torch.Tensor:
        """Entropy (nats) of each token's router softmax over all experts in the last forward in record or replay
        mode: (B, S, L) fp32 on the CPU, sample-major like `routes()`. NaN for routers without a softmax score
        function (sigmoid)."""
        scores = [r.router_scores for r in self._replays]
        if any(t is None for t in scores) or self._state.result_shape is None:
            raise RuntimeError("router_entropy(): no forward ran in record or replay mode since the mode was set")
        with torch.no_grad():
            local = [_entropy(t, r.scores_kind) for t, r in zip(scores, self._replays, strict=True)]  # (S*B/TP,)
        b, s = self._state.result_shape
        per_layer = [t.reshape(s, b).transpose(0, 1) for t in self._full_layers(local, "router_entropy()")]
        return torch.stack(per_layer, dim=2).cpu()  # (B, S, L)


def _sequence_parallel_group(config: Any) -> tuple[Any, int, int]:
    """(group, size, rank) of the tensor-parallel group the routers' tokens are split over: (None, 1, 0) without
    sequence parallelism."""
    if not getattr(config, "sequence_parallel", False) or config.tensor_model_parallel_size == 1:
        return None, 1, 0
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    return group, torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _gather_first_dim(tensors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Each tensor all-gathered over `group` and concatenated along dim 0 in rank order; one collective for all of
    them (they share dtype and trailing shape per call), through the GPU under NCCL."""
    from study.policy.parallel import _all_gather, _comm_device

    stacked = torch.stack([t.detach() for t in tensors])  # (L, n, ...)
    pieces = _all_gather(stacked.to(_comm_device(stacked.device)), group)
    full = torch.cat(pieces, dim=1).to(tensors[0].device)  # (L, n * size, ...)
    return list(full.unbind(0))


def _scores_kind(router: Any) -> str | None:
    """What megatron hands the top-k (and so the replay hook) as scores: the logits, or with
    `moe_router_pre_softmax` the softmax itself; None when the score function is not a softmax."""
    if getattr(router, "score_function", "softmax") != "softmax":
        return None
    return "probs" if router.config.moe_router_pre_softmax else "logits"


def _entropy(scores: torch.Tensor, kind: str | None) -> torch.Tensor:
    """(N, E) router scores -> (N,) fp32 entropy of the softmax over the E experts."""
    if kind == "logits":
        logp = torch.log_softmax(scores.float(), dim=-1)
        return -(logp.exp() * logp).sum(-1)
    if kind == "probs":
        return torch.special.entr(scores.float()).sum(-1)
    return torch.full(scores.shape[:1], math.nan, device=scores.device)


@dataclass
class _ModelState:
    """Routing state shared by every controller of one model (kept on the model as `_study_routing`)."""

    active: bool = False  # record or replay mode
    replay_shape: tuple[int, int] | None = None  # (B, S) the forced routes are for
    result_shape: tuple[int, int] | None = None  # (B, S) of the last forward in record or replay mode


def _pre_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Check a replayed forward's batch shape against its routes; remember the (B, S) of recorded results."""
    state: _ModelState = model._study_routing
    input_ids = args[0] if args else kwargs.get("input_ids")
    if input_ids is None or not state.active:
        return
    shape = (int(input_ids.shape[0]), int(input_ids.shape[1]))
    if state.replay_shape is not None and shape != state.replay_shape:
        raise RuntimeError(
            f"routing replay: routes are for a (B, S) = {state.replay_shape} batch, the input is {shape}"
        )
    state.result_shape = shape


# ---------------------------------------------------------------------------------------------------------------------
# Volatility metrics (PAPER.md, "Metric definitions")
# ---------------------------------------------------------------------------------------------------------------------
def _as_tensor(r: Routes | torch.Tensor) -> torch.Tensor:
    return r.experts if isinstance(r, Routes) else r


def routing_volatility(
    x: Routes | torch.Tensor,
    y: Routes | torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    per_layer: bool = True,
) -> dict[str, float]:
    """Routing volatility between two routings of the same tokens, over the tokens where `mask` (B, S) is true.

    slot_mismatch = mean(1 - |S_X & S_Y| / k); set_flip_rate = mean(S_X != S_Y), both over (token, layer);
    token_flip_rate = mean over tokens of any layer flipped; with `per_layer`, the same two per layer as
    `slot_mismatch_l{i}` / `set_flip_rate_l{i}`. No tokens gives zeros and tokens = 0.
    """
    ex, ey = _as_tensor(x), _as_tensor(y)
    if ex.shape != ey.shape or ex.dim() != 4:
        raise ValueError(f"routings must have one (B, S, L, k) shape, got {tuple(ex.shape)} and {tuple(ey.shape)}")
    b, s, n_layers, k = ex.shape
    if mask is None:
        mask = torch.ones(b, s, dtype=torch.bool)
    if mask.shape != (b, s):
        raise ValueError(f"mask shape {tuple(mask.shape)} != routes (B, S) = {(b, s)}")
    sel = mask.to(ex.device).bool()  # (B, S)
    ex, ey = ex[sel].long(), ey[sel].long()  # (N, L, k)
    # |S_X & S_Y| per (token, layer): slots of X found anywhere in Y (ids within one set are distinct).
    overlap = (ex[..., :, None] == ey[..., None, :]).any(-1).sum(-1).float()  # (N, L)
    mismatch = 1.0 - overlap / k  # (N, L)
    flipped = (overlap < k).float()  # (N, L)  S_X != S_Y
    n = ex.shape[0]
    out = {
        "slot_mismatch": float(mismatch.mean()) if n else 0.0,
        "set_flip_rate": float(flipped.mean()) if n else 0.0,
        "token_flip_rate": float(flipped.amax(-1).mean()) if n else 0.0,
        "tokens": float(n),
    }
    if per_layer:
        for layer in range(n_layers):
            out[f"slot_mismatch_l{layer}"] = float(mismatch[:, layer].mean()) if n else 0.0
            out[f"set_flip_rate_l{layer}"] = float(flipped[:, layer].mean()) if n else 0.0
    return out


def response_inputs(pos: torch.Tensor, mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B, S) bool: the input positions whose forward gives a response token's log-prob, from a batch's `pos` (B, T)
    (the index into the (B, S) targets of response token t) and response `mask` (B, T): the last prompt token and
    every response token but the last. Over these a changed expert changes a log-prob of the loss directly (a
    changed expert at any earlier position reaches them through attention too)."""
    out = torch.zeros(pos.shape[0], seq_len, dtype=torch.bool)
    rows = torch.arange(pos.shape[0])[:, None].expand_as(pos)  # (B, T)
    sel = mask.bool()
    out[rows[sel], pos[sel]] = True
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Expert load
# ---------------------------------------------------------------------------------------------------------------------
def _selected(x: Routes | torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The (B, S, ...) rows of x where mask (B, S) is true: (N, ...)."""
    if mask is None:
        return x.reshape(-1, *x.shape[2:])
    if tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"mask shape {tuple(mask.shape)} != (B, S) = {tuple(x.shape[:2])}")
    return x[mask.to(x.device).bool()]


def load_imbalance(routes: Routes | torch.Tensor, num_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per MoE layer, max over experts of the tokens routed to it over the mean over all `num_experts` experts
    (N k / E), over the tokens where `mask` (B, S) is true and every one of their k slots: (L,) float64, NaN with
    no tokens. 1 when every expert gets the same count; E / k when every token goes to the same k experts."""
    sel = _selected(_as_tensor(routes), mask).long()  # (N, L, k)
    n, n_layers, k = sel.shape
    if n == 0:
        return torch.full((n_layers,), math.nan, dtype=torch.float64)
    lo, hi = (int(v) for v in torch.aminmax(sel))
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"routes name experts {lo}..{hi}; there are {num_experts}")
    flat = (sel + num_experts * torch.arange(n_layers, device=sel.device)[:, None]).reshape(-1)
    counts = torch.bincount(flat, minlength=n_layers * num_experts).view(n_layers, num_experts)
    return counts.amax(1).double().cpu() / (n * k / num_experts)


def mean_router_entropy(entropy: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per MoE layer, the mean over the tokens where `mask` (B, S) is true of the (B, S, L) per-token router
    entropies (`RoutingController.router_entropy()`): (L,) float64, NaN with no tokens."""
    sel = _selected(entropy, mask).double()  # (N, L)
    if sel.shape[0] == 0:
        return torch.full(sel.shape[1:], math.nan, dtype=torch.float64)
    return sel.mean(0).cpu()


def expert_load(
    routes: Routes | torch.Tensor,
    num_experts: int,
    mask: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> dict[str, float]:
    """`expert_load_imbalance` (`load_imbalance`) and `router_entropy` (`mean_router_entropy`) of one routing over the
    tokens where `mask` (B, S) is true: each the mean over layers, and per layer as `{name}_l{layer}`;
    `router_entropy` only when the per-token `entropy` (B, S, L) is given."""
    values = {"expert_load_imbalance": load_imbalance(routes, num_experts, mask)}
    if entropy is not None:
        values["router_entropy"] = mean_router_entropy(entropy, mask)
    out: dict[str, float] = {}
    for name, per_layer in values.items():
        out[name] = float(per_layer.mean())
        out.update({f"{name}_l{layer}": float(v) for layer, v in enumerate(per_layer.tolist())})
    return out


__all__ = [
    "MODES",
    "Routes",
    "RoutingController",
    "expert_load",
    "load_imbalance",
    "mean_router_entropy",
    "response_inputs",
    "routing_volatility",
]
