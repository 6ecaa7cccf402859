"""The `vllm` engine's own process: one vLLM `LLM` (one data-parallel replica) driven over a socket by
study.rollout.vllm_engine.VLLMEngine in the trainer's process, and `WeightSync`, the worker extension through which
that client streams weights into every vLLM worker of the replica.

Started by the client as `python -m study.rollout.vllm_server` with the socket's file descriptor in
`STUDY_VLLM_FD`. Requests are `(op, kwargs)` tuples, answered `("ok", result)` or `("error", traceback)`; the client
raises the latter with the server's traceback. Inside the server vLLM runs its engine core in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the server already is the engine's process); with tensor parallelism on CUDA
vLLM starts one worker process per GPU itself, and `collective_rpc` reaches every one of them.

Weight sync (one bucket at a time, no full copy of the model anywhere): the client fills a shared-memory buffer
(a file in /dev/shm, mapped by the client and by every worker) with a bucket of HF-named tensors and sends their
(name, dtype, shape, offset) list; each worker views them in the buffer and feeds them to vLLM's layerwise in-place
reload (`initialize_layerwise_reload` once, the model's `load_weights` per bucket, `finalize_layerwise_reload` at the
end: the machinery behind vLLM's `reload_weights`), which runs each layer's weight processing once its last weight
has arrived. That reload keeps references to the tensors of a layer until the layer is complete, and a layer may
span buckets, so after each bucket a worker copies out of the buffer the tensors still held for incomplete layers
(`_detach_from`) before the client refills it; the rest went straight from the buffer into the weights (on CUDA:
the host-to-device copy).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightSync:
    """vLLM worker extension (`LLM(worker_extension_cls="study.rollout.vllm_server.WeightSync")`): its methods
    become the worker's, called by name through `collective_rpc`."""

    def study_attach(self, path: str, nbytes: int) -> int:
        """Map the client's shared bucket buffer (the file is unlinked by the client once every worker has it)."""
        self._study_buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return nbytes

    def _study_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def study_sync_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self._study_model())

    def study_sync_bucket(self, metas: list[tuple[str, str, tuple[int, ...], int]]) -> int:
        """Load one bucket: (HF name, dtype name, shape, byte offset) of each tensor in the shared buffer. The
        weights go to the loaders as views of the buffer; what the layerwise reload still holds afterwards (the
        weights of layers not complete yet) is copied out before the client refills the buffer."""
        model = self._study_model()
        weights = []
        for name, dtype, shape, offset in metas:
            dt = _DTYPES[dtype]
            n = dt.itemsize
            for s in shape:
                n *= s
            weights.append((name, self._study_buf[offset : offset + n].view(dt).view(shape)))
        model.load_weights(iter(weights))
        return _detach_from(self._study_buf)

    def study_sync_end(self, repack: bool) -> int:
        """Process the layers not yet processed; on CPU re-pack the fused-MoE weights (vllm_engine fact 3).
        Returns the number of MoE modules re-packed (0 on CUDA)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self._study_model()
        finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        if self.device.type != "cpu" or not repack:
            return 0
        return _repack_cpu_moe(model)

    def study_expert_shapes(self) -> list[tuple[int, ...]]:
        """(E_local, 2F / tp, H) of every routed-experts module's w13 (a check that the model is the one we think)."""
        return [tuple(m.w13_weight.shape) for m in self._study_model().modules() if hasattr(m, "w13_weight")]


def _detach_from(buf: torch.Tensor) -> int:
    """Replace every tensor the layerwise reload keeps for a layer not yet complete that lies in `buf` by a copy;
    returns the bytes copied. (vLLM keeps a loader call's arguments until the layer's last weight has arrived:
    vllm.model_executor.model_loader.reload.layerwise.LAYERWISE_INFO, LayerReloadingInfo.loaded_weights.)"""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    lo = buf.data_ptr()
    hi = lo + buf.numel()
    copied = 0
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu" and lo <= value.data_ptr() < hi:
                    bound.arguments[key] = value.clone()
                    copied += value.numel() * value.element_size()
    return copied


def _repack_cpu_moe(model: torch.nn.Module) -> int:
    """Re-pack every routed-experts module's w13/w2 into the CPU fused-MoE kernel layout; returns modules done."""
    from vllm._custom_ops import cpu_prepack_moe_weight

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


def _peak_rss_bytes(reset: bool) -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process in bytes; `reset` first resets the high-water mark (Linux clear_refs 5)."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmHWM"], fields["VmRSS"]


class Server:
    """The requests of one replica; each `op_*` answers one client request."""

    def __init__(self) -> None:
        self.llm: Any = None

    def op_start(self, llm_kwargs: dict[str, Any], threads: int) -> dict[str, Any]:
        from vllm import LLM

        if threads:
            torch.set_num_threads(threads)
        self.llm = LLM(**llm_kwargs)
        return {"expert_shapes": self.llm.collective_rpc("study_expert_shapes")}

    def op_attach(self, path: str, nbytes: int) -> None:
        self.llm.collective_rpc("study_attach", args=(path, nbytes))

    def op_sync_begin(self) -> None:
        self.llm.collective_rpc("study_sync_begin")

    def op_sync_bucket(self, metas: list[tuple[str, str, tuple[int, ...], int]]) -> int:
        return max(self.llm.collective_rpc("study_sync_bucket", args=(metas,)))  # bytes copied out, largest worker

    def op_sync_end(self, repack: bool) -> list[int]:
        done = self.llm.collective_rpc("study_sync_end", args=(repack,))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights
        return done

    def op_sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def op_wake(self, tags: list[str] | None) -> None:
        self.llm.wake_up(tags=tags)

    def op_generate(
        self,
        prompts: list[list[int]],
        n: int,
        seed: int,
        temperature: float,
        max_new_tokens: int,
        stop_token_ids: list[int],
        return_routes: bool,
    ) -> list[list[tuple[Any, ...]]]:
        """Per prompt, per child in order: (token ids, log-probs, finish reason, routes or None)."""
        import numpy as np
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=n,
                seed=seed + p * n,  # child j gets seed + p * n + j: one stream per sample
                temperature=temperature,
                max_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids,
                logprobs=0,  # the sampled token's log-prob only
                ignore_eos=False,
                detokenize=False,
            )
            for p in range(len(prompts))
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result = []
        for p, req in enumerate(outs):
            children = []
            for comp in sorted(req.outputs, key=lambda c: c.index):
                ids = list(comp.token_ids)
                lp = [step[tok].logprob for step, tok in zip(comp.logprobs, ids, strict=True)]
                routes = None
                if return_routes:  # (P + T - 1, layers, k) of (prompt + response)[:-1]
                    routes = np.asarray(comp.routed_experts)[: len(prompts[p]) + len(ids) - 1].astype(np.int16)
                children.append((ids, lp, comp.finish_reason, routes))
            result.append(children)
        return result

    def op_score(self, seqs: list[list[int]], starts: list[int], seed: int) -> list[list[float]]:
        """Teacher-forced log-probs of seqs[i][starts[i]:] (vLLM's prompt log-probs: raw, in any logprobs mode)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, seed=seed, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        result = []
        for seq, start, req in zip(seqs, starts, outs, strict=True):
            plp = req.prompt_logprobs  # [None, {tok: Logprob}, ...], one per prompt position
            result.append([plp[t][seq[t]].logprob for t in range(start, len(seq))])
        return result

    def op_memory(self, reset: bool) -> tuple[int, int]:
        return _peak_rss_bytes(reset)

    def op_close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


def main() -> int:
    from multiprocessing.connection import Connection

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (it is the engine's own)
    conn = Connection(int(os.environ["STUDY_VLLM_FD"]))
    server = Server()
    while True:
        try:
            op, kwargs = conn.recv()
        except EOFError:  # the client went away: nothing left to serve
            server.op_close()
            return 0
        try:
            result = getattr(server, f"op_{op}")(**kwargs)
        except BaseException:  # every failure goes back to the client with its traceback
            conn.send(("error", traceback.format_exc()))
            if op == "start":
                return 1
            continue
        conn.send(("ok", result))
        if op == "close":
            return 0


if __name__ == "__main__":
    sys.exit(main())
