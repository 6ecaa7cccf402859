"""Shared pieces of the rollout-engine tests: a GQA-shaped tiny policy (4 query heads over 2 KV groups, head_dim 32
for vLLM's CPU attention) and Megatron weights made non-trivial (every norm weight perturbed, init std 0.1) so that
a swapped q/k norm, a mis-interleaved QKV or a gate/up swap changes the log-probs by far more than the tolerances;
stop tokens that end some responses of a small batch; the check that a sampler draws from the tempered distribution
(the torch one here, the C one in tests/study/kernels)."""

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
STOPS = list(range(0, 512, 17))  # ~1 in 17 tokens stops: both finish reasons occur in a small batch


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


def _c_sample(logits, logp, temperature, gen):  # type: ignore[no-untyped-def]
    """The C sampler, checked as study.rollout.hf.sample is: it also returns the tempered log-probs of its draws."""
    from study.kernels import decode

    tok, lp = decode.sample(logits, temperature, gen)
    torch.testing.assert_close(lp, logp.gather(-1, tok[:, None])[:, 0], atol=1e-5, rtol=0)  # the tempered log-probs
    return tok


def check_tempered_sampling(temperature: float, sampler: str) -> None:
    """The engine's sampler (`sampler` "torch": study.rollout.hf.sample; "native": the C sampler of native decode)
    draws from the tempered distribution: 3 rows with known distributions (one with near-zero and exactly-zero
    probability tokens), 40k seeded draws per row, a chi-square goodness-of-fit test (deterministic: fixed seed) and no
    draw of a zero-probability token. The C sampler takes the same uniforms from the generator as the torch one."""
    from scipy.stats import chisquare

    from study.rollout import hf

    sample = hf.sample if sampler == "torch" else _c_sample
    logits = torch.tensor(
        [[0.0, 1.0, 2.0, 3.0, -1.0], [5.0, 5.0, -30.0, 0.0, 1.0], [0.0, float("-inf"), 0.5, -0.5, 0.0]]
    )
    logp = hf.sampling_logp(logits, temperature)
    reps = 40_000
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits.repeat(reps, 1), logp.repeat(reps, 1), temperature, gen).view(reps, 3)
    expected = torch.softmax(logits.double() / temperature, -1)
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=5).double()
        assert counts[expected[row] == 0].sum() == 0
        keep = expected[row] * reps >= 5  # chi-square cells need expected counts >= 5
        f_exp = expected[row][keep] * reps
        f_obs = counts[keep]
        p = chisquare(f_obs.numpy(), (f_exp * f_obs.sum() / f_exp.sum()).numpy()).pvalue
        assert p > 1e-3, (row, counts.tolist(), (expected[row] * reps).tolist())
    assert torch.equal(sample(logits, torch.log_softmax(logits, -1), 0.0, gen), logits.argmax(-1))
    if sampler == "native":  # on the same uniforms the same tokens as the torch sampler
        wide = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)) * 3
        for t in (1.0, 0.7, 1.7):
            g1, g2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
            want = hf.sample(wide, hf.sampling_logp(wide, t), t, g1)
            assert torch.equal(sample(wide, hf.sampling_logp(wide, t), t, g2), want)
