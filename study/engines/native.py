"""The hf engine's native decode step: study/csrc/qwen3_moe_decode.c, built and loaded by study/native.py.

At the tiny preset's sizes a decode step is ~190 torch ops of a few microseconds' work each, and each op costs
about as much again in dispatch (docs/performance.md section 6). The C step does the same arithmetic in one call,
and the engine's whole sampling loop runs in C around it. It runs where `_FusedDecoder` would (fp32 on the CPU, the
engine's decode attention, the default RoPE, no hooks, SwiGLU experts) and the kernel builds; its sums run in
another order than torch's kernels, so its logits agree with the modules' to ~1e-6, not bit for bit
(tests/engines), and a sampled token can differ where two candidates' cumulative probabilities tie to that
precision. Elsewhere, or with `STUDY_NATIVE=0`, the fused torch step runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from study import native
from study.engines.base import routes_dtype

_P = ctypes.POINTER(ctypes.c_float)


_INTS = ("n", "hidden", "hq", "hk", "d", "experts", "top_k", "ffn", "vocab", "layers", "capacity", "norm_topk",
         "stride_t", "samples", "prompt")  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        *((f, ctypes.c_int64) for f in _INTS),
        ("eps", ctypes.c_double),
        ("scaling", ctypes.c_double),
        *((f, _P) for f in ("embed", "final_norm", "head_t", "cos", "sin")),
        ("attend", ctypes.POINTER(ctypes.c_uint8)),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [(f, _P) for f in ("norm1", "qkv_t", "qk_norm", "o_t", "norm2", "router_t", "gate_up_t", "down_t",
                                  "keys", "values", "keys_t")]  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled step with its signatures declared, or None where it cannot be built or the kernels are off."""
    p, i64, f64, rc = native.PTR, native.I64, native.F64, native.INT
    model, layers = ctypes.POINTER(_Model), ctypes.POINTER(_Layer)
    return native.bind("qwen3_moe_decode", {
        "qwen3_moe_decode_step": ([model, layers, p, p, i64, p, p], rc),
        "qwen3_moe_generate": ([model, layers, p, p, i64, p, f64, p, i64, i64, p, p, p, p, p], i64),
        "qwen3_moe_sample": ([p, i64, i64, p, f64, p, p], rc),
    })  # fmt: skip


def _ptr(t: torch.Tensor):  # type: ignore[no-untyped-def]
    return ctypes.cast(t.data_ptr(), _P)


class NativeDecoder:
    """`_FusedDecoder`'s decode step in C (see the module doc); built per `generate` on the current weights.

    Holds contiguous transposed copies of the weights ((in, out) for every projection) and the cache buffers the
    prefill filled (study/engines/hf.py's growing cache layers), which each step appends to in place."""

    def __init__(self, model, n: int, attend: torch.Tensor | None, cache, lib: ctypes.CDLL, *, samples: int = 1,  # type: ignore[no-untyped-def]
                 prompt: int = 0) -> None:  # fmt: skip
        """`samples`, `prompt`: each run of `samples` rows holds the same keys and values at positions < `prompt`
        (the engine's prefill runs once per prompt and copies it to the prompt's samples), so the step reads them
        from the run's first row; 1, 0: nothing shared."""
        if n % samples or not 0 <= prompt <= cache.layers[0].length:
            raise ValueError(f"native decode: {n} rows cannot share a {prompt}-position prompt in runs of {samples}")
        body, cfg = model.model, model.config
        self.lib, self.cache, self.n = lib, cache, n
        self.d, self.hq, self.hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.k = cfg.num_experts_per_tok
        from study.engines.hf import _FusedDecoder  # the same tables and stacked weights as the fused step's

        capacity = cache.layers[0].capacity
        stride_t = (capacity + 15 + 15) // 16 * 16  # >= capacity + 15, a multiple of 16
        weight = body.embed_tokens.weight
        d = self.d
        keep = [weight, body.norm.weight]  # every tensor a pointer refers to lives as long as this object
        head_t = model.lm_head.weight.t().contiguous()
        cos, sin = (t.contiguous() for t in _FusedDecoder.rope_tables(model, capacity))
        self.attend = None if attend is None else attend.reshape(n, capacity).to(torch.uint8).contiguous()
        keep += [head_t, cos, sin]
        self.model = _Model(
            n=n, hidden=cfg.hidden_size, hq=self.hq, hk=self.hk, d=d, experts=cfg.num_experts, top_k=self.k,
            ffn=cfg.moe_intermediate_size, vocab=cfg.vocab_size, layers=cfg.num_hidden_layers, capacity=capacity,
            norm_topk=int(cfg.norm_topk_prob), stride_t=stride_t, samples=samples, prompt=prompt, eps=cfg.rms_norm_eps,
            scaling=d**-0.5, embed=_ptr(weight),
            final_norm=_ptr(body.norm.weight), head_t=_ptr(head_t), cos=_ptr(cos), sin=_ptr(sin),
            attend=None if self.attend is None else ctypes.cast(self.attend.data_ptr(), ctypes.POINTER(ctypes.c_uint8)),
        )  # fmt: skip
        self.layers = (_Layer * cfg.num_hidden_layers)()
        for i, layer in enumerate(body.layers[: cfg.num_hidden_layers]):
            a, mlp, cl = layer.self_attn, layer.mlp, cache.layers[i]
            qkv, qk_norm = _FusedDecoder.attention_weights(a, self.hq, self.hk)
            t = {
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
                "keys_t": self._transposed_keys(cl, stride_t),
            }
            for name, tensor in t.items():
                if not (tensor.is_contiguous() and tensor.dtype == torch.float32):
                    raise RuntimeError(f"native decode: {name} is not a contiguous fp32 tensor")
                setattr(self.layers[i], name, _ptr(tensor))
            keep += t.values()
        self._keep = keep
        self.vocab = cfg.vocab_size

    @staticmethod
    def _transposed_keys(layer, stride: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """The cache layer's keys as (n, kv heads, d, stride), the layout the C attention reads (its scores then
        accumulate over contiguous positions): the prefill's positions, zeros after them (the C code reads up to 15
        positions past the last it uses); each step writes its keys to both."""
        n, h, _, d = layer._kbuf.shape
        keys_t = layer._kbuf.new_zeros(n, h, d, stride)
        keys_t[..., : layer.length] = layer._kbuf[:, :, : layer.length].transpose(-2, -1)
        return keys_t

    @staticmethod
    def eligible(model) -> bool:  # type: ignore[no-untyped-def]
        """Given `_FusedDecoder.eligible`: what the C step also assumes (fp32 on the CPU, SiLU experts, one eps)."""
        cfg, body = model.config, model.model
        p = body.embed_tokens.weight
        layer = body.layers[0]
        eps = {cfg.rms_norm_eps, body.norm.variance_epsilon, layer.input_layernorm.variance_epsilon,
               layer.self_attn.q_norm.variance_epsilon}  # fmt: skip
        return (
            p.device.type == "cpu"
            and all(q.dtype == torch.float32 for q in model.parameters())
            and cfg.hidden_act == "silu"
            and len(eps) == 1
            and cfg.num_attention_heads % cfg.num_key_value_heads == 0
            and getattr(layer.self_attn, "scaling", None) == cfg.head_dim**-0.5
        )

    def generate(self, logits: torch.Tensor, position_ids: torch.Tensor, *, temperature: float, gen: torch.Generator,
                 stops: torch.Tensor, max_new_tokens: int, routes: list[list[torch.Tensor]] | None):  # fmt: skip
        """The engine's sampling loop from the prefill's `logits` (N, V) and last positions (N, 1), in one C call:
        the torch loop's uniforms (`max_new_tokens` x N from `gen`, drawn up front), the same stopping rule. Returns
        tokens and log-probs (N, steps), length (N,) and done (N,) as the torch loop leaves them; appends each decode
        step's (N, 1, k) expert indices to routes[layer] if given."""
        n, t = self.n, max_new_tokens
        f64 = torch.float64
        u = torch.rand(t, n, generator=gen, dtype=f64) if temperature > 0 else torch.zeros(t, n, dtype=f64)
        logits, pos = logits.contiguous().clone(), position_ids[:, 0].contiguous().clone()
        stops = stops.to(torch.long).contiguous()
        tokens, lps = torch.empty(n, t, dtype=torch.long), torch.empty(n, t)
        length, done = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.uint8)
        r = torch.empty(max(t - 1, 0), len(self.layers), n, self.k, dtype=torch.long) if routes is not None else None
        slot = self.cache.layers[0].length
        steps = self.lib.qwen3_moe_generate(ctypes.byref(self.model), self.layers, logits.data_ptr(), pos.data_ptr(),
                                            slot, u.data_ptr(), temperature, stops.data_ptr(), stops.numel(), t,
                                            tokens.data_ptr(), lps.data_ptr(), length.data_ptr(), done.data_ptr(),
                                            None if r is None else r.data_ptr())  # fmt: skip
        if steps < 0:
            raise MemoryError("native decode: out of memory for its workspace")
        for cl in self.cache.layers:  # the decode steps wrote positions slot .. slot + steps - 2
            cl.set_length(slot + steps - 1)
        if r is not None:
            dtype = routes_dtype(self.model.experts)
            for i, per_layer in enumerate(routes):
                per_layer += list(r[: steps - 1, i, :, None].to(dtype).unbind(0))
        return tokens[:, :steps], lps[:, :steps], length, done.bool()

    def step(self, tok: torch.Tensor, position_ids: torch.Tensor, routes: list[list[torch.Tensor]] | None):
        """One decode step (what `generate` runs each step; tests compare it with the torch step): logits (N, V) of
        the next token after `tok` (N,) at `position_ids` (N, 1); appends each layer's (N, 1, k) expert indices to
        routes[layer] if given."""
        tok = tok.contiguous()
        pos = position_ids[:, 0].contiguous()
        slot = self.cache.layers[0].length
        logits = torch.empty(self.n, self.vocab)
        r = torch.empty(len(self.layers), self.n, self.k, dtype=torch.long) if routes is not None else None
        rc = self.lib.qwen3_moe_decode_step(ctypes.byref(self.model), self.layers, tok.data_ptr(), pos.data_ptr(),
                                            slot, logits.data_ptr(), None if r is None else r.data_ptr())  # fmt: skip
        if rc != 0:
            raise MemoryError("native decode step: out of memory for its workspace")
        for cl in self.cache.layers:  # the C step wrote position `slot` of every layer's buffers
            cl.set_length(slot + 1)
        if r is not None:
            dtype = routes_dtype(self.model.experts)
            for i, per_layer in enumerate(routes):
                per_layer.append(r[i, :, None].to(dtype))
        return logits


def sample(lib: ctypes.CDLL, logits: torch.Tensor, temperature: float, gen: torch.Generator):  # type: ignore[no-untyped-def]
    """study/engines/hf.py `sample` and the sampled tokens' untempered log-probs, in C: the same uniforms from `gen`
    (none at temperature 0), the same inverse-CDF rule; returns ((N,) tokens, (N,) fp32 log-probs)."""
    logits = logits.contiguous()
    n, vocab = logits.shape
    f64 = torch.float64
    u = torch.rand(n, generator=gen, dtype=f64) if temperature > 0 else torch.zeros(n, dtype=f64)
    tok, lp = torch.empty(n, dtype=torch.long), torch.empty(n)
    if lib.qwen3_moe_sample(logits.data_ptr(), n, vocab, u.data_ptr(), temperature, tok.data_ptr(), lp.data_ptr()):
        raise MemoryError("native sampler: out of memory for its workspace")
    return tok, lp
