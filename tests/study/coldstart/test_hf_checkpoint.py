"""Models from a Hugging Face config.json and checkpoints streamed shard by shard
(study.core.model_config.hf_model_config, study.coldstart.hf_import.HFCheckpoint): a random-weight Qwen3-MoE written by
transformers at a scaled-down shape (3 layers, 32 experts, top-8, several safetensors shards) loads into the policy and
exports back bit for bit; two ranks (EP 2, TP 2) stream it into their shards and hold exactly their slices; unsupported
configs are refused naming the field; the tokenizer and its chat template come from the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from study.coldstart.hf_import import HFCheckpoint, load_checkpoint
from study.core.model_config import PRESETS, hf_model_config, model_spec, resolve_model
from study.core.weights import export_hf
from study.data.tokenizer import train_tokenizer
from study.policy.model import build_policy
from tests.shared import free_port, set_rank_env

QWEN3_30B_A3B_BASE = {  # Qwen/Qwen3-30B-A3B-Base config.json
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151643,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 32768,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|bot|>{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3-MoE written by transformers' save_pretrained in several shards, with a tokenizer and a chat
    template."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    directory = tmp_path_factory.mktemp("qwen3moe")
    hf_cfg = Qwen3MoeConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=32,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf_cfg).float()
    with torch.no_grad():
        for p in model.parameters():  # norms are ones at init: make every tensor distinct
            p.normal_(0.0, 0.05)
    model.save_pretrained(directory, max_shard_size="300KB", safe_serialization=True)
    tok = train_tokenizer(["1 + 2 = 3", "<|user|> what is 4 + 5 <|bot|> 9"] * 20, vocab_size=300)
    tok.tokenizer.add_special_tokens(["<|user|>", "<|bot|>"])
    tok.chat_template = TEMPLATE
    tok.save(directory)
    return directory


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_checkpoint_loads_streaming_and_exports_bit_for_bit(checkpoint: Path, tmp_path: Path) -> None:
    from study.run.config import RunConfig

    assert len(list(checkpoint.glob("*.safetensors"))) >= 2 and (checkpoint / "model.safetensors.index.json").is_file()
    run = RunConfig(model=str(checkpoint))
    assert run.coldstart == str(checkpoint)  # the directory is the cold start
    cfg = run.model_config()
    assert (cfg.num_layers, cfg.num_experts, cfg.moe_top_k, cfg.vocab_size) == (3, 32, 8, 384)
    assert run.model == model_spec(run.model) and isinstance(run.model, dict)  # the shape, not the path
    _, weights = load_checkpoint(checkpoint, cfg)
    assert isinstance(weights, HFCheckpoint)
    policy = build_policy(cfg, seed=1)
    assert weights.load_into(policy) == sum(p.numel() for p in policy.parameters())
    out = export_hf(policy, cfg, tmp_path / "export")
    original, exported = _hf_tensors(checkpoint), _hf_tensors(out)
    assert set(original) == set(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def _rank_load(rank: int, port: int, directory: str, out: str) -> None:
    """One of two gloo ranks: per layout, the checkpoint streamed into this rank's shard, then the full weights
    gathered back; rank 0 saves them with every rank's element count."""
    set_rank_env(rank, port)
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from study.core.model_config import ParallelLayout
    from study.policy import parallel as P

    cfg = resolve_model(directory)
    results = {}
    for name, layout in {"ep2": ParallelLayout(expert=2, data=2), "tp2": ParallelLayout(tensor=2)}.items():
        model = build_policy(cfg, seed=7, routing_replay=False, parallel=layout)
        copied = torch.tensor([P.load_streamed(model, HFCheckpoint(directory, cfg).tensors())])
        held = torch.tensor([sum(p.numel() for p in model.parameters())])
        counts = [torch.zeros_like(copied) for _ in range(2)]
        torch.distributed.all_gather(counts, copied)
        results[name] = {"full": P.full_state_dict(model), "copied": [int(c) for c in counts], "held": int(held)}
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_stream_the_checkpoint_into_their_shards(checkpoint: Path, tmp_path: Path) -> None:
    """EP 2 and TP 2 (gloo, two processes): each rank streams the checkpoint and keeps its slice only (it copies
    exactly its shard's elements, less than the model); gathered back, the weights equal a one-process load."""
    import torch.multiprocessing as mp

    cfg = resolve_model(str(checkpoint))
    one = build_policy(cfg, seed=1)
    total = HFCheckpoint(checkpoint, cfg).load_into(one)
    want = {n: t for n, t in one.state_dict().items() if not n.endswith("_extra_state")}
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_load, args=(free_port(), str(checkpoint), str(out)), nprocs=2)
    for layout, got in torch.load(out, weights_only=False).items():
        assert got["copied"][0] == got["held"] < total and sum(got["copied"]) >= total, layout
        assert set(got["full"]) == set(want), layout
        assert all(torch.equal(got["full"][n], want[n]) for n in want), layout


def test_tokenizer_and_chat_template_come_from_the_checkpoint(checkpoint: Path) -> None:
    tok, _ = load_checkpoint(checkpoint, resolve_model(str(checkpoint)))
    assert tok.chat_template == TEMPLATE
    assert tok.format_prompt("1 + 2 = ") == "<|user|>1 + 2 = \n<|bot|>"
    ids = tok.encode_prompt("1 + 2 = ")
    assert ids[0] == tok.tokenizer.token_to_id("<|user|>") and ids[-1] == tok.tokenizer.token_to_id("<|bot|>")


def test_paper_model_config_maps_to_the_named_shape(tmp_path: Path) -> None:
    assert hf_model_config(QWEN3_30B_A3B_BASE) == PRESETS["qwen3-30b-a3b"]
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_BASE))
    assert model_spec(str(tmp_path)) == "qwen3-30b-a3b"  # config only, no weights: enough to plan


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "llama"}, "model_type"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "rope_scaling"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"num_experts": None}, "num_experts"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(change: dict, field: str) -> None:
    hf = {**QWEN3_30B_A3B_BASE, **change}
    if change.get("num_experts", 0) is None:
        del hf["num_experts"]
    with pytest.raises(ValueError, match=rf"config.json: {field}"):
        hf_model_config(hf)
