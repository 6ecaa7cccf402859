"""The hf engine's router noise (a run's engine_router_noise): the engine routes with Gaussian noise on its router
logits that the trainer does not have. Off (0) it is today's engine; on, it runs the decoder layers (not the fused
or C decode step), is seeded by the call's seed, and its recorded routes (what R3 replays) are the noisy ones."""

from __future__ import annotations

import pytest
import torch

from study.core import weights as W
from study.rollout import get_engine, hf
from tests.study.rollout.conftest import CFG, build_megatron, random_prompts

STOPS = list(range(0, 512, 17))
KW = dict(seed=7, max_new_tokens=10, stop_token_ids=STOPS, return_routes=True)


@pytest.fixture(scope="module")
def weights():
    return W.megatron_to_hf(build_megatron(CFG, seed=0), CFG)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, CFG.vocab_size, seed=3)


def engine(weights, noise: float, **kw):  # type: ignore[no-untyped-def]
    eng = get_engine("hf", CFG, router_noise=noise, **kw)
    eng.load_weights(weights)
    return eng


def test_noise_below_rounding_is_the_noise_free_rollout_on_the_decoder_layers(weights, prompts, monkeypatch):
    """A noise that cannot move an fp32 logit (1e-30) samples exactly what the noise-free engine samples: the noise
    hooks recompute the router's top-k and gates as transformers does, on the decoder layers (the fused step does
    not run), and their generator leaves the sampling's stream alone."""
    clean = engine(weights, 0.0, native_decode=False).generate(prompts, 3, **KW)
    calls = []
    step = hf._FusedDecoder.step
    monkeypatch.setattr(hf._FusedDecoder, "step", lambda self, *a: calls.append(1) or step(self, *a))
    tiny = engine(weights, 1e-30, native_decode=False).generate(prompts, 3, **KW)
    assert not calls  # the decoder layers ran
    assert tiny.tokens == clean.tokens
    assert all(torch.equal(a, b) for a, b in zip(tiny.logprobs, clean.logprobs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(tiny.routes, clean.routes, strict=True))


def test_noisy_routes_are_seeded_recorded_and_differ_from_the_noise_free_routing(weights, prompts):
    eng = engine(weights, 1.0)
    a, b = eng.generate(prompts, 3, **KW), eng.generate(prompts, 3, **KW)
    assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.routes, b.routes, strict=True))
    other = eng.generate(prompts, 3, **{**KW, "seed": 8})
    assert other.tokens != a.tokens
    # the recorded routes are the noisy routers' choice: against the same engine's noise-free teacher-forced routing
    # of the same tokens (`score`), a share of the (token, layer) top-k sets differs; without noise none does
    ps = [prompts[i] for i in a.prompt_index]
    lps, scored = eng.score(ps, a.tokens, return_routes=True)
    # at the prompt's positions the first layer's router sees the same input with and without noise, so
    # there every difference is the noise itself (routes recorded before the noise would equal `score`'s there)
    first = (
        torch.cat(
            [
                (x[: len(p), 0].sort(-1).values != y[: len(p), 0].sort(-1).values).any(-1)
                for x, y, p in zip(a.routes, scored, ps, strict=True)
            ]
        )
        .float()
        .mean()
    )
    assert float(first) > 0.1
    flipped = (
        torch.cat(
            [(x.sort(-1).values != y.sort(-1).values).any(-1).flatten() for x, y in zip(a.routes, scored, strict=True)]
        )
        .float()
        .mean()
    )
    assert 0.1 < float(flipped) < 1.0
    gap = torch.cat([x - y for x, y in zip(a.logprobs, lps, strict=True)]).abs().mean()
    assert float(gap) > 1e-3  # the sampled tokens' log-probs are the noisy routing's
    clean = engine(weights, 0.0)
    c = clean.generate(prompts, 3, **KW)
    _, scored = clean.score([prompts[i] for i in c.prompt_index], c.tokens, return_routes=True)
    assert all(torch.equal(x.sort(-1).values, y.sort(-1).values) for x, y in zip(c.routes, scored, strict=True))


def test_a_bad_noise_is_refused(weights):
    with pytest.raises(ValueError, match=r"router_noise = -0\.1: must be a finite number >= 0"):
        get_engine("hf", CFG, router_noise=-0.1)
