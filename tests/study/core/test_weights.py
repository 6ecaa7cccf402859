"""Megatron GPTModel <-> HF Qwen3-MoE weight mapping: exact round trips both ways, the fused layouts by hand, and
the same function in both frameworks (logits of Megatron == logits of transformers on mapped weights)."""

from __future__ import annotations

import pytest
import torch

from study.core import weights as W
from study.core.model_config import ModelConfig
from tests.study.rollout.conftest import CFG, build_megatron, random_prompts


@pytest.fixture(scope="module")
def megatron():
    return build_megatron(CFG, seed=0)


def _mg_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def test_round_trip_megatron_hf_megatron_exact(megatron):
    mg = _mg_state(megatron)
    hf = W.megatron_to_hf(megatron, CFG)
    assert set(hf) == set(W.hf_param_names(CFG))
    back = W.hf_to_megatron(hf, CFG)
    assert set(back) == set(mg)
    for k, v in mg.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_round_trip_hf_megatron_hf_exact(megatron):
    g = torch.Generator().manual_seed(3)
    hf = {k: torch.randn(v.shape, generator=g) for k, v in W.megatron_to_hf(megatron, CFG).items()}
    back = W.megatron_to_hf(W.hf_to_megatron(hf, CFG), CFG)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    # and the TE-spec names round-trip as well
    te = W.hf_to_megatron(hf, CFG, te_spec=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in te
    back = W.megatron_to_hf(te, CFG)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_loaded_back_into_megatron_is_the_same_model(megatron):
    from study.policy.model import build_policy

    other = build_policy(CFG, seed=7).eval()
    missing, unexpected = other.load_state_dict(W.hf_to_megatron(W.megatron_to_hf(megatron, CFG), CFG), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    for (k, a), (_, b) in zip(megatron.state_dict().items(), other.state_dict().items(), strict=True):
        if torch.is_tensor(a):
            assert torch.equal(a, b), k


def test_qkv_interleaving_by_hand():
    # 4 query heads over 2 groups, head_dim 1, hidden 1: row r of linear_qkv holds the value r.
    cfg = ModelConfig(hidden_size=1, num_attention_heads=4, num_query_groups=2, head_dim=1)
    qkv = torch.arange(8.0)[:, None]  # group 0: q0 q1 k0 v0 | group 1: q2 q3 k1 v1
    q, k, v = W.split_qkv(qkv, cfg)
    assert q.flatten().tolist() == [0, 1, 4, 5]
    assert k.flatten().tolist() == [2, 6]
    assert v.flatten().tolist() == [3, 7]
    assert torch.equal(W.merge_qkv(q, k, v, cfg), qkv)


def test_fc1_is_gate_then_up(megatron):
    hf = W.megatron_to_hf(megatron, CFG)
    fc1 = megatron.state_dict()["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    F = CFG.moe_ffn_hidden_size
    assert torch.equal(hf["model.layers.1.mlp.experts.2.gate_proj.weight"], fc1[:F])
    assert torch.equal(hf["model.layers.1.mlp.experts.2.up_proj.weight"], fc1[F:])


def test_unknown_or_missing_names_raise(megatron):
    mg = _mg_state(megatron)
    with pytest.raises(KeyError, match="no HF name"):
        W.megatron_to_hf({**mg, "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": torch.zeros(1)}, CFG)
    hf = W.megatron_to_hf(mg, CFG)
    del hf["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="missing"):
        W.hf_to_megatron(hf, CFG)


def _hf_model_from(state: dict[str, torch.Tensor], cfg: ModelConfig):
    from study.rollout.hf import HFEngine

    engine = HFEngine(cfg)
    engine.load_weights(state)
    return engine.model


@pytest.mark.parametrize("top_k", [2, 1])
def test_hf_logits_equal_megatron_logits(top_k):
    from study.policy.model import logits as mg_logits

    cfg = CFG.replace(moe_top_k=top_k)
    megatron = build_megatron(cfg, seed=1)
    hf_model = _hf_model_from(W.megatron_to_hf(megatron, cfg), cfg)
    for prompt in random_prompts(4, cfg.vocab_size, seed=5, lo=5, hi=40):
        ids = torch.tensor(prompt)[None]  # (1, S)
        with torch.no_grad():
            a = mg_logits(megatron, ids).float()  # (1, S, V)
            b = hf_model(input_ids=ids).logits.float()  # (1, S, V)
        assert a.std() > 0.5  # a non-trivial function, so the tolerance means something
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)


def test_export_opens_in_transformers(megatron, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from study.policy.model import logits as mg_logits

    W.export_hf(megatron, CFG, tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "qwen3_moe"
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and not model.config.tie_word_embeddings
    ids = torch.tensor(random_prompts(1, CFG.vocab_size, seed=9, lo=20, hi=21))  # (1, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, mg_logits(megatron, ids).float(), atol=2e-5, rtol=1e-5)
