"""Training-inference mismatch corrections that compose with any loss.

rho_t = pi_train_old(y_t) / pi_rollout(y_t): the training engine's pi_old over the inference engine's sampling
probability (delta_t = old_logp - rollout_logp in log space).
- token TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
  every token's term multiplied by min(rho_t, C), C = 2;
- sequence MIS (masked importance sampling, Liu et al. 2025 "When speed kills stability"): a sequence whose
  prod_t rho_t lies outside [1/C, C], C = 3, is dropped;
- IcePop (Ling team, Ring-1T, arXiv 2510.18855): tokens with rho_t outside [0.5, 5] are dropped.

How they compose: each correction is a detached, non-negative weight per token (or per sequence) multiplied into the
advantage before the wrapped loss sees it. Every loss here is positively homogeneous in A per token
(min(w cA, clip(w) cA) = c min(w A, clip(w) A) for c >= 0), so this is exactly "multiply the token's term by the
weight" while the normalisers (|y_i|, G, token counts) stay those of the uncorrected loss. Token-level weights need a
loss that accepts (B, T) advantages: they refuse to wrap a loss with a sequence-level ratio. A corrected loss has
the ratio level of the loss it wraps.

    register("grpo_tis", label="GRPO + TIS")(with_tis(grpo_loss))
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from algorithms.common import check_inputs, per_token, token_mean
from algorithms.registry import LOSS_INPUTS, LossFn, Range, hparam_parameters

if TYPE_CHECKING:
    import torch

WeightFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def _delta(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log rho_t = old_logp - rollout_logp on response tokens, 0 on padding (B, T)."""
    import torch

    return torch.where(mask.bool(), old_logp.float() - rollout_logp.float(), 0.0)


def _compose(loss_fn: LossFn, level: str, name: str, params: dict[str, tuple[Any, float]], weights: WeightFn) -> LossFn:
    """Wrap `loss_fn` so its advantages are scaled by `weights(...)`, adding `params` as hyper-parameters."""
    inner_level = getattr(loss_fn, "ratio_level", "token")
    if level == "token" and inner_level == "sequence":
        raise ValueError(
            f"{name}: a token-level correction cannot wrap a sequence-level ratio ({loss_fn.__name__}); use with_mis, "
            "or a token-level loss such as gspo_token"
        )
    signature = inspect.signature(loss_fn)
    taken = set(signature.parameters) & set(params)
    if taken:
        raise ValueError(f"{name}: hyper-parameter name(s) {sorted(taken)} already used by {loss_fn.__name__}")
    inner_needs_rollout = bool(getattr(loss_fn, "needs_rollout_logp", False))

    def corrected(logp, old_logp, advantages, mask, *, rollout_logp=None, **kwargs):  # typed by its __signature__
        import torch

        if rollout_logp is None:
            raise ValueError(f"{name} needs rollout_logp (B, T): the inference engine's log-probs")
        check_inputs(logp, old_logp, advantages, mask)
        if rollout_logp.shape != logp.shape:
            raise ValueError(f"rollout_logp shape {tuple(rollout_logp.shape)} != logp shape {tuple(logp.shape)}")
        own = {k: kwargs.pop(k, default) for k, (_, default) in params.items()}
        with torch.no_grad():
            w, extra = weights(_delta(old_logp, rollout_logp, mask), mask, **own)
            if w.dim() == 1:  # sequence weights (B,) keep the advantages' shape
                adv = advantages.float() * (w if advantages.dim() == 1 else w[:, None])
            else:  # token weights (B, T)
                adv = per_token(advantages, mask) * w
        if inner_needs_rollout:
            kwargs["rollout_logp"] = rollout_logp
        loss, metrics = loss_fn(logp, old_logp, adv, mask, **kwargs)
        values = torch.stack([v.float().reshape(()) for v in extra.values()]).tolist()
        return loss, {**metrics, **dict(zip(extra, values, strict=True))}

    # its signature: the loss's inputs and hyper-parameters (annotations evaluated: Range stays readable), `params`
    hparams = {p.name: p for p in hparam_parameters(loss_fn)}
    keyword = [(k, annotation, default) for k, (annotation, default) in params.items()]
    keyword.append(("rollout_logp", "torch.Tensor | None", None))
    corrected.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[hparams.get(p.name, p) for p in signature.parameters.values() if p.name not in LOSS_INPUTS]
        + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a) for k, a, d in keyword]
    )
    corrected.__name__ = corrected.__qualname__ = f"{loss_fn.__name__}_{name.lower()}"
    corrected.__module__ = loss_fn.__module__
    corrected.needs_rollout_logp = True  # type: ignore[attr-defined]
    corrected.ratio_level = inner_level  # type: ignore[attr-defined]
    return corrected


def _tis(delta: torch.Tensor, mask: torch.Tensor, *, tis_c: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    weight = delta.clamp(max=math.log(tis_c)).exp()  # min(rho_t, C), in log space to avoid overflow
    return weight, {
        "tis_weight_mean": token_mean(weight, mask),
        "tis_trunc_frac": token_mean((delta > math.log(tis_c)).float(), mask),
    }


def _mis(delta: torch.Tensor, mask: torch.Tensor, *, mis_c: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_prod = delta.sum(-1)  # (B,)  log prod_t rho_t
    keep = (log_prod.abs() <= math.log(mis_c)).float()  # prod rho in [1/C, C]
    return keep, {"mis_reject_frac": token_mean((1.0 - keep)[:, None].expand(mask.shape), mask)}


def _icepop(
    delta: torch.Tensor, mask: torch.Tensor, *, icepop_low: float, icepop_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    keep = ((delta >= math.log(icepop_low)) & (delta <= math.log(icepop_high))).float()  # (B, T)
    return keep, {"icepop_mask_frac": token_mean(1.0 - keep, mask)}


def with_tis(loss_fn: LossFn) -> LossFn:
    """Token-level truncated importance sampling: each token's term times min(rho_t, tis_c)."""
    return _compose(loss_fn, "token", "TIS", {"tis_c": (Annotated[float, Range(gt=0.0)], 2.0)}, _tis)


def with_mis(loss_fn: LossFn) -> LossFn:
    """Sequence-level masked importance sampling: drop sequences with prod rho outside [1/mis_c, mis_c]."""
    return _compose(loss_fn, "sequence", "MIS", {"mis_c": (Annotated[float, Range(gt=1.0)], 3.0)}, _mis)


def with_icepop(loss_fn: LossFn) -> LossFn:
    """IcePop: drop tokens whose rho_t lies outside [icepop_low, icepop_high]."""
    params = {
        "icepop_low": (Annotated[float, Range(gt=0.0, le=1.0)], 0.5),
        "icepop_high": (Annotated[float, Range(ge=1.0)], 5.0),
    }
    return _compose(loss_fn, "token", "IcePop", params, _icepop)
