"""Shared pieces of the rollout-engine tests: a GQA-shaped tiny policy (4 query heads over 2 KV groups, head_dim 32
for vLLM's CPU attention) and Megatron weights made non-trivial (every norm weight perturbed, init std 0.1) so that
a swapped q/k norm, a mis-interleaved QKV or a gate/up swap changes the log-probs by far more than the tolerances."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from study.core.model_config import ModelConfig

_HERE = Path(__file__).parent
_QUIET = (
    "ignore:.*(Apex|Transformer Engine|TransformerEngine).*",
    "ignore:.*full scope is deprecated.*",
    "ignore:.*tp_group is None.*",
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
)

CFG = ModelConfig(num_attention_heads=4, num_query_groups=2, head_dim=32, init_std=0.1, max_seq_len=128)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            for spec in _QUIET:
                item.add_marker(pytest.mark.filterwarnings(spec))


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int, *, scale: float = 0.1) -> torch.nn.Module:
    """Add seeded noise to every parameter (norm weights too, which init leaves at exactly 1)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
    return model


def build_megatron(cfg: ModelConfig = CFG, seed: int = 0) -> torch.nn.Module:
    """The Megatron policy with perturbed weights, in eval mode."""
    from study.policy.model import build_policy

    return perturb_(build_policy(cfg, seed=seed), seed + 1000).eval()


def random_prompts(n: int, vocab: int, seed: int, lo: int = 2, hi: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in lens]


def megatron_logp(model: torch.nn.Module, prompts, responses, temperature: float = 1.0) -> list[torch.Tensor]:
    """Teacher-forced log-probs of each response under the Megatron model (of softmax(logits / temperature)), (T_i,)
    fp32, one sequence at a time."""
    from study.policy.model import token_logp

    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            seq = torch.tensor([*p, *r])[None]  # (1, S)
            lp = token_logp(model, seq[:, :-1], seq[:, 1:], temperature=temperature)[0]  # (S - 1,)
            out.append(lp[len(p) - 1 :])
    return out
