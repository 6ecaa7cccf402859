"""The Qwen3-MoE decode step and sampling loop in C (csrc/qwen3_moe_decode.c), over plain tensors.

At the tiny preset's sizes a decode step is ~190 torch ops of a few microseconds' work each, and each op costs
about as much again in dispatch (docs/performance.md). `NativeDecoder` runs the same arithmetic as the hf engine's
fused torch step (study/rollout/hf.py) in one call per step, or the engine's whole sampling loop in one call: fp32 on
the CPU, SwiGLU experts, softmax top-k router, one RMSNorm epsilon. Its sums run in another order than torch's
kernels, so its logits agree with the modules' to ~1e-6, not bit for bit (tests/study/rollout), and a sampled token can
differ where two candidates' cumulative probabilities tie to that precision. The engine decides when to use it (the
package's rule, study/kernels/__init__.py, plus what the fused step assumes) and hands it the tensors.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass

import torch

from study import kernels
from study.kernels import build

_P = ctypes.POINTER(ctypes.c_float)


_INTS = (
    "n",
    "hidden",
    "hq",
    "hk",
    "d",
    "experts",
    "top_k",
    "ffn",
    "vocab",
    "layers",
    "capacity",
    "norm_topk",
    "stride_t",
    "samples",
    "prompt",
)


class _Model(ctypes.Structure):
    _fields_ = [
        *((f, ctypes.c_int64) for f in _INTS),
        ("eps", ctypes.c_double),
        ("scaling", ctypes.c_double),
        *((f, _P) for f in ("embed", "final_norm", "head_t", "cos", "sin")),
        ("attend", ctypes.POINTER(ctypes.c_uint8)),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        (f, _P)
        for f in (
            "norm1",
            "qkv_t",
            "qk_norm",
            "o_t",
            "norm2",
            "router_t",
            "gate_up_t",
            "down_t",
            "keys",
            "values",
            "keys_t",
        )
    ]


def library() -> ctypes.CDLL | None:
    """The compiled step with its signatures declared, or None where the kernels are off or it cannot be built."""
    return _library() if kernels.enabled() else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    p, i64, f64, rc = build.PTR, build.I64, build.F64, build.INT
    model, layers = ctypes.POINTER(_Model), ctypes.POINTER(_Layer)
    return build.bind(
        "qwen3_moe_decode",
        {
            "qwen3_moe_decode_step": ([model, layers, p, p, i64, p, p], rc),
            "qwen3_moe_generate": ([model, layers, p, p, i64, p, f64, p, i64, i64, p, p, p, p, p], i64),
            "qwen3_moe_sample": ([p, i64, i64, p, f64, p, p], rc),
        },
    )


def _ptr(t: torch.Tensor):  # type: ignore[no-untyped-def]
    return ctypes.cast(t.data_ptr(), _P)


@dataclass(frozen=True)
class DecodeShape:
    """The sizes of one decode batch and its model (Qwen3-MoE semantics: SwiGLU experts, softmax top-k router)."""

    n: int
    """Rows (sequences) decoded together."""
    hidden: int
    hq: int
    """Query heads."""
    hk: int
    """Key/value heads; must divide hq."""
    d: int
    """Head width."""
    experts: int
    top_k: int
    ffn: int
    """One expert's intermediate width."""
    vocab: int
    layers: int
    capacity: int
    """Positions each layer's key/value buffers hold."""
    norm_topk: bool
    """Whether the gate renormalises over the chosen experts."""
    eps: float
    """RMSNorm epsilon (one for every norm)."""


LAYER_TENSORS = ("norm1", "qkv_t", "qk_norm", "o_t", "norm2", "router_t", "gate_up_t", "down_t", "keys", "values")
"""Per layer, contiguous fp32: norm1 (H,), qkv_t (H, (hq + 2 hk) d), qk_norm (hq + hk, d), o_t (hq d, H), norm2
(H,), router_t (H, E), gate_up_t (E, H, 2F), down_t (E, F, H), keys and values (n, hk, capacity, d): the cache
buffers, which the steps append to in place."""
MODEL_TENSORS = ("embed", "final_norm", "head_t", "cos", "sin")
"""Contiguous fp32: embed (V, H), final_norm (H,), head_t (H, V), cos and sin (capacity, d) (sin carrying
rotate_half's sign: rotate_half(x) * sin == roll(x, d / 2) * sin)."""


class NativeDecoder:
    """The decode step (and the whole sampling loop) in C over plain tensors (module doc).

    Holds pointers to the given tensors (kept alive here) and a transposed copy of each layer's keys, the layout the C
    attention reads. `available()` says whether it can be built; the caller keeps its own torch step for elsewhere."""

    def __init__(
        self,
        shape: DecodeShape,
        model: dict[str, torch.Tensor],
        layers: list[dict[str, torch.Tensor]],
        attend: torch.Tensor | None,
        *,
        length: int,
        samples: int = 1,
        prompt: int = 0,
    ) -> None:
        """`length`: positions already in the key/value buffers (the prefill's); `attend` (n, capacity) bool, False
        on pad keys, or None; `samples`, `prompt`: each run of `samples` rows holds the same keys and values at
        positions < `prompt` (a prompt's prefill copied to its samples), so the step reads them from the run's first
        row; 1, 0: nothing shared."""
        n, capacity = shape.n, shape.capacity
        if n % samples or not 0 <= prompt <= length <= capacity:
            raise ValueError(f"native decode: {n} rows cannot share a {prompt}-position prompt in runs of {samples}")
        if len(layers) != shape.layers:
            raise ValueError(f"native decode: {len(layers)} layers of tensors for {shape.layers} layers")
        self.lib = library()
        if self.lib is None:
            raise RuntimeError("native decode: the kernel is not available (see study/kernels/__init__.py)")
        self.shape, self.length = shape, length
        stride_t = (capacity + 15 + 15) // 16 * 16  # >= capacity + 15, a multiple of 16
        self.attend = None if attend is None else attend.reshape(n, capacity).to(torch.uint8).contiguous()
        keep = list(model.values())  # every tensor a pointer refers to lives as long as this object
        for name in MODEL_TENSORS:
            _check(name, model[name])
        sizes = {**dataclasses.asdict(shape), "norm_topk": int(shape.norm_topk)}  # each DecodeShape field a _Model one
        self.model = _Model(
            **sizes,
            stride_t=stride_t,
            samples=samples,
            prompt=prompt,
            scaling=shape.d**-0.5,
            **{name: _ptr(model[name]) for name in MODEL_TENSORS},
            attend=None if self.attend is None else ctypes.cast(self.attend.data_ptr(), ctypes.POINTER(ctypes.c_uint8)),
        )
        self.layers = (_Layer * shape.layers)()
        for i, tensors in enumerate(layers):
            t = {name: tensors[name] for name in LAYER_TENSORS}
            t["keys_t"] = self._transposed_keys(t["keys"], length, stride_t)
            for name, tensor in t.items():
                _check(name, tensor)
                setattr(self.layers[i], name, _ptr(tensor))
            keep += t.values()
        self._keep = keep

    @staticmethod
    def _transposed_keys(keys: torch.Tensor, length: int, stride: int) -> torch.Tensor:
        """`keys` (n, kv heads, capacity, d) as (n, kv heads, d, stride), the layout the C attention reads (its
        scores then accumulate over contiguous positions): the first `length` positions, zeros after them (the C code
        reads up to 15 positions past the last it uses); each step writes its keys to both."""
        n, h, _, d = keys.shape
        keys_t = keys.new_zeros(n, h, d, stride)
        keys_t[..., :length] = keys[:, :, :length].transpose(-2, -1)
        return keys_t

    def generate(
        self,
        logits: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        temperature: float,
        gen: torch.Generator,
        stops: torch.Tensor,
        max_new_tokens: int,
        routes: bool = False,
    ):
        """The sampling loop from the prefill's `logits` (n, V) and last positions (n, 1), in one C call: one uniform
        per row and step (`max_new_tokens` x n from `gen`, drawn up front; inverse-CDF sampling; log-probs of
        the tempered distribution sampled, as `sample`), stopping a row at its first stop token and every row once
        all stopped. Returns tokens and
        log-probs (n, steps), length (n,), done (n,) bool, and with `routes` each decode step's expert indices
        (steps - 1, layers, n, k) int64 (else None); the key/value buffers then hold `self.length` positions."""
        n, t = self.shape.n, max_new_tokens
        f64 = torch.float64
        u = torch.rand(t, n, generator=gen, dtype=f64) if temperature > 0 else torch.zeros(t, n, dtype=f64)
        logits, pos = logits.contiguous().clone(), position_ids[:, 0].contiguous().clone()
        stops = stops.to(torch.long).contiguous()
        tokens, lps = torch.empty(n, t, dtype=torch.long), torch.empty(n, t)
        length, done = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.uint8)
        r = torch.empty(max(t - 1, 0), self.shape.layers, n, self.shape.top_k, dtype=torch.long) if routes else None
        steps = self.lib.qwen3_moe_generate(
            ctypes.byref(self.model),
            self.layers,
            logits.data_ptr(),
            pos.data_ptr(),
            self.length,
            u.data_ptr(),
            temperature,
            stops.data_ptr(),
            stops.numel(),
            t,
            tokens.data_ptr(),
            lps.data_ptr(),
            length.data_ptr(),
            done.data_ptr(),
            None if r is None else r.data_ptr(),
        )
        if steps < 0:
            raise MemoryError("native decode: out of memory for its workspace")
        self.length += steps - 1  # the decode steps wrote positions length .. length + steps - 2
        return tokens[:, :steps], lps[:, :steps], length, done.bool(), None if r is None else r[: steps - 1]

    def step(self, tok: torch.Tensor, position_ids: torch.Tensor, *, routes: bool = False):  # type: ignore[no-untyped-def]
        """One decode step (what `generate` runs each step; tests compare it with the torch step): logits (n, V) of
        the next token after `tok` (n,) at `position_ids` (n, 1), and with `routes` each layer's expert indices
        (layers, n, k) int64 (else None); writes position `self.length` of every layer's buffers."""
        tok = tok.contiguous()
        pos = position_ids[:, 0].contiguous()
        logits = torch.empty(self.shape.n, self.shape.vocab)
        r = torch.empty(self.shape.layers, self.shape.n, self.shape.top_k, dtype=torch.long) if routes else None
        out = None if r is None else r.data_ptr()
        rc = self.lib.qwen3_moe_decode_step(
            ctypes.byref(self.model), self.layers, tok.data_ptr(), pos.data_ptr(), self.length, logits.data_ptr(), out
        )
        if rc != 0:
            raise MemoryError("native decode step: out of memory for its workspace")
        self.length += 1
        return logits, r


def _check(name: str, tensor: torch.Tensor) -> None:
    if not (tensor.is_contiguous() and tensor.dtype == torch.float32 and tensor.device.type == "cpu"):
        raise ValueError(f"native decode: {name} must be a contiguous fp32 CPU tensor")


def sample(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token per row of `logits` (N, V) and its log-prob under the distribution drawn from (softmax(logits / T);
    raw at temperature 0), in C: one uniform per row from `gen` (none at temperature 0), inverse-CDF over the tempered
    probabilities (the hf engine's torch `sample` rule); returns ((N,) tokens, (N,) fp32 log-probs), or None where
    the kernels do not apply."""
    lib = library()
    if lib is None or not kernels.applies(logits):
        return None
    logits = logits.contiguous()
    n, vocab = logits.shape
    f64 = torch.float64
    u = torch.rand(n, generator=gen, dtype=f64) if temperature > 0 else torch.zeros(n, dtype=f64)
    tok, lp = torch.empty(n, dtype=torch.long), torch.empty(n)
    if lib.qwen3_moe_sample(logits.data_ptr(), n, vocab, u.data_ptr(), temperature, tok.data_ptr(), lp.data_ptr()):
        raise MemoryError("native sampler: out of memory for its workspace")
    return tok, lp
