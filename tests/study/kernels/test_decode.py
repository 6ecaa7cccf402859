"""The C decode step and sampling loop (study/kernels/decode.py) against the hf engine's fused torch step: the same
logits to 1e-5, routes, cache writes and sampled tokens; the C sampler on the same uniforms as the torch one; and the
engine's fall-back to torch where the kernel is off or cannot be built."""

from __future__ import annotations

import pytest
import torch

from study.core import weights as W
from study.rollout import get_engine
from tests.study.rollout.conftest import CFG, STOPS, build_megatron, check_tempered_sampling, random_prompts

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def megatron():
    return build_megatron(CFG, seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, CFG.vocab_size, seed=11)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_c_sampler_draws_from_the_tempered_distribution(temperature):
    check_tempered_sampling(temperature, sampler="native")


@pytest.mark.parametrize(
    "experts, long",
    [(None, False), ("eager", False), (None, True)],
    ids=["grouped_mm", "eager", "long-cache"],
)
def test_native_decode_step_matches_the_fused_step(megatron, prompts, experts, long):
    """The C decode step (study/kernels/decode.py) gives the fused torch step's logits to 1e-5, the same routes and
    the same cache writes at every step of a left-padded rollout (run here by a Python loop over `step`); whole
    rollouts of the C loop sample the same tokens with the same log-probs (1e-5) and routes as the torch steps. Its
    sums run in another order, so not bit for bit. `long`: prompts of 60-75 tokens and 70 new tokens without stops,
    so the C attention's 64-position blocks run over the shared prompt and over each row's own positions."""
    from study.kernels import decode
    from study.rollout import hf

    cfg = CFG.replace(max_seq_len=256) if long else CFG  # room for the long rollout; the same weights
    if long:
        prompts = random_prompts(3, CFG.vocab_size, seed=12, lo=60, hi=76)

    assert decode.library() is not None, "the C step did not build (a C compiler is part of the test environment)"
    eng = get_engine("hf", cfg, experts_implementation=experts)
    eng.load_weights(W.megatron_to_hf(megatron, cfg))
    assert hf._NativeStep.eligible(eng.model)
    seen = []
    step = hf._NativeStep.step

    def both(self, tok, pos, routes):  # the native step, then the fused one on the cache as it was before
        before = [(c._kbuf.clone(), c._vbuf.clone(), c.length) for c in self.cache.layers]
        r_native, r_fused = [[] for _ in self.cache.layers], [[] for _ in self.cache.layers]
        got = step(self, tok, pos, r_native)
        written = [(c._kbuf.clone(), c._vbuf.clone()) for c in self.cache.layers]
        for c, (k, v, length) in zip(self.cache.layers, before, strict=True):
            c._kbuf.copy_(k), c._vbuf.copy_(v)
            c.length = length
        attend = None if self.decoder.attend is None else self.decoder.attend[:, None, None].bool()
        fused = hf._FusedDecoder(eng.model, self.decoder.shape.n, attend, self.cache)
        want = fused.step(tok, pos, r_fused)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for (k, v), c in zip(written, self.cache.layers, strict=True):  # positions past the length are unset
            torch.testing.assert_close(k[:, :, : c.length], c.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(v[:, :, : c.length], c.values, atol=1e-5, rtol=0)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(r_native, r_fused, strict=True))
        seen.append(tok.shape[0])
        for per_layer, r in zip(routes, r_native, strict=True):
            per_layer += r
        return got

    def python_loop(self, logits, pos, *, temperature, gen, stops, max_new_tokens, routes):  # the C loop, step by step
        n = self.decoder.shape.n
        toks, lps, length = [], [], torch.zeros(n, dtype=torch.long)
        done = torch.zeros(n, dtype=torch.bool)
        for k in range(max_new_tokens):
            twin = torch.Generator().set_state(gen.get_state())  # the C sampler on the same uniforms
            logp = hf.sampling_logp(logits, temperature)
            tok = hf.sample(logits, logp, temperature, gen)
            c_tok, c_lp = decode.sample(logits, temperature, twin)
            assert torch.equal(c_tok, tok)
            toks.append(tok), lps.append(c_lp)
            length += (~done).long()
            done |= torch.isin(tok, stops)
            if bool(done.all()) or k == max_new_tokens - 1:
                break
            pos = pos + 1
            logits = both(self, tok, pos, routes)
        return torch.stack(toks, 1), torch.stack(lps, 1), length, done

    kw = dict(seed=5, max_new_tokens=70 if long else 10, stop_token_ids=[] if long else STOPS, return_routes=True)
    loop = hf._NativeStep.generate
    hf._NativeStep.generate = python_loop
    try:
        checked = eng.generate(prompts, 3, **kw)
    finally:
        hf._NativeStep.generate = loop
    assert len(seen) >= 5 and set(seen) == {3 * len(prompts)}
    fast = eng.generate(prompts, 3, **kw)
    eng.native_decode = False
    ref = eng.generate(prompts, 3, **kw)
    for got in (checked, fast):
        assert got.tokens == ref.tokens and got.finish_reasons == ref.finish_reasons
        assert [len(r) for r in got.routes] == [len(r) for r in ref.routes]
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        for a, b in zip(got.routes, ref.routes, strict=True):
            assert torch.equal(a, b)


def test_native_decode_falls_back_to_torch(megatron, prompts, monkeypatch):
    """Turned off, or where the C step cannot be built, the engine decodes with torch ops (with a warning when the
    build failed) and samples the same tokens."""
    import study.kernels.build
    from study.kernels import decode

    eng = get_engine("hf", CFG)
    eng.load_weights(W.megatron_to_hf(megatron, CFG))
    kw = dict(seed=7, max_new_tokens=6, stop_token_ids=STOPS)
    want = eng.generate(prompts, 2, **kw).tokens

    def fresh() -> None:
        study.kernels.build.load.cache_clear()
        decode._library.cache_clear()

    try:
        fresh()
        monkeypatch.setenv("STUDY_NATIVE", "0")
        assert decode.library() is None
        assert eng.generate(prompts, 2, **kw).tokens == want
        fresh()
        monkeypatch.setenv("STUDY_NATIVE", "1")
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        monkeypatch.setattr(
            study.kernels.build, "FLAGS", (*study.kernels.build.FLAGS, "-DSTUDY_TEST_FAILING_BUILD")
        )  # not cached
        with pytest.warns(UserWarning, match="failed"):
            assert decode.library() is None
        assert eng.generate(prompts, 2, **kw).tokens == want
    finally:
        monkeypatch.undo()
        fresh()
