"""`hf` rollout engine: transformers' Qwen3MoeForCausalLM built from the same ModelConfig, sampled with a tight
KV-cache loop (left-padded batch, one forward per new token).

Why a hand loop and not `model.generate`: it returns the sampled tokens' raw log-probs without materialising the
(steps, N, V) score tensors, records routed experts from router hooks at no extra forward, and its random stream is
one `torch.Generator` seeded per call, so a (seed, prompts, weights) triple always gives the same samples.

Routed experts (R3) come from forward hooks on every layer's `mlp.gate` (Qwen3MoeTopKRouter returns
(router_logits, gate_weights, expert_indices), indices (tokens, k) in descending gate weight) in the prefill, and
from the decode step itself.

The prefill runs transformers' model once per prompt; its samples start from copies of that cache. The decode steps
after it run, in order of preference:
- `_NativeStep`: the sampling loop and every decode step in C (study/kernels/decode.py), fp32 on the CPU, where
  the fused step below runs and the optional kernels apply (study/kernels/__init__.py). Logits agree with the
  modules' to ~1e-6 and the same tokens are sampled (tests/study/rollout); 3x faster than the fused step on a tiny
  8 x 4 x 32 rollout;
- `_FusedDecoder`: the same arithmetic as the model's decoder layers written out on their parameters with fewer
  ops (bit-identical; 25-40% off a tiny 8 x 4 x 32 rollout, docs/performance.md);
- the decoder layers themselves where neither would be exact (emulated precisions, hooks, another attention).

`router_noise` > 0 (a run's `engine_router_noise`) adds Gaussian noise to every router's logits in `generate` (a
hook on each router, so the decoder layers run): the engine routes differently from the trainer at the same
weights, a train/inference routing mismatch the trainer does not have. `score` routes without it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from study.core.model_config import TORCH_DTYPES, ModelConfig, route_index_dtype
from study.core.weights import hf_config, hf_param_names
from study.rollout.base import Rollout, RolloutEngine, Sampling, register_engine

NOISE_SEED_OFFSET = 0x9E3779B97F4A7C15
"""Added to a `generate` call's seed to seed its router noise (`router_noise`), a stream apart from the sampling's."""

try:  # the optional C kernels: without study/kernels/ the fused torch step runs
    from study import kernels
    from study.kernels import decode as c_decode
except ImportError:
    kernels = c_decode = None


def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM takes experts of `dtype` on `device_type`: on CUDA bf16 only (the dtype torch
    documents for its CUDA kernel; transformers' own check passes any dtype there); on the CPU any."""
    return device_type != "cuda" or dtype == torch.bfloat16


def experts_implementation_for(device_type: str, dtype: torch.dtype) -> str | None:
    """The experts' implementation the engine asks transformers for: its default (None: `grouped_mm`) where torch's
    grouped GEMM takes the weights, else `eager` (a GEMM per expert: CUDA in fp32 or fp16)."""
    return None if grouped_mm_supported(device_type, dtype) else "eager"


def build_hf_model(cfg: ModelConfig, dtype: str = "fp32", *, experts_implementation: str | None = None):
    """A randomly initialised transformers Qwen3MoeForCausalLM with the shape of `cfg`, in eval mode."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kwargs = {k: v for k, v in hf_config(cfg, dtype).items() if k not in ("architectures", "model_type", "torch_dtype")}
    hcfg = Qwen3MoeConfig(**kwargs)
    hcfg._attn_implementation = _register_decode_attention()
    if experts_implementation is not None:
        hcfg._experts_implementation = experts_implementation
    model = Qwen3MoeForCausalLM(hcfg).to(TORCH_DTYPES[dtype]).eval()
    model.requires_grad_(False)
    return model


def fuse_experts(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF checkpoint names (per-expert gate/up/down) -> transformers' in-memory names (stacked expert tensors):
    mlp.experts.gate_up_proj (E, 2F, H) = [gate_e; up_e] per expert, mlp.experts.down_proj (E, H, F)."""
    missing = set(hf_param_names(cfg)) - set(hf_state)
    if missing:
        raise KeyError(f"HF state dict lacks {len(missing)} tensors, e.g. {sorted(missing)[:4]}")
    out = {k: v for k, v in hf_state.items() if ".mlp.experts." not in k}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack(
            [
                torch.cat([hf_state[f"{p}{e}.gate_proj.weight"], hf_state[f"{p}{e}.up_proj.weight"]])
                for e in range(cfg.num_experts)
            ]
        )  # (E, 2F, H)
        out[p + "down_proj"] = torch.stack([hf_state[f"{p}{e}.down_proj.weight"] for e in range(cfg.num_experts)])
    return out


def unfuse_experts(model_state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' in-memory names (stacked experts) -> HF checkpoint names (per-expert gate/up/down), cloned."""
    F = cfg.moe_ffn_hidden_size
    out = {k: v.detach().clone() for k, v in model_state.items() if ".mlp.experts." not in k}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up, down = model_state[p + "gate_up_proj"], model_state[p + "down_proj"]  # (E, 2F, H), (E, H, F)
        for e in range(cfg.num_experts):
            out[f"{p}{e}.gate_proj.weight"] = gate_up[e, :F].detach().clone()
            out[f"{p}{e}.up_proj.weight"] = gate_up[e, F:].detach().clone()
            out[f"{p}{e}.down_proj.weight"] = down[e].detach().clone()
    return out


def sample(logits: torch.Tensor, logp: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """One token per row of `logits` (N, V) at `temperature` (0 = argmax); `logp` = `sampling_logp(logits,
    temperature)`, the log-probs of the distribution drawn from.

    Inverse CDF with one uniform per row: the first index whose cumulative probability (fp64) exceeds u x total.
    It draws from the same distribution as vLLM's exponential race (argmax p_v / E_v, E_v ~ Exp(1)), at 1/16 of its
    cost on CPU: the race needs V exponentials per row, and `exponential_` was 26% of a 32 x 8 x 64 tiny rollout.
    """
    if temperature == 0:
        return logits.argmax(-1)
    probs = logp.double().exp_()
    cdf = probs.cumsum_(-1)  # (N, V)
    u = torch.rand(cdf.shape[0], 1, generator=gen, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


def sampling_logp(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature), the distribution an engine samples from (at temperature 0, greedy, and 1
    the raw logits' log-softmax, computed without a division)."""
    return torch.log_softmax(logits if temperature in (0.0, 1.0) else logits / temperature, dim=-1)


DECODE_ATTENTION = "study_decode"


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):  # type: ignore[no-untyped-def]
    """Attention for transformers' AttentionInterface: one-query decode steps by two batched matmuls, the rest SDPA.

    For a decode step (query length 1) transformers' `sdpa` path copies the whole KV cache every step: with a padding
    mask it cannot use SDPA's grouped-query mode and expands the keys and values to every query head (`repeat_kv`),
    and SDPA's CPU flash kernel copies the cache views again; together 35% of a tiny 32 x 8 x 64 rollout
    (docs/performance.md). Here the query heads are grouped under their key/value head (a view, no copy), the scores
    and softmax are fp32, and pad keys get -inf. Equal to `sdpa` to ~1e-7 (tests/study/rollout). Prefill, dropout and
    anything else go to transformers' `sdpa_attention_forward` unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    n, heads, _, d = query.shape
    q = query.float().view(n, key.shape[1], heads // key.shape[1], d)  # query head h reads key/value head h // group
    out = _grouped_decode_attention(q, key, value, attention_mask, d**-0.5 if scaling is None else scaling)
    return out.to(query.dtype).view(n, heads, 1, d).transpose(1, 2), None  # (n, 1, heads, d), no weights


def _grouped_decode_attention(q, key, value, attention_mask, scaling: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """`decode_attention`'s arithmetic on fp32 queries already grouped, (n, kv_heads, group, d): fp32 scores and
    softmax, pad keys -inf (`attention_mask` (n, 1, 1, L): bool True = attend, or additive float). Returns the fp32
    (n, kv_heads, group, d) output. The engine's fused decode step calls it too."""
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scaling)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores.add_(attention_mask)
    return torch.matmul(torch.softmax(scores, dim=-1), value.float())


@functools.cache
def _register_decode_attention() -> str:
    """Register `decode_attention` (and SDPA's mask format for it) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    return DECODE_ATTENTION


@functools.cache
def _growing_layer():  # type: ignore[no-untyped-def]
    """The cache layer class (built on first use: transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A DynamicLayer whose keys/values live in one buffer sized for the whole generation: appending a decode step
        writes a slice and returns a view, instead of re-concatenating the cache (the `cat`s were 20% of a rollout)."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            n, h, _, d = key_states.shape
            self._kbuf = key_states.new_empty(n, h, self.capacity, d)
            self._vbuf = value_states.new_empty(n, h, self.capacity, value_states.shape[-1])

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                raise RuntimeError(f"KV cache of {self.capacity} positions cannot take position {end}")
            self._kbuf[:, :, self.length : end] = key_states
            self._vbuf[:, :, self.length : end] = value_states
            self.set_length(end)
            return self.keys, self.values

        def set_length(self, length: int) -> None:
            """The first `length` positions of the buffers are the cache (a writer that filled them in place, such
            as the native decode loop, says so here)."""
            self.length = length
            self.keys, self.values = self._kbuf[:, :, :length], self._vbuf[:, :, :length]

        def repeat_rows(self, n: int) -> None:
            """Each row (sequence) of the cache n times in a row: a shared prompt's prefill becomes its samples'."""
            self._kbuf, self._vbuf = self._kbuf.repeat_interleave(n, dim=0), self._vbuf.repeat_interleave(n, dim=0)
            self.set_length(self.length)

    return GrowingLayer


class _Logits:
    """`.logits` of a decode step taken without the model's output wrappers."""

    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3MoeRMSNorm's arithmetic, op for op (fp32 statistics, `weight * normed.to(dtype)`)."""
    xf = x if x.dtype == torch.float32 else x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (normed if normed.dtype == x.dtype else normed.to(x.dtype))


class _FusedDecoder:
    """The decode step of `model` (a Qwen3MoeForCausalLM) as tensor ops on its own parameters: the same arithmetic,
    op for op, as its decoder layers with `decode_attention` and the `grouped_mm` experts, in ~40% fewer ops.

    At the tiny preset's decode sizes every op is a few microseconds of work and a few more of dispatch: the module
    calls, transformers' per-call checks, three projections where one GEMM over the concatenated weights does, the
    mask re-concatenated every step, `rotate_half`'s slices and concatenation (a `roll` here, with the sign folded
    into `sin`). Bit-identical to the module path in fp32 (tests/study/rollout compare the tokens and log-probs of whole
    rollouts); built per `generate` (so it always reads the current weights) and only for a real precision, the
    engine's `decode_attention` and the default rope (`eligible`); otherwise the engine calls the modules.
    """

    def __init__(self, model, n: int, attend: torch.Tensor | None, cache) -> None:  # type: ignore[no-untyped-def]
        """`attend`: (N, 1, 1, capacity) bool, False on pad keys (None: nothing padded); `cache`: the prefill's."""
        body, cfg = model.model, model.config
        self.model, self.body, self.cache, self.n, self.attend = model, body, cache, n, attend
        self.d, self.hq, self.hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.cos, self.sin = self.rope_tables(model, cache.layers[0].capacity)
        self.layers = []
        self.grouped_mm = self._grouped_mm(body.layers[0].mlp.experts)
        for layer in body.layers[: cfg.num_hidden_layers]:
            a, mlp = layer.self_attn, layer.mlp
            qkv, qk_norm = self.attention_weights(a, self.hq, self.hk)
            self.layers.append(
                (
                    layer.input_layernorm,
                    qkv,
                    qk_norm,
                    a.q_norm.variance_epsilon,
                    a.scaling,
                    a.o_proj.weight,
                    layer.post_attention_layernorm,
                    mlp.gate,
                    mlp.experts,
                )
            )

    @staticmethod
    def rope_tables(model, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
        """RoPE's cos and sin for every position the cache can hold, (capacity, d) each, from the model's rotary
        embedding (elementwise per position); sin carries rotate_half's sign, so rotate_half(x) * sin becomes
        roll(x, d / 2) * sin."""
        weight, d = model.model.embed_tokens.weight, model.config.head_dim
        cos, sin = model.model.rotary_emb(weight, torch.arange(capacity, device=weight.device)[None])
        return cos[0], torch.cat((-sin[0, :, : d // 2], sin[0, :, d // 2 :]), dim=-1)

    @staticmethod
    def attention_weights(attn, hq: int, hk: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
        """One attention module's q/k/v weights stacked ((hq + 2 hk) d, H: one GEMM for the three) and its q and k
        norm weights stacked per head ((hq + hk, d): one norm pass for both)."""
        d = attn.head_dim
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        return qkv, torch.cat([attn.q_norm.weight.expand(hq, d), attn.k_norm.weight.expand(hk, d)])

    @staticmethod
    def eligible(model, precision) -> bool:  # type: ignore[no-untyped-def]
        """Whether the fused step computes exactly what `model`'s modules would (else the engine calls them)."""
        cfg = model.config
        # a hook anywhere but on the modules the fused step still calls (the embedding, the LM head: an fp32 head's
        # upcast) would be skipped
        skip = ("model.embed_tokens", "lm_head")
        hooked = any(m._forward_hooks or m._forward_pre_hooks for n, m in model.named_modules() if n not in skip)
        return (
            not hooked
            and not precision.emulated  # emulated precisions round inside the modules' calls (hooks)
            and cfg._attn_implementation == DECODE_ATTENTION
            and cfg.rope_parameters.get("rope_type", "default") == "default"
            and not cfg.attention_bias
            and not cfg.mlp_only_layers
            and cfg.decoder_sparse_step == 1
        )

    @staticmethod
    def _grouped_mm(experts):  # type: ignore[no-untyped-def]
        """torch's grouped GEMM where transformers' `grouped_mm` experts call it on every input (gated, no bias, no
        expert parallelism, a torch whose CPU kernel takes any alignment); else None: the module is called."""
        from transformers.integrations import moe
        from transformers.utils.import_utils import is_torch_less_or_equal

        weight = experts.gate_up_proj
        # `_is_expert_parallel`: transformers >= 5.18 (5.16.1 to 5.17 shard no experts: the attribute is absent)
        if (
            experts.config._experts_implementation != "grouped_mm"
            or experts.has_bias
            or not experts.has_gate
            or experts.is_transposed
            or getattr(experts, "_is_expert_parallel", False)
            or is_torch_less_or_equal("2.10.0", True)
            or not grouped_mm_supported(weight.device.type, weight.dtype)
            or not moe._can_use_grouped_mm(weight, weight, None)
        ):
            return None
        return getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm

    def _experts(self, experts, h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """transformers' `grouped_mm_experts_forward`, op for op, without its per-call checks."""
        if self.grouped_mm is None:
            return experts(h, top_i, top_w)
        k = top_i.shape[-1]
        ids, perm = torch.sort(top_i.reshape(-1))
        rows = h[perm // k]
        counts_of = ids.float() if ids.device.type in ("cpu", "mps") else ids.int()  # what histc takes there
        offsets = torch.histc(counts_of, bins=experts.num_experts, min=0, max=experts.num_experts - 1)
        offsets = torch.cumsum(offsets, dim=0, dtype=torch.int32)
        gate_up = self.grouped_mm(rows, experts.gate_up_proj.transpose(-2, -1), offs=offsets)
        out = self.grouped_mm(experts._apply_gate(gate_up), experts.down_proj.transpose(-2, -1), offs=offsets)
        out = out * top_w.reshape(-1)[perm].unsqueeze(-1)
        unsorted = torch.empty_like(out)
        unsorted[perm] = out  # = out[inverse(perm)], transformers' restore
        return unsorted.view(h.shape[0], k, h.shape[-1]).sum(dim=1).to(h.dtype)

    def step(self, tok: torch.Tensor, position_ids: torch.Tensor, routes: list[list[torch.Tensor]] | None):
        """Logits (N, V) of the next token after the (N,) tokens `tok` at `position_ids` (N, 1); appends each
        layer's (N, 1, k) expert indices to routes[layer] (on the CPU) if given."""
        n, d, hq, hk = self.n, self.d, self.hq, self.hk
        x = self.body.embed_tokens(tok)  # (N, H)
        at = position_ids[:, 0]
        cos, sin = self.cos[at][:, None], self.sin[at][:, None]  # (N, 1, d)
        for i, (norm1, qkv_w, qk_norm, qk_eps, scaling, o_w, norm2, router, experts) in enumerate(self.layers):
            h = _rms(x, norm1.weight, norm1.variance_epsilon)
            qkv = torch.nn.functional.linear(h, qkv_w)  # (N, (hq + 2 hk) d)
            qk = _rms(qkv[:, : (hq + hk) * d].view(n, hq + hk, d), qk_norm, qk_eps)
            qk = (qk * cos) + (qk.roll(d // 2, dims=-1) * sin)  # RoPE: rotate_half(x) = roll(x) with sin's sign
            keys, values = self.cache.layers[i].update(qk[:, hq:, None], qkv[:, (hq + hk) * d :].view(n, hk, 1, d))
            mask = None if self.attend is None else self.attend[..., : keys.shape[2]]
            q = qk[:, :hq].float().reshape(n, hk, hq // hk, d)  # as decode_attention groups the query heads
            attn = _grouped_decode_attention(q, keys, values, mask, scaling).to(x.dtype).view(n, hq * d)
            x = x + torch.nn.functional.linear(attn, o_w)
            h = _rms(x, norm2.weight, norm2.variance_epsilon)
            # Qwen3MoeTopKRouter
            logits = torch.nn.functional.linear(h, router.weight)
            top_w, top_i = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
            if self.norm_topk:
                top_w /= top_w.sum(dim=-1, keepdim=True)
            if routes is not None:
                routes[i].append(top_i.reshape(n, 1, -1).to("cpu", route_index_dtype(experts.num_experts)))
            x = x + self._experts(experts, h, top_i, top_w.to(logits.dtype))
        return self.model.lm_head(_rms(x, self.body.norm.weight, self.body.norm.variance_epsilon))


class _NativeStep:
    """`_FusedDecoder`'s step and the engine's whole sampling loop in C (study/kernels/decode.py): the model's
    weights and the growing cache's buffers handed over as plain tensors, the cache lengths and routes kept here."""

    def __init__(self, model, n: int, attend: torch.Tensor | None, cache, *, samples: int, prompt: int) -> None:  # type: ignore[no-untyped-def]
        body, cfg = model.model, model.config
        capacity = cache.layers[0].capacity
        self.cache, self.experts = cache, cfg.num_experts
        shape = c_decode.DecodeShape(
            n=n,
            hidden=cfg.hidden_size,
            hq=cfg.num_attention_heads,
            hk=cfg.num_key_value_heads,
            d=cfg.head_dim,
            experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            ffn=cfg.moe_intermediate_size,
            vocab=cfg.vocab_size,
            layers=cfg.num_hidden_layers,
            capacity=capacity,
            norm_topk=cfg.norm_topk_prob,
            eps=cfg.rms_norm_eps,
        )
        cos, sin = _FusedDecoder.rope_tables(model, capacity)
        head_t = model.lm_head.weight.t().contiguous()
        tensors = {
            "embed": body.embed_tokens.weight,
            "final_norm": body.norm.weight,
            "head_t": head_t,
            "cos": cos.contiguous(),
            "sin": sin.contiguous(),
        }
        layers = []
        for i, layer in enumerate(body.layers[: cfg.num_hidden_layers]):
            a, mlp, cl = layer.self_attn, layer.mlp, cache.layers[i]
            qkv, qk_norm = _FusedDecoder.attention_weights(a, shape.hq, shape.hk)
            layers.append(
                {
                    "norm1": layer.input_layernorm.weight,
                    "qkv_t": qkv.t().contiguous(),
                    "qk_norm": qk_norm,
                    "o_t": a.o_proj.weight.t().contiguous(),
                    "norm2": layer.post_attention_layernorm.weight,
                    "router_t": mlp.gate.weight.t().contiguous(),
                    "gate_up_t": mlp.experts.gate_up_proj.transpose(-2, -1).contiguous(),  # (E, H, 2F)
                    "down_t": mlp.experts.down_proj.transpose(-2, -1).contiguous(),  # (E, F, H)
                    "keys": cl._kbuf,
                    "values": cl._vbuf,
                }
            )
        self.decoder = c_decode.NativeDecoder(
            shape, tensors, layers, attend, length=cache.layers[0].length, samples=samples, prompt=prompt
        )

    @staticmethod
    def eligible(model) -> bool:  # type: ignore[no-untyped-def]
        """Given `_FusedDecoder.eligible`: the kernels apply and what the C step also assumes holds (fp32 on the CPU,
        SiLU experts, one eps, whole query groups, the default scaling)."""
        if c_decode is None or c_decode.library() is None:
            return False
        cfg, body = model.config, model.model
        layer = body.layers[0]
        eps = {
            cfg.rms_norm_eps,
            body.norm.variance_epsilon,
            layer.input_layernorm.variance_epsilon,
            layer.self_attn.q_norm.variance_epsilon,
        }
        return (
            kernels.applies(*model.parameters())
            and cfg.hidden_act == "silu"
            and len(eps) == 1
            and cfg.num_attention_heads % cfg.num_key_value_heads == 0
            and getattr(layer.self_attn, "scaling", None) == cfg.head_dim**-0.5
        )

    def _sync(self, routes_out, routes: list[list[torch.Tensor]] | None, per_step: bool) -> None:  # type: ignore[no-untyped-def]
        for cl in self.cache.layers:  # the C code wrote the buffers up to the decoder's length
            cl.set_length(self.decoder.length)
        if routes is not None:
            dtype = route_index_dtype(self.experts)
            for i, per_layer in enumerate(routes):
                if per_step:
                    per_layer.append(routes_out[i, :, None].to(dtype))
                else:
                    per_layer += list(routes_out[:, i, :, None].to(dtype).unbind(0))

    def generate(self, logits, position_ids, *, temperature, gen, stops, max_new_tokens, routes):  # type: ignore[no-untyped-def]
        """The engine's sampling loop in one C call; appends each decode step's (N, 1, k) routes to routes[layer]."""
        tok, lps, length, done, r = self.decoder.generate(
            logits,
            position_ids,
            temperature=temperature,
            gen=gen,
            stops=stops,
            max_new_tokens=max_new_tokens,
            routes=routes is not None,
        )
        self._sync(r, routes, per_step=False)
        return tok, lps, length, done

    def step(self, tok: torch.Tensor, position_ids: torch.Tensor, routes: list[list[torch.Tensor]] | None):
        """`_FusedDecoder.step` in C (what `generate` runs each step; tests compare the two)."""
        logits, r = self.decoder.step(tok, position_ids, routes=routes is not None)
        self._sync(r, routes, per_step=True)
        return logits


@register_engine("hf")
class HFEngine(RolloutEngine):
    """transformers Qwen3-MoE with a KV-cache sampling loop; returns routed experts (R3) on any device."""

    routes_supported = True

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: str = "fp32",
        device: str | torch.device = "cpu",
        experts_implementation: str | None = None,
        precision: str | None = None,
        native_decode: bool = True,
        router_noise: float = 0.0,
    ) -> None:
        """`precision` (study.core.precision labels, e.g. "bf16-emulated", "bf16_fp32head"): None = `dtype`, real.
        `native_decode`: decode steps in C where it runs (study/kernels/decode.py), else in torch ops.
        `router_noise`: the standard deviation of Gaussian noise `generate` adds to every router's logits (a
        train/inference routing mismatch; `_noisy_routers`); 0 = none."""
        super().__init__(cfg, dtype=dtype)
        if not (math.isfinite(router_noise) and router_noise >= 0):
            raise ValueError(f"router_noise = {router_noise}: must be a finite number >= 0 (0 = off)")
        self.native_decode = native_decode
        self.router_noise = float(router_noise)
        self.device = torch.device(device)
        # precision hook (study/core/precision.py): emulated runs build in fp32 and round; the fp32 head is cast
        from study.core.precision import Precision, apply_precision

        prec = Precision.parse(precision, field="precision") if precision else Precision(dtype)
        if prec.dtype != dtype:
            raise ValueError(f"precision = {precision!r} computes in {prec.dtype}, but dtype = {dtype!r}")
        self.precision = prec
        if experts_implementation is None:
            experts_implementation = experts_implementation_for(self.device.type, TORCH_DTYPES[prec.storage_dtype])
        self.model = build_hf_model(cfg, prec.storage_dtype, experts_implementation=experts_implementation)
        self.model = self.model.to(self.device)
        self._precision = apply_precision(self.model, prec)
        self._routers = [layer.mlp.gate for layer in self.model.model.layers]

    # -- weights ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, hf_state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-checkpoint-named weights (a state dict or a stream of pairs) into the model (cast to the engine
        dtype); every tensor must be there."""
        if not isinstance(hf_state, Mapping):
            hf_state = dict(hf_state)  # views of the trainer's weights (study.core.weights.iter_hf_weights): no copy
        fused = fuse_experts(hf_state, self.cfg)
        params = dict(self.model.named_parameters())
        unknown = set(fused) - set(params)
        missing = set(params) - set(fused)
        if unknown or missing:
            raise KeyError(
                f"weights do not match the model: unknown {sorted(unknown)[:4]}, missing {sorted(missing)[:4]}"
            )
        for name, value in fused.items():
            dst = params[name]
            if dst.shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} != model {tuple(dst.shape)}")
            dst.copy_(value.to(device=dst.device, dtype=dst.dtype))
        self._precision.round_parameters_()  # precision hook: emulated weights are stored rounded

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """The current weights under HF checkpoint names (fp32 copies)."""
        return unfuse_experts({k: v.detach().float() for k, v in self.model.state_dict().items()}, self.cfg)

    # -- routes ----------------------------------------------------------------------------------------------------

    def _hook_routes(self, store: list[list[torch.Tensor]], shape: list[tuple[int, int]]) -> list:
        """Forward hooks appending each router's (N, S, k) expert indices of the current forward to store[layer]."""
        handles = []
        for layer, router in enumerate(self._routers):

            def hook(_mod, _inp, out, layer=layer):
                n, s = shape[0]
                store[layer].append(out[2].reshape(n, s, -1).to("cpu", route_index_dtype(self.cfg.num_experts)))

            handles.append(router.register_forward_hook(hook))
        return handles

    def _noisy_routers(self, seed: int) -> list:
        """Forward hooks that reroute every router on its logits plus Gaussian noise of std `router_noise`: the top-k
        and the gate weights of Qwen3MoeTopKRouter's forward computed again on the noisy logits. The noise comes
        from its own generator, seeded from `seed` (the sampling draws keep theirs). A hook on the routers makes the
        fused and C decode steps ineligible, so the decoder layers run (they call the hooked routers)."""
        gen = torch.Generator(device=self.device).manual_seed((seed + NOISE_SEED_OFFSET) % 2**63)
        std = self.router_noise

        def hook(router, _inp, out):  # type: ignore[no-untyped-def]
            logits = out[0]  # (tokens, E)
            noise = torch.randn(logits.shape, generator=gen, device=logits.device, dtype=torch.float32)
            noisy = (logits.float() + std * noise).to(logits.dtype)
            probs = torch.softmax(noisy, dtype=torch.float, dim=-1)
            top_w, top_i = torch.topk(probs, router.top_k, dim=-1)
            if router.norm_topk_prob:
                top_w /= top_w.sum(dim=-1, keepdim=True)
            return noisy, top_w.to(noisy.dtype), top_i

        return [router.register_forward_hook(hook) for router in self._routers]

    # -- sampling --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _sample(self, prompts: Sequence[Sequence[int]], n: int, s: Sampling) -> Rollout:
        """Sample `n` responses per prompt; see study.rollout.base for the semantics."""
        from transformers import DynamicCache

        seed, temperature, max_new_tokens, return_routes = s.seed, s.temperature, s.max_new_tokens, s.return_routes
        dev = self.device
        prompt_index = [p for p in range(len(prompts)) for _ in range(n)]
        lens = torch.tensor([len(prompts[p]) for p in prompt_index])
        N, P = len(prompt_index), int(lens.max())
        # the prefill runs once per prompt (its n samples share the prompt's keys, values and first logits) and is
        # then repeated per sample: n times less prefill work
        ids = torch.zeros(len(prompts), P, dtype=torch.long)  # (prompts, P) left-padded with token 0 (masked out)
        for p, prompt in enumerate(prompts):
            ids[p, P - len(prompt) :] = torch.tensor(prompt)
        prompt_lens = lens[::n]
        mask = (torch.arange(P)[None, :] >= (P - prompt_lens)[:, None]).long()  # (prompts, P)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (prompts, P) positions restart at 0 after the padding
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        stops = torch.tensor(sorted(set(s.stop_token_ids)), dtype=torch.long, device=dev)

        gen = torch.Generator(device=dev).manual_seed(seed)
        store: list[list[torch.Tensor]] = [[] for _ in self._routers]
        shape = [(len(prompts), P)]
        handles = self._noisy_routers(seed) if self.router_noise else []  # first: the route hooks record their routes
        use_fused = _FusedDecoder.eligible(self.model, self.precision)  # before the route hooks go on
        handles += self._hook_routes(store, shape) if return_routes else []
        try:
            cache = DynamicCache(config=self.model.config)
            cache.layers = [_growing_layer()(P + max_new_tokens) for _ in cache.layers]
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            if n > 1:  # one row per sample from here on
                out = _Logits(out.logits.repeat_interleave(n, dim=0))
                mask, pos = mask.repeat_interleave(n, dim=0), pos.repeat_interleave(n, dim=0)
                for layer in cache.layers:
                    layer.repeat_rows(n)
                for per_layer in store:
                    per_layer[:] = [r.repeat_interleave(n, dim=0) for r in per_layer]
            toks, lps = [], []
            padded = bool((lens != P).any())  # left padding: decode steps need the key-padding mask
            fused = None
            if use_fused:
                attend = None
                if padded:  # (N, 1, 1, capacity) False = a pad key
                    attend = torch.ones(N, 1, 1, P + max_new_tokens, dtype=torch.bool, device=dev)
                    attend[:, 0, 0, :P] = mask.bool()
                if self.native_decode and _NativeStep.eligible(self.model):
                    fused = _NativeStep(self.model, N, attend, cache, samples=n, prompt=P)
                else:
                    fused = _FusedDecoder(self.model, N, attend, cache)
            done = torch.zeros(N, dtype=torch.bool, device=dev)
            length = torch.zeros(N, dtype=torch.long, device=dev)  # response tokens so far (stop included)
            last_pos = pos[:, -1:]  # (N, 1)
            c_loop = isinstance(fused, _NativeStep)
            if c_loop:  # the loop below in one C call, on the same uniforms
                tok_mat, lp_mat, length, done = fused.generate(
                    out.logits[:, -1].float(),
                    last_pos,
                    temperature=temperature,
                    gen=gen,
                    stops=stops,
                    max_new_tokens=max_new_tokens,
                    routes=store if return_routes else None,
                )
            for step in range(0 if c_loop else max_new_tokens):
                logits = out.logits[:, -1].float()  # (N, V)
                logp = sampling_logp(logits, temperature)  # vLLM's processed_logprobs
                tok = sample(logits, logp, temperature, gen)  # (N,)
                toks.append(tok)
                lps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
                length += (~done).long()
                done |= torch.isin(tok, stops)
                if bool(done.all()) or step == max_new_tokens - 1:
                    break
                last_pos = last_pos + 1
                if fused is not None:
                    out = _Logits(fused.step(tok, last_pos, store if return_routes else None)[:, None])
                    continue
                mask = torch.cat([mask, torch.ones(N, 1, dtype=mask.dtype, device=dev)], dim=1)
                shape[0] = (N, 1)
                out = self._decode(tok, mask, last_pos, cache, padded)
        finally:
            for h in handles:
                h.remove()

        if not c_loop:
            tok_mat, lp_mat = torch.stack(toks, 1), torch.stack(lps, 1)  # (N, steps); log-probs fp32
        tok_mat, lp_mat = tok_mat.cpu(), lp_mat.cpu()
        length, done = length.cpu(), done.cpu()
        tokens = [tok_mat[i, : length[i]].tolist() for i in range(N)]
        logprobs = [lp_mat[i, : length[i]].clone() for i in range(N)]
        finish = ["stop" if done[i] else "length" for i in range(N)]
        routes = None
        if return_routes:
            # per layer: prefill (N, P, k) then one (N, 1, k) per decode step -> (N, P + steps - 1, k)
            per_layer = [torch.cat(s, dim=1) for s in store]
            full = torch.stack(per_layer, dim=2)  # (N, P + steps - 1, layers, k)
            routes = [full[i, P - lens[i] : P + length[i] - 1].clone() for i in range(N)]
        return Rollout(prompt_index, tokens, logprobs, finish, routes)

    def _decode(self, tok: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, cache, padded: bool):  # type: ignore[no-untyped-def]
        """One decode step of the (N,) tokens `tok`; returns an object with `.logits` (N, 1, V).

        Without hooks on the top-level model (real precisions), the decoder layers are called directly: the same
        modules, inputs and mask as `self.model(...)` (the key-padding mask (N, 1, 1, S) as a bool, or None when
        nothing is padded, which is what transformers' create_causal_mask gives sdpa for one query), bit-identical
        logits, without the per-call wrappers (output capturing, mask building, two ModelOutputs): about 20% of a
        decode step of the tiny preset (benchmarks/bench_engines.py, docs/performance.md).
        """
        if self.model._forward_hooks or self.model._forward_pre_hooks:  # emulated precision wraps the whole call
            return self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
        body = self.model.model
        hidden = body.embed_tokens(tok[:, None])  # (N, 1, H)
        rope = body.rotary_emb(hidden, position_ids=position_ids)
        attn_mask = mask[:, None, None, :].bool() if padded else None  # (N, 1, 1, S) True = attend
        for layer in body.layers[: body.config.num_hidden_layers]:
            hidden = layer(
                hidden,
                attention_mask=attn_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=rope,
            )
        return _Logits(self.model.lm_head(body.norm(hidden)))

    @torch.no_grad()
    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, return_routes: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Teacher-forced log-probs (fp32, (T_i,)) of each response given its prompt, one sequence at a time (no
        padding), and optionally the routes of `(prompt + response)[:-1]` ((P_i + T_i - 1, layers, k))."""
        lps, routes = [], []
        for prompt, resp in zip(prompts, responses, strict=True):
            seq = torch.tensor([*prompt, *resp], device=self.device)[None]  # (1, S)
            store: list[list[torch.Tensor]] = [[] for _ in self._routers]
            handles = self._hook_routes(store, [(1, seq.shape[1] - 1)]) if return_routes else []
            try:
                logits = self.model(input_ids=seq[:, :-1]).logits.float()  # (1, S - 1, V)
            finally:
                for h in handles:
                    h.remove()
            logp = torch.log_softmax(logits, -1).gather(-1, seq[:, 1:, None])[0, :, 0]  # (S - 1,)
            lps.append(logp[len(prompt) - 1 :].cpu())
            if return_routes:
                routes.append(torch.stack([s[0][0] for s in store], dim=1))  # (S - 1, layers, k)
        return lps, (routes if return_routes else None)
