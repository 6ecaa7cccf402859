"""Weight mapping between the Megatron-core GPTModel policy and Hugging Face Qwen3-MoE checkpoints.

The HF side is the *checkpoint* naming of `Qwen3MoeForCausalLM` (one tensor per expert projection), which is what
`save_pretrained` writes, what `from_pretrained` reads and what vLLM's `load_weights` / `reload_weights` consume:

    Megatron (tp = ep = 1, local or TE layer spec)                    HF Qwen3-MoE checkpoint
    embedding.word_embeddings.weight                    (V, H)        model.embed_tokens.weight
    decoder.layers.L.input_layernorm.weight             (H,)          model.layers.L.input_layernorm.weight
      (TE spec: ...self_attention.linear_qkv.layer_norm_weight)
    decoder.layers.L.self_attention.linear_qkv.weight   ((nq+2g)d, H) model.layers.L.self_attn.{q,k,v}_proj.weight
    decoder.layers.L.self_attention.q_layernorm.weight  (d,)          model.layers.L.self_attn.q_norm.weight
    decoder.layers.L.self_attention.k_layernorm.weight  (d,)          model.layers.L.self_attn.k_norm.weight
    decoder.layers.L.self_attention.linear_proj.weight  (H, nq d)     model.layers.L.self_attn.o_proj.weight
    decoder.layers.L.pre_mlp_layernorm.weight           (H,)          model.layers.L.post_attention_layernorm.weight
    decoder.layers.L.mlp.router.weight                  (E, H)        model.layers.L.mlp.gate.weight
    decoder.layers.L.mlp.experts.local_experts.e.linear_fc1.weight (2F, H)  ...mlp.experts.e.{gate,up}_proj.weight
      (TE grouped: decoder.layers.L.mlp.experts.linear_fc1.weight<e>)
    decoder.layers.L.mlp.experts.local_experts.e.linear_fc2.weight (H, F)   ...mlp.experts.e.down_proj.weight
    decoder.final_layernorm.weight                      (H,)          model.norm.weight
    output_layer.weight                                 (V, H)        lm_head.weight          (untied)

Layouts that are not a rename:
1. Fused QKV. Megatron stores linear_qkv row-blocked per query group g (of num_query_groups):
   [q heads of g (nq/g heads x d rows), k of g (d rows), v of g (d rows)]. HF query head h belongs to kv head
   h // (nq/g) (repeat_kv), the same grouping, so q/k/v are de-interleaved group by group.
2. Fused fc1. Megatron's SwiGLU expert computes silu(x W1[:F]) * (x W1[F:]) with linear_fc1 = [gate; up] (tp = 1).
3. Router. Megatron (moe_router_score_function="softmax", moe_router_pre_softmax=False, no scaling factor) takes
   the top-k of the logits and then a softmax over the k chosen logits. Qwen3 takes softmax over all experts, top-k,
   then renormalises (norm_topk_prob=True): softmax is monotone, so the chosen set is the same, and
   p_i / sum_chosen p_j = exp(z_i) / sum_chosen exp(z_j), the same gate weights. Both use one (E, H) weight, no bias.

Tensors are cloned, never aliased, so a returned dict can be mutated or sent to another engine safely. Only the
tensor- and expert-parallel-gathered (tp = ep = pp = 1) layout is handled.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runfiles.bounded import read_json
from study.core.model_config import (
    PRESETS,
    SHAPE_FIELDS,
    ModelConfig,
    ModelSpec,
    model_spec,
    resolve_model,
)

if TYPE_CHECKING:  # imported where a tensor is touched: a checkpoint's config.json is checked without torch
    import torch

_HF_DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

_UMASK = os.umask(0)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK
"""The mode an ordinary file gets under the process's umask (group-readable where the umask says so)."""

_MG_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MG_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
_MG_GROUPED_EXPERT = re.compile(r"mlp\.experts\.linear_fc([12])\.weight(\d+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")

# Per-layer renames (Megatron suffix -> HF suffix), everything but fused QKV and experts.
_LAYER_RENAMES: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE spec fuses the norm into QKV
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_GLOBAL_RENAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _state_of(model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch

    if isinstance(model_or_state, torch.nn.Module):
        return dict(model_or_state.state_dict())
    return dict(model_or_state)


def _layer_and_rest(pattern: re.Pattern[str], name: str, unknown: str) -> tuple[int, str]:
    """A per-layer parameter's layer index and the name after its layer prefix (`pattern`: _MG_LAYER or _HF_LAYER);
    KeyError "`unknown` `name`" for any other name."""
    m = pattern.fullmatch(name)
    if m is None:
        raise KeyError(f"{unknown} {name!r}")
    return int(m.group(1)), m.group(2)


def _skippable(name: str) -> bool:
    # TransformerEngine's fp8 metadata and router bookkeeping buffers carry no weights.
    return name.endswith("_extra_state") or name.endswith(("local_tokens_per_expert", "expert_bias"))


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron linear_qkv ((nq + 2 g) d, H) -> HF q (nq d, H), k (g d, H), v (g d, H)."""
    g, d = cfg.num_query_groups, cfg.head_dim
    r = cfg.num_attention_heads // g  # query heads per group
    grouped = qkv.reshape(g, (r + 2) * d, -1)  # (g, (r + 2) d, H): [q_0 .. q_{r-1}, k, v] per group
    q = grouped[:, : r * d].reshape(g * r * d, -1)
    k = grouped[:, r * d : (r + 1) * d].reshape(g * d, -1)
    v = grouped[:, (r + 1) * d :].reshape(g * d, -1)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q (nq d, H), k (g d, H), v (g d, H) -> Megatron linear_qkv ((nq + 2 g) d, H), interleaved per group."""
    import torch

    g, d = cfg.num_query_groups, cfg.head_dim
    r = cfg.num_attention_heads // g
    hidden = q.shape[-1]
    grouped = torch.cat(
        [q.reshape(g, r * d, hidden), k.reshape(g, d, hidden), v.reshape(g, d, hidden)], dim=1
    )  # (g, (r + 2) d, H)
    return grouped.reshape(g * (r + 2) * d, hidden)


def iter_hf_weights(
    model_or_state: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight of a Megatron GPTModel (or its state dict), in the model's order (layer by
    layer), without copying: each tensor is a view of the Megatron weight (the QKV split's q/k/v may be
    non-contiguous views). Unknown Megatron names raise, so a layer the mapping does not know cannot be dropped.

    The source of a streamed weight sync (study.rollout.vllm_engine): consumers copy what they need while the
    iteration runs and keep no reference, so no full copy of the model ever exists. A sharded trainer plugs in a
    generator of the same shape (full HF tensors, one at a time), or passes its (megatron name, full tensor) pairs,
    consumed one at a time.
    """
    import torch

    if isinstance(model_or_state, torch.nn.Module | Mapping):
        pairs: Iterable[tuple[str, torch.Tensor]] = _state_of(model_or_state).items()
    else:
        pairs = model_or_state
    for name, tensor in pairs:
        if _skippable(name):
            continue
        pieces = _hf_pieces(name, tensor.detach(), cfg)
        del tensor  # a streamed source's full tensor lives on in the pieces only, until the consumer drops them
        pieces.reverse()
        while pieces:
            yield pieces.pop()


def _hf_pieces(name: str, t: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The (HF name, view of `t`) pairs of the Megatron weight `name`."""
    if name in _GLOBAL_RENAMES:
        return [(_GLOBAL_RENAMES[name], t)]
    layer, rest = _layer_and_rest(_MG_LAYER, name, "no HF name for Megatron parameter")
    prefix = f"model.layers.{layer}."
    if rest in _LAYER_RENAMES:
        return [(prefix + _LAYER_RENAMES[rest], t)]
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = split_qkv(t, cfg)
        return [
            (prefix + "self_attn.q_proj.weight", q),
            (prefix + "self_attn.k_proj.weight", k),
            (prefix + "self_attn.v_proj.weight", v),
        ]
    e = _MG_LOCAL_EXPERT.fullmatch(rest) or _MG_GROUPED_EXPERT.fullmatch(rest)
    if e is None:
        raise KeyError(f"no HF name for Megatron parameter {name!r}")
    if e.re is _MG_LOCAL_EXPERT:
        expert, fc = int(e.group(1)), e.group(2)
    else:
        fc, expert = e.group(1), int(e.group(2))
    ep = f"{prefix}mlp.experts.{expert}."
    if fc == "1":  # (2F, H) = [gate; up]
        F = cfg.moe_ffn_hidden_size
        return [(ep + "gate_proj.weight", t[:F]), (ep + "up_proj.weight", t[F:])]
    return [(ep + "down_proj.weight", t)]  # (H, F)


def megatron_to_hf(
    model_or_state: torch.nn.Module | Mapping[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """Megatron GPTModel (or its state dict) -> HF Qwen3-MoE checkpoint state dict (per-expert names): contiguous
    copies of `iter_hf_weights`, checked complete."""
    import torch

    out = {name: t.clone(memory_format=torch.contiguous_format) for name, t in iter_hf_weights(model_or_state, cfg)}
    _check_complete(out, cfg)
    return out


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    *,
    te_spec: bool = False,
    partial: bool = False,
    copy: bool = True,
) -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE checkpoint state dict (per-expert names) -> Megatron GPTModel state dict.

    `te_spec=False` gives the local layer spec's names (separate input_layernorm, SequentialMLP local_experts);
    `te_spec=True` gives TransformerEngine's (norm fused into linear_qkv, TEGroupedMLP linear_fc1.weight<e>).
    Load the result with `model.load_state_dict(sd, strict=False)` where the model has `_extra_state` entries.
    `partial=True` maps a part of a checkpoint (the streaming loader's: every fused tensor's parts together) without
    the completeness check; `copy=False` returns renamed tensors as views of the inputs instead of clones.
    """
    import torch

    if not partial:
        _check_complete(dict(hf_state), cfg)
    clone = (lambda t: t.clone()) if copy else (lambda t: t)
    inv_global = {v: k for k, v in _GLOBAL_RENAMES.items()}
    inv_layer = {v: k for k, v in _LAYER_RENAMES.items() if k != "self_attention.linear_qkv.layer_norm_weight"}
    if te_spec:
        inv_layer["input_layernorm.weight"] = "self_attention.linear_qkv.layer_norm_weight"
    out: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    fc1: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name, tensor in hf_state.items():
        t = tensor.detach()
        if name in inv_global:
            out[inv_global[name]] = clone(t)
            continue
        layer, rest = _layer_and_rest(_HF_LAYER, name, "no Megatron name for HF parameter")
        prefix = f"decoder.layers.{layer}."
        if rest in inv_layer:
            out[prefix + inv_layer[rest]] = clone(t)
        elif rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            qkv.setdefault(layer, {})[rest[len("self_attn.")]] = t  # "q" | "k" | "v"
        elif (e := _HF_EXPERT.fullmatch(rest)) is not None:
            expert, proj = int(e.group(1)), e.group(2)
            if proj == "down":
                key = (
                    f"mlp.experts.linear_fc2.weight{expert}"
                    if te_spec
                    else (f"mlp.experts.local_experts.{expert}.linear_fc2.weight")
                )
                out[prefix + key] = clone(t)
            else:
                fc1.setdefault((layer, expert), {})[proj] = t
        else:
            raise KeyError(f"no Megatron name for HF parameter {name!r}")
    for layer, parts in qkv.items():
        out[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"] = merge_qkv(
            parts["q"], parts["k"], parts["v"], cfg
        )
    for (layer, expert), parts in fc1.items():
        key = (
            f"mlp.experts.linear_fc1.weight{expert}"
            if te_spec
            else f"mlp.experts.local_experts.{expert}.linear_fc1.weight"
        )
        out[f"decoder.layers.{layer}.{key}"] = torch.cat([parts["gate"], parts["up"]], dim=0)  # (2F, H)
    return out


def hf_param_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name of the HF Qwen3-MoE checkpoint for `cfg`."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        names += [
            p + s
            for s in (
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "mlp.gate.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
            )
        ]
        for e in range(cfg.num_experts):
            names += [f"{p}mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")]
    return names


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the HF Qwen3-MoE checkpoint for `cfg`, by name (`hf_param_names`' order)."""
    H, F, d = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    by_suffix: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate.weight": (cfg.num_experts, H),
        "self_attn.q_proj.weight": (q, H),
        "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H),
        "self_attn.o_proj.weight": (H, q),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "gate_proj.weight": (F, H),
        "up_proj.weight": (F, H),
        "down_proj.weight": (H, F),
    }
    glob = {
        "model.embed_tokens.weight": (cfg.vocab_size, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (cfg.vocab_size, H),
    }
    out: dict[str, tuple[int, ...]] = {}
    for name in hf_param_names(cfg):
        if name in glob:
            out[name] = glob[name]
        else:
            rest = name.split(".", 3)[3]  # model.layers.{i}.<rest>
            out[name] = by_suffix[rest] if rest in by_suffix else by_suffix[rest.rsplit(".", 2)[-2] + ".weight"]
    return out


def _check_complete(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    expected = set(hf_param_names(cfg))
    missing, extra = expected - set(hf_state), set(hf_state) - expected
    if missing or extra:
        raise KeyError(
            f"HF state dict does not match the config: missing {sorted(missing)[:6]} ({len(missing)}), "
            f"unexpected {sorted(extra)[:6]} ({len(extra)})"
        )


def hf_config(cfg: ModelConfig, dtype: str = "fp32") -> dict:
    """The `config.json` of the HF Qwen3-MoE model with the shape of `cfg` (every layer sparse, untied head)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.moe_ffn_hidden_size,  # dense MLP width; unused since every layer is MoE
        "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
        "rope_theta": cfg.rotary_base,  # read by older transformers and by vLLM's config parsing
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "norm_topk_prob": cfg.moe_top_k > 1,  # = study.policy.model.norm_topk_prob: megatron pre-softmaxes for top-1
        "initializer_range": cfg.init_std,
        "dtype": _HF_DTYPE_NAMES[dtype],
        "torch_dtype": _HF_DTYPE_NAMES[dtype],
        "use_cache": True,
    }


def export_hf(
    model_or_state: torch.nn.Module | Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    dtype: str = "fp32",
) -> Path:
    """Write an HF Qwen3-MoE checkpoint (config.json + model.safetensors) that `transformers` and vLLM open.

    `model_or_state` is a Megatron GPTModel, a Megatron state dict, or an HF checkpoint state dict (recognised by
    its `model.` / `lm_head.` names). Returns `out_dir`.
    """
    from safetensors.torch import save_file

    from study.core.model_config import TORCH_DTYPES

    state = _state_of(model_or_state)
    is_hf = all(k.startswith(("model.", "lm_head.")) for k in state)
    hf_state = dict(state) if is_hf else megatron_to_hf(state, cfg)
    _check_complete(hf_state, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tdtype = TORCH_DTYPES[dtype]
    save_file(
        {k: v.detach().to(tdtype).contiguous() for k, v in hf_state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    os.chmod(out / "model.safetensors", FILE_MODE)  # safetensors writes 0600; the umask's mode, as every result file
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# A local HF checkpoint against a model shape (its config.json only: no weights loaded)
# ---------------------------------------------------------------------------------------------------------------------
def is_hf_checkpoint(directory: str | Path) -> bool:
    """True when `directory` has a config.json and at least one *.safetensors file."""
    directory = Path(directory)
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _roots(directory: Path) -> tuple[Path, ...]:
    """Where a file of the checkpoint may resolve to (real paths): the checkpoint's folder, and in a Hugging Face hub
    cache (a snapshot folder, REPO/snapshots/REVISION, whose files link to REPO/blobs/) that repository's blobs
    folder. ValueError when REPO/blobs is a link out of the repository (every path would count as inside)."""
    root = Path(os.path.realpath(directory, strict=True))
    repo = root.parent.parent
    blobs = repo / "blobs"
    if root.parent.name != "snapshots" or not os.path.lexists(blobs):
        return (root,)
    real = Path(os.path.realpath(blobs))
    if not real.is_relative_to(repo):
        raise ValueError(
            f"coldstart = {str(directory)!r}: the hub cache's {blobs} is a link to {real}, outside its repository "
            f"{repo}; valid: a blobs folder in the repository"
        )
    return (root, real) if real.is_dir() else (root,)


def confined(directory: Path, name: Any, source: str, what: str = "shard") -> Path:
    """`directory / name` when `name` is a relative path that stays in `directory` (no `..`, not absolute, its real
    path inside the checkpoint's folder or its hub cache's blobs, `_roots`) and names a file; ValueError naming
    `source` (the file that named it) otherwise. `what`: the kind of file, for the message."""
    where = f"coldstart = {str(directory)!r}: {source}"
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"{where}: {what} {str(name)[:100]!r}; valid: a file name in the checkpoint's folder")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"{where}: {what} {name[:200]!r} is outside the checkpoint's folder; valid: a file in it")
    path = directory / rel
    try:
        target = Path(os.path.realpath(path, strict=True))
        roots = _roots(directory)
    except (OSError, RuntimeError):  # missing, a link loop
        raise ValueError(f"{where}: {what} {name[:200]!r} is missing") from None
    if not any(target.is_relative_to(root) for root in roots):
        raise ValueError(
            f"{where}: {what} {name[:200]!r} is a link to {target}, outside the checkpoint's folder; valid: a file "
            "in it"
        )
    if not target.is_file():
        raise ValueError(f"{where}: {what} {name[:200]!r} is not a file")
    return path


def _rope_theta(hf: dict[str, Any]) -> Any:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return hf.get("rope_theta", params.get("rope_theta"))


def config_mismatches(hf: dict[str, Any], cfg: ModelConfig) -> list[str]:
    """'key: checkpoint X, model Y' for every HF config.json field that disagrees with `cfg` (empty: they match)."""
    heads = hf.get("num_attention_heads")
    expected: dict[str, tuple[Any, Any]] = {
        "model_type": (hf.get("model_type"), "qwen3_moe"),
        "vocab_size": (hf.get("vocab_size"), cfg.vocab_size),
        "hidden_size": (hf.get("hidden_size"), cfg.hidden_size),
        "num_hidden_layers": (hf.get("num_hidden_layers"), cfg.num_layers),
        "num_attention_heads": (heads, cfg.num_attention_heads),
        "num_key_value_heads": (hf.get("num_key_value_heads", heads), cfg.num_query_groups),
        "head_dim": (hf.get("head_dim", (hf.get("hidden_size") or 0) // (heads or 1)), cfg.head_dim),
        "num_experts": (hf.get("num_experts", hf.get("num_local_experts")), cfg.num_experts),
        "num_experts_per_tok": (hf.get("num_experts_per_tok"), cfg.moe_top_k),
        "moe_intermediate_size": (hf.get("moe_intermediate_size"), cfg.moe_ffn_hidden_size),
        "norm_topk_prob": (bool(hf.get("norm_topk_prob", False)), cfg.moe_top_k > 1),
        "tie_word_embeddings": (bool(hf.get("tie_word_embeddings", False)), False),
        "decoder_sparse_step": (hf.get("decoder_sparse_step", 1), 1),
        "mlp_only_layers": (list(hf.get("mlp_only_layers") or []), []),
        "rope_theta": (_rope_theta(hf), cfg.rotary_base),
        "rms_norm_eps": (hf.get("rms_norm_eps"), cfg.norm_eps),
    }
    out = [f"{key}: checkpoint {got!r}, model {want!r}" for key, (got, want) in expected.items() if got != want]
    max_pos = hf.get("max_position_embeddings")
    if not isinstance(max_pos, int) or max_pos < cfg.max_seq_len:
        out.append(f"max_position_embeddings: checkpoint {max_pos!r}, model needs >= {cfg.max_seq_len}")
    return out


def _checkpoint_spec(hf: dict[str, Any]) -> ModelSpec | None:
    """The model spec (a preset, or the preset with the fewest overrides) whose shape the HF config matches; None
    when none does (another architecture, tied embeddings, ...)."""
    heads = hf.get("num_attention_heads")
    shape = {
        "num_layers": hf.get("num_hidden_layers"),
        "hidden_size": hf.get("hidden_size"),
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads", heads),
        "head_dim": hf.get("head_dim"),
        "num_experts": hf.get("num_experts", hf.get("num_local_experts")),
        "moe_top_k": hf.get("num_experts_per_tok"),
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size"),
        "vocab_size": hf.get("vocab_size"),
        "rotary_base": _rope_theta(hf),
        "norm_eps": hf.get("rms_norm_eps"),
    }
    shape = {k: v for k, v in shape.items() if v is not None and k in SHAPE_FIELDS}
    found: list[tuple[int, ModelSpec]] = []
    for name in PRESETS:
        try:
            spec = model_spec({"preset": name, **shape})
        except ValueError:
            continue
        if not config_mismatches(hf, resolve_model(spec)):
            found.append((0 if isinstance(spec, str) else len(spec), spec))
    return min(found, key=lambda pair: pair[0])[1] if found else None


def _flow(spec: ModelSpec) -> str:
    """A model spec as a config spells it: 'tiny', or {preset: tiny, num_experts: 8}."""
    if isinstance(spec, str):
        return repr(spec)
    return "{" + ", ".join(f"{key}: {value}" for key, value in spec.items()) + "}"


def check_checkpoint(directory: str | Path, model: ModelSpec | ModelConfig) -> None:
    """Raise ValueError naming `coldstart` and `model` unless the HF checkpoint in `directory` can initialise the
    model shape `model` (a preset name, a model mapping, or a ModelConfig: config fields, tokenizer file). Reads
    config.json only (a file of the folder, `confined`): no weights are loaded."""
    directory = Path(directory)
    confined(directory, "config.json", "the folder", "file")
    try:
        hf = read_json(directory / "config.json")
    except (OSError, ValueError) as e:  # unreadable; not JSON, not UTF-8 or past a bound (runfiles.bounded)
        raise ValueError(f"coldstart = {str(directory)!r}: cannot read config.json ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"coldstart = {str(directory)!r}: config.json must hold an object")
    cfg = model if isinstance(model, ModelConfig) else resolve_model(model)
    diffs = config_mismatches(hf, cfg)
    if diffs:
        spec = _checkpoint_spec(hf)
        hint = f"set model = {_flow(spec)}" if spec else f"valid presets: {', '.join(PRESETS)}"
        named = "the given shape" if isinstance(model, ModelConfig) else _flow(model_spec(model))
        raise ValueError(
            f"coldstart = {str(directory)!r}: the HF checkpoint does not match model = {named} ("
            + "; ".join(diffs)
            + f"); {hint}"
        )
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(
            f"coldstart = {str(directory)!r}: the HF checkpoint has no tokenizer.json (save one with "
            "TaskTokenizer.save or the model's tokenizer.save_pretrained)"
        )
