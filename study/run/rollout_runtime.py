"""How the vLLM rollout engine runs: a run's `rollout_runtime` (or the profile's), validated before any compute.
Runtime only: none of it is in the run id (study.run.config.NOT_HASHED). Read by study.rollout.vllm_engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PLACEMENTS: tuple[str, ...] = ("colocated", "separate")
"""Where the engine's GPUs are: shared with the trainer (asleep during the update) or its own."""


@dataclass(frozen=True)
class EngineSettings:
    """How the vLLM engine runs (`rollout_runtime: {tp: 2, gpu_memory: 0.4}` in a run config or the profile). None
    of it changes what a run computes beyond floating-point reduction order, so none of it is in the run id."""

    tp: int = 1
    """Tensor-parallel GPUs per replica."""
    dp: int = 1
    """Data-parallel replicas, one process each; the prompts of a batch are split between them."""
    ep: int = 1
    """Expert parallelism: 1 (experts tensor-sliced like every layer) or tp (each rank holds E / tp whole experts;
    vLLM's `enable_expert_parallel`, which spans a replica's tensor-parallel ranks)."""
    gpu_memory: float = 0.5
    """Fraction of each engine GPU's memory vLLM may take (weights, activations, KV cache): vLLM's
    gpu_memory_utilization. Colocated, the trainer gets the GPU while vLLM sleeps. Ignored on CPU."""
    placement: str = "colocated"
    """colocated: the engine shares the trainer's GPUs (replica r on GPUs r*tp..(r+1)*tp-1) and sleeps between
    rollout and update; separate: the engine has GPUs of its own (`gpus`) and stays awake."""
    gpus: tuple[int, ...] = ()
    """placement = separate: the GPU indices (of those visible to the run) the replicas use, tp * dp of them;
    () = the last tp * dp visible GPUs (the trainer takes the first)."""
    cuda_graphs: bool = True
    """CUDA: capture CUDA graphs for decoding (vLLM's default; False = enforce_eager). CPU: always eager."""
    bucket_mb: float = 256.0
    """Weight sync: MiB per bucket (the shared buffer is this or the largest single tensor, whichever is larger)."""
    kv_cache_gb: float = 0.0
    """CPU: GiB reserved for the KV cache; 0 = enough for max_num_seqs full-length sequences (64 MiB to 2 GiB)."""

    @classmethod
    def parse(
        cls, data: Mapping[str, Any] | EngineSettings | None, *, field: str = "rollout_runtime"
    ) -> EngineSettings:
        """Validated settings from a mapping; every error names `field.key`, the value and the valid values."""
        if isinstance(data, EngineSettings):
            return data
        data = dict(data or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{field}: unknown key(s) {unknown}; valid: {', '.join(names)}")
        if "gpus" in data:
            gpus = data["gpus"]
            if isinstance(gpus, int) and not isinstance(gpus, bool):
                gpus = [gpus]
            if not isinstance(gpus, list | tuple) or not all(isinstance(g, int) and g >= 0 for g in gpus):
                raise ValueError(f"{field}.gpus = {data['gpus']!r}: must be a list of GPU indices >= 0")
            data["gpus"] = tuple(gpus)
        for key in ("tp", "dp", "ep"):
            value = data.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}.{key} = {value!r}: must be an integer >= 1")
        for key, lo, hi in (("gpu_memory", 0.0, 1.0), ("kv_cache_gb", 0.0, float("inf")), ("bucket_mb", 0.0, 1e6)):
            value = data.get(key, getattr(cls, key))
            if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
                raise ValueError(f"{field}.{key} = {value!r}: valid range is [{lo}, {hi}]")
            data[key] = float(value)
        for key, hi in (("gpu_memory", 1.0), ("bucket_mb", 1e6)):
            if data.get(key) == 0.0:
                raise ValueError(f"{field}.{key} = 0.0: valid range is (0, {hi}]")
        if not isinstance(data.get("cuda_graphs", True), bool):
            raise ValueError(f"{field}.cuda_graphs = {data['cuda_graphs']!r}: must be true or false")
        out = cls(**data)
        if out.placement not in PLACEMENTS:
            raise ValueError(f"{field}.placement = {out.placement!r}; valid: {', '.join(PLACEMENTS)}")
        if out.ep not in (1, out.tp):
            raise ValueError(
                f"{field}.ep = {out.ep}: valid: 1 (experts tensor-sliced) or tp = {out.tp} (experts split over a "
                "replica's tensor-parallel ranks)"
            )
        if out.gpus and (
            out.placement != "separate" or len(out.gpus) != out.tp * out.dp or len(set(out.gpus)) != len(out.gpus)
        ):
            raise ValueError(
                f"{field}.gpus = {list(out.gpus)}: needs placement = 'separate' and tp * dp = {out.tp * out.dp} "
                "distinct indices"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """The non-default settings (what a config spells)."""
        default = EngineSettings()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }

    def replica_gpus(self, visible: int) -> list[list[int]]:
        """The GPU indices of each replica given `visible` GPUs; a clear error when there are not enough."""
        need = self.tp * self.dp
        if self.placement == "colocated":
            devices = list(range(need))
            if need > visible:
                raise ValueError(f"rollout_runtime: tp * dp = {need} GPUs colocated, {visible} visible")
        else:
            devices = list(self.gpus) or list(range(visible - need, visible))
            if visible < need + (0 if self.gpus else 1) or max(devices) >= visible or min(devices) < 0:
                raise ValueError(
                    f"rollout_runtime: placement = 'separate' needs tp * dp = {need} GPUs of the engine's own "
                    f"(gpus = {list(self.gpus) or 'the last ones'}) besides the trainer's; {visible} visible"
                )
        return [devices[r * self.tp : (r + 1) * self.tp] for r in range(self.dp)]
