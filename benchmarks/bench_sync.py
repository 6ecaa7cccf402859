"""The weight sync trainer -> vLLM: the runs' streamed, bucketed sync into the engine's own process against an
in-process full-copy sync (the whole model cloned into an HF state dict, then vLLM's `reload_weights` on it), side by
side on the same machine, model and weights, one torch thread in every process. Not a test.

Each path runs in a fresh interpreter (its own memory accounting), starts its engine, then syncs `--syncs` + 1
times, every weight moved before each; it prints the median seconds of the syncs after the first, and the peak extra
memory of syncing: the process's peak RSS over all the syncs (Linux VmHWM, reset once the engine is up) minus its RSS
before the first sync, for the trainer's process and, for the separate engine, the engine's process too. Memory the
allocator keeps after a sync counts (it was taken for syncing). The bucketed path's shared buffer (bucket size, or
the largest tensor) is one physical copy counted in both processes' RSS once touched; its size is listed apart.
Then the log-prob parity (max |engine - Megatron| teacher-forced, 4 random sequences) after the last sync.

    .venv/bin/python benchmarks/bench_sync.py                               # `small` preset, fp32, 256 and 16 MiB
    .venv/bin/python benchmarks/bench_sync.py --preset default --buckets 256 --syncs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from study.rollout.vllm_server import _peak_rss_bytes


def _rss(reset: bool = False) -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process in bytes; `reset` resets VmHWM first (the engine server's own probe)."""
    return _peak_rss_bytes(reset)


def _model(preset_name: str):
    from study.core.model_config import preset
    from study.policy.model import build_policy

    cfg = preset(preset_name)
    if cfg.head_dim < 32:  # vLLM's CPU attention
        cfg = cfg.replace(head_dim=32)
    return cfg, build_policy(cfg, seed=0).eval()


def _move(policy: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))


def _parity(policy, cfg, score) -> float:
    """max |engine - Megatron| teacher-forced log-prob over 4 random sequences."""
    from study.policy.model import token_logp

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist() for _ in range(4)]
    prompts, resps = [s[:8] for s in seqs], [s[8:] for s in seqs]
    eng = torch.cat(score(prompts, resps))
    with torch.no_grad():
        mg = torch.cat([token_logp(policy, torch.tensor(s)[None, :-1], torch.tensor(s)[None, 1:])[0, 7:] for s in seqs])
    return float((eng - mg).abs().max())


def run_full_copy(preset_name: str, syncs: int) -> dict:
    """The baseline: vLLM in this process; per sync megatron_to_hf (a clone of every weight), reload_weights on
    the list, the CPU MoE re-pack, the prefix-cache reset."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import tempfile

    from vllm import LLM, SamplingParams

    from study.core.weights import hf_config, megatron_to_hf
    from study.rollout.vllm_server import _repack_cpu_moe

    cfg, policy = _model(preset_name)
    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config(cfg), f)
    llm = LLM(
        model=tmp,
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        max_model_len=cfg.max_seq_len,
        skip_tokenizer_init=True,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(cfg.max_seq_len, 8192),
        max_num_seqs=16,
        kv_cache_memory_bytes=64 << 20,
    )
    times = []
    _, before = _rss(reset=True)
    for i in range(syncs + 1):
        _move(policy, i)
        t = time.perf_counter()
        state = megatron_to_hf(policy, cfg)
        weights = [(k, v.detach().to("cpu").contiguous()) for k, v in state.items()]
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
        llm.collective_rpc(lambda w: _repack_cpu_moe(w.model_runner.get_model()))
        llm.reset_prefix_cache()
        del state, weights
        times.append(time.perf_counter() - t)
    peak = _rss()[0] - before

    def score(prompts, resps):
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, seed=0, detokenize=False)
        outs = llm.generate(
            [{"prompt_token_ids": p + r} for p, r in zip(prompts, resps, strict=True)], params, use_tqdm=False
        )
        return [
            torch.tensor([o.prompt_logprobs[t][(p + r)[t]].logprob for t in range(len(p), len(p) + len(r))])
            for o, p, r in zip(outs, prompts, resps, strict=True)
        ]

    parity = _parity(policy, cfg, score)
    model_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    return {
        "path": "in-process, full copy",
        "seconds": statistics.median(times[1:]),
        "trainer_peak_extra": peak,
        "engine_peak_extra": None,
        "model_bytes": model_bytes,
        "parity": parity,
    }


def run_bucketed(preset_name: str, syncs: int, bucket_mb: float) -> dict:
    """Today's path: the engine in its own process, iter_hf_weights streamed through the shared bucket buffer."""
    from study.core.weights import iter_hf_weights
    from study.rollout import get_engine

    cfg, policy = _model(preset_name)
    engine = get_engine(
        "vllm", cfg, max_num_seqs=16, threads=1, runtime={"bucket_mb": bucket_mb, "kv_cache_gb": 1 / 16}
    )
    try:
        ((_, engine_before),) = engine.memory(reset=True)
        _, before = _rss(reset=True)
        times = []
        for i in range(syncs + 1):
            _move(policy, i)
            t = time.perf_counter()
            engine.load_weights(iter_hf_weights(policy, cfg))
            times.append(time.perf_counter() - t)
        peak = _rss()[0] - before
        ((engine_peak, _),) = engine.memory()
        parity = _parity(policy, cfg, lambda p, r: engine.score(p, r)[0])
        model_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
        return {
            "path": f"own process, {bucket_mb:g} MiB buckets ({engine.last_sync['buckets']:.0f})",
            "seconds": statistics.median(times[1:]),
            "trainer_peak_extra": peak,
            "engine_peak_extra": engine_peak - engine_before,
            "model_bytes": model_bytes,
            "parity": parity,
            "buffer_bytes": engine.bucket_bytes,
        }
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--buckets", default="256,16", help="bucket sizes in MiB for the bucketed path, comma-separated")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one path in this interpreter, print JSON
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one:
        res = (
            run_full_copy(args.preset, args.syncs)
            if args.one == "full"
            else run_bucketed(args.preset, args.syncs, float(args.one))
        )
        print("RESULT " + json.dumps(res), flush=True)
        return
    mib = 1 << 20
    print(f"preset {args.preset}, fp32 trainer and engine, {args.syncs} syncs each, {os.cpu_count()} CPUs")
    print(
        f"{'path':<40} {'sync s':>8} {'trainer peak extra MiB':>23} {'engine peak extra MiB':>22} "
        f"{'buffer MiB':>11} {'parity':>9}"
    )
    for one in ["full", *args.buckets.split(",")]:
        proc = subprocess.run(
            [sys.executable, __file__, "--preset", args.preset, "--syncs", str(args.syncs), "--one", one],
            capture_output=True,
            text=True,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"{one}: failed\n{proc.stderr[-3000:]}")
        r = json.loads(lines[-1][len("RESULT ") :])
        eng = "-" if r["engine_peak_extra"] is None else f"{r['engine_peak_extra'] / mib:.1f}"
        buf = f"{r['buffer_bytes'] / mib:.1f}" if "buffer_bytes" in r else "-"
        print(
            f"{r['path']:<40} {r['seconds']:>8.3f} {r['trainer_peak_extra'] / mib:>23.1f} {eng:>22} {buf:>11} "
            f"{r['parity']:>9.1e}",
            flush=True,
        )
    print(f"model: {r['model_bytes'] / mib:.1f} MiB of fp32 weights")


if __name__ == "__main__":
    main()
