"""Cold start: supervised fine-tuning of the MoE policy on task solutions until its pass@1 enters a band.

The paper starts RL from a cold-start fine-tuned model. RL has signal only when the G samples of a prompt disagree,
so the cold start stops as soon as the policy's mean pass@1 on the task's in-distribution eval set (k samples at
temperature 1 from the hf rollout engine) is inside a configured band (default 0.1-0.5), not when the loss is low.

1. Data: the task's training stream (`make_task(task, seed=seed)`, default knobs, never an eval prompt), fresh items
   every step. An example is `<bos> prompt solution <eos>`, right-padded with <pad>; the loss is the token-mean
   negative log-likelihood of the response tokens (solution and <eos>) only: prompt positions get no gradient.
2. Optimiser: AdamW, linear warmup then constant lr (the stopping step is not known in advance), global grad clip.
3. Stopping: every `eval_every` SFT steps. Inside the band: stop (status `in_band`). Above it: stop (status
   `overshoot`) and keep the closest checkpoint seen. Budget spent below it: status `budget`, closest checkpoint
   kept. The policy saved is always the checked checkpoint nearest to the band (distance 0 inside it).
4. Directory: `results/coldstart/{model}-{task}-{hash}/`, the hash over the resolved settings (`ColdStartSettings`,
   the model's shape and the init checkpoint's content included, the thread count not); `{model}` is the shape's
   label (`default`, or `default_e32_k8` for the default preset with 32 experts, top-8); a shape takes its base
   preset's recipe (PRESET_DEFAULTS). Built in a temporary sibling directory and renamed into place, under an
   exclusive lock, so a killed or racing builder never leaves a partial directory under the final name;
   `coldstart.json` is written last and marks it complete, so a complete directory is simply reused.

Directory contents:

    policy.pt             Megatron GPTModel state dict (torch.save; read with `read_policy_file`, which refuses a
                          file holding anything but tensors and plain values without running it;
                          policy.load_state_dict(state, strict=False))
    tokenizer.json, tokenizer_config.json, special_tokens_map.json     TaskTokenizer.load(directory)
    config.json, model.safetensors    HF Qwen3-MoE export: AutoModelForCausalLM / AutoTokenizer.from_pretrained
    coldstart.json        status, achieved pass@1, steps, settings, timings, the check trajectory, the loss curve

The directory, its lock and the CLI live in study/coldstart/store.py (`ensure_coldstart`, what the RL loop calls).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from study.core.model_config import (
    ModelConfig,
    ModelSpec,
    base_preset,
    model_label,
    model_spec,
    positive_int,
    resolve_model,
)
from study.data import tasks
from study.data.tokenizer import EOS_ID, MIN_VOCAB_SIZE, PAD_ID, TaskTokenizer, build_tokenizer
from study.run.rundir import atomic_write, manifest, write_json

if TYPE_CHECKING:  # imported where a tensor is made: a run's plan reads the settings without loading torch
    import torch

FORMAT_VERSION = 1
"""Bumped when the directory layout or the training recipe changes meaning (it is part of the hash)."""

MAX_SEED = 2**32 - 1
"""Largest cold-start seed: the policy's initialisation (seed) and each check's sampling (seed x 1,000,003 + step)
seed torch's generators, which take seeds below 2**64."""

STATUSES = ("in_band", "overshoot", "budget")
"""Outcome of a cold start: pass@1 inside the band / jumped above it / step budget spent below it."""


# ---------------------------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColdStartSettings:
    """Everything that determines a cold-start checkpoint; all of it (but `threads`) is hashed into its directory."""

    model: str | dict[str, Any] = "tiny"
    """Model shape: a preset name (study.core.model_config.PRESETS) or a preset plus overrides, {preset: default,
    num_experts: 32} (study.core.model_config.model_spec; kept canonical, so a plain preset hashes as before)."""
    task: str = "chain_sum"
    """Task whose solutions are imitated and whose in_dist eval set is scored (study.data.tasks.TASKS)."""
    knobs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Task knobs of the SFT stream and of the in_dist set it is checked on (study.data.tasks.make_task; {} = the
    task's defaults): a run's cold start trains on the run's `task_knobs`."""
    band: tuple[float, float] = (0.1, 0.5)
    """Target mean pass@1 band [low, high]; training stops as soon as a check lands inside it."""
    seed: int = 0
    """Seed of the initialisation, the data stream and the eval sampling."""
    batch_size: int = 64
    """Examples per SFT step."""
    lr: float = 5e-3
    """Peak AdamW learning rate (after warmup; constant afterwards)."""
    warmup_steps: int = 20
    """Linear warmup from lr / warmup_steps to lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    max_steps: int = 1500
    """SFT step budget; reaching it below the band ends with status `budget`."""
    eval_every: int = 50
    """Check pass@1 every this many SFT steps."""
    eval_size: int = 64
    """Problems of the in_dist eval set used for the check (a prefix of it)."""
    eval_samples: int = 4
    """k samples per problem for mean pass@1."""
    max_new_tokens: int = 64
    """Response length limit of the check's samples (the longest default-knob solution must fit)."""
    tokenizer_n_per_task: int = 400
    """Corpus size of the tokenizer (build_tokenizer's n_per_task) when no init checkpoint brings one."""
    init: str | None = None
    """Start from this checkpoint (a directory with policy.pt [and tokenizer.json], or a .pt state dict) instead of
    a random initialisation; its content hash, not its path, goes into the directory hash."""
    held_out_test: bool = False
    """The SFT stream also leaves out the test pool of `knobs` (study.data.tasks.held_out_test_set): the cold start of
    runs with a test split (hashed only when true)."""
    threads: int = 1
    """torch threads while training (not hashed: it changes speed, and float summation order only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", model_spec(self.model))
        if self.model_config.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"model.vocab_size = {self.model_config.vocab_size}: must be >= {MIN_VOCAB_SIZE} (the "
                "tokenizer's 256 bytes and special tokens)"
            )
        if self.task not in tasks.TASKS:
            raise ValueError(f"coldstart.task = {self.task!r}; valid: {', '.join(tasks.TASKS)}")
        if not isinstance(self.knobs, dict):
            raise ValueError(f"coldstart.knobs = {self.knobs!r}; valid: a mapping of task knobs")
        tasks.resolve_knobs(self.task, **self.knobs)  # errors name the knob and its valid values
        object.__setattr__(self, "knobs", dict(sorted(self.knobs.items())))
        lo, hi = _pair(self.band)
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"coldstart.band = {self.band!r}; valid: (low, high) with 0 <= low < high <= 1")
        object.__setattr__(self, "band", (lo, hi))
        for name in (
            "batch_size",
            "max_steps",
            "eval_every",
            "eval_size",
            "eval_samples",
            "max_new_tokens",
            "threads",
            "tokenizer_n_per_task",
        ):
            positive_int(f"coldstart.{name}", getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED:
            big = isinstance(self.seed, int) and self.seed.bit_length() > 256  # repr: too long, or past Python's limit
            shown = f"an integer of {self.seed.bit_length()} bits" if big else repr(self.seed)
            raise ValueError(f"coldstart.seed = {shown}: valid: an integer in 0..{MAX_SEED}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ValueError(f"coldstart.warmup_steps = {self.warmup_steps!r}: must be a non-negative integer")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"coldstart.lr = {self.lr!r}: must be a positive number")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("coldstart.weight_decay and coldstart.grad_clip must be >= 0")
        max_eval = tasks.EVAL_SPECS[(self.task, "in_dist")].size
        if self.eval_size > max_eval:
            raise ValueError(f"coldstart.eval_size = {self.eval_size}: valid range is [1, {max_eval}]")
        if self.init is not None:
            object.__setattr__(self, "init", str(self.init))
            _init_policy_path(self.init)  # raises if missing

    @property
    def model_config(self) -> ModelConfig:
        """The model's resolved shape (the preset with the overrides)."""
        return resolve_model(self.model)

    @property
    def label(self) -> str:
        """The shape's readable name (study.core.model_config.model_label): `default`, `default_e32_k8`."""
        return model_label(self.model)

    def hashed(self) -> dict[str, Any]:
        """The fields that name the directory (init replaced by its content hash)."""
        fields = dataclasses.asdict(self)
        fields.pop("threads")
        fields["band"] = list(self.band)
        if not self.knobs:  # the task's defaults: directories of cold starts made before knobs existed stay valid
            fields.pop("knobs")
        if not self.held_out_test:
            fields.pop("held_out_test")
        if self.init is not None:
            fields["init"] = _file_sha256(_init_policy_path(self.init))
        fields["format_version"] = FORMAT_VERSION
        return fields

    @property
    def digest(self) -> str:
        """12 hex digits of the sha256 of `hashed()`."""
        text = json.dumps(self.hashed(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def dirname(self) -> str:
        """`{label}-{task}-{digest}`: the shape's label (`default`, `default_e32_k8`), the task, the settings' hash
        (which holds the whole shape, so two shapes never share a directory)."""
        return f"{self.label}-{self.task}-{self.digest}"


PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    # Measured on one CPU thread, chain_sum, seed 0, on a shared, loaded 2-core machine: tiny reaches pass@1 0.109
    # after 800 steps (~125 s CPU, 235 s wall); default 0.109 after 525 steps (394 s wall). pass@1 climbs by about
    # 0.02 per check near the band, so these check intervals do not jump over it.
    "tiny": dict(batch_size=64, lr=5e-3, warmup_steps=20, max_steps=1500, eval_every=50),
    "default": dict(batch_size=32, lr=2e-3, warmup_steps=30, max_steps=1500, eval_every=25),
    "small": dict(batch_size=32, lr=5e-4, warmup_steps=50, max_steps=3000, eval_every=50),
}
"""Recipe per model preset (the SFT batch, lr and budget that reach the band quickly); explicit arguments win. A
shape with overrides takes its base preset's recipe."""


def resolve_settings(model: ModelSpec, task: str, **overrides: Any) -> ColdStartSettings:
    """The recipe of the model's base preset (PRESET_DEFAULTS) with `overrides` (ColdStartSettings fields; None =
    keep) on top. `model`: a preset name or a model mapping {preset: NAME, FIELD: VALUE, ...}."""
    spec = model_spec(model)
    valid = {f.name for f in dataclasses.fields(ColdStartSettings)} - {"model", "task"}
    unknown = set(overrides) - valid
    if unknown:
        raise ValueError(f"unknown coldstart setting(s) {sorted(unknown)}; valid: {', '.join(sorted(valid))}")
    fields = dict(PRESET_DEFAULTS.get(base_preset(spec), {}))
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ColdStartSettings(model=spec, task=task, **fields)


def _pair(band: Any) -> tuple[float, float]:
    if not isinstance(band, Sequence) or isinstance(band, str) or len(band) != 2:
        raise ValueError(f"coldstart.band = {band!r}; valid: (low, high) with 0 <= low < high <= 1")
    return float(band[0]), float(band[1])


def _init_policy_path(init: str | Path) -> Path:
    path = Path(init)
    if path.is_dir():
        path = path / "policy.pt"
    if not path.is_file():
        raise FileNotFoundError(f"coldstart.init = {init}: no such state dict (a directory with policy.pt or a .pt)")
    return path


def read_policy_file(path: str | Path, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """A cold start's policy.pt (or an init .pt): torch.load(weights_only=True), tensors and plain values only, so a
    file that holds anything else (a hostile pickle) is refused without running it. ValueError naming the file on
    any failure. `mmap`: map the tensors' storage instead of reading it (the pickle is still read and checked whole;
    a check that costs the pickle, not the weights)."""
    import torch

    path = Path(path)
    try:
        try:
            state = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
        except RuntimeError as err:  # torch.save's legacy (non-zip) format cannot be mapped: read it
            if not mmap or "_use_new_zipfile_serialization" not in str(err):
                raise
            state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:
        if "Weights only load failed" in str(err):
            why = (
                "refused, not loaded: it holds objects other than tensors and plain values (a tampered or foreign "
                "file); valid: a state dict of tensors, as `python -m study coldstart` writes"
            )
        else:
            first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
            why = f"not a readable state dict, cut short or another format ({type(err).__name__}: {first[:300]})"
        raise ValueError(f"{path}: {why}") from None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path}: not a state dict (a mapping of parameter names to tensors), a {type(state).__name__}"
        )
    return state


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# Batches and the loss
# ---------------------------------------------------------------------------------------------------------------------
def collate(
    tok: TaskTokenizer, items: Sequence[tasks.TaskItem], *, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded SFT batch of `<bos> prompt solution <eos>`: (input_ids, targets, loss_mask), each (B, S - 1).

    `targets[b, t]` is token t + 1 of example b; `loss_mask[b, t]` is 1 where that target is a response token
    (solution or <eos>), 0 on prompt tokens and padding (whose targets are <pad> = 0, a valid id)."""
    import torch

    examples = [tok.encode_example(item.prompt, item.solution) for item in items]
    longest = max(len(ids) for ids, _ in examples)
    if longest > max_len:
        raise ValueError(f"an SFT example has {longest} tokens > model.max_seq_len = {max_len}")
    tokens = torch.full((len(examples), longest), PAD_ID, dtype=torch.long)  # (B, S)
    response = torch.zeros((len(examples), longest), dtype=torch.bool)  # (B, S)
    for b, (ids, n_prompt) in enumerate(examples):
        tokens[b, : len(ids)] = torch.tensor(ids)
        response[b, n_prompt : len(ids)] = True
    return tokens[:, :-1], tokens[:, 1:], response[:, 1:].float()  # (B, S - 1) each


def sft_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean negative log-likelihood of the masked-in targets: (loss, metrics).

    input_ids, targets, loss_mask: (B, S). Targets where loss_mask is 0 do not enter the loss (nor its gradient)."""
    from study.policy.model import token_logp

    # (B, S) fp32, brought from the model's device to the CPU's loss mask (collate's), differentiably
    logp = token_logp(model, input_ids, targets).cpu()
    n = loss_mask.sum().clamp_min(1.0)
    # L = - sum_{b,t} m_bt log pi(y_bt | y_<t) / sum_{b,t} m_bt
    loss = -(logp * loss_mask).sum() / n
    return loss, {"loss": float(loss.detach()), "tokens": float(loss_mask.sum())}


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------------
def eval_pass_at_1(
    engine: Any,
    model: torch.nn.Module,
    tok: TaskTokenizer,
    items: Sequence[tasks.TaskItem],
    *,
    k: int,
    seed: int,
    max_new_tokens: int,
) -> tuple[float, float]:
    """(mean pass@1, truncation rate) of `model` on `items`: its weights pushed to the hf `engine`, k samples per
    problem at temperature 1, each scored by the task's verifier as it stands."""
    from study.core.weights import megatron_to_hf

    engine.load_weights(megatron_to_hf(model, model.study_config))
    prompts = [tok.encode_prompt(item.prompt) for item in items]
    rollout = engine.generate(
        prompts, k, seed=seed, temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=[EOS_ID]
    )
    scores: list[list[float]] = [[] for _ in items]
    for p, ids in zip(rollout.prompt_index, rollout.tokens, strict=True):
        text, _ = tok.decode_response(ids)
        scores[p].append(tasks.score(items[p], text))
    truncated = sum(r == "length" for r in rollout.finish_reasons) / len(rollout)
    return tasks.pass_at_1(scores), truncated


def probe_logp(model: torch.nn.Module, tok: TaskTokenizer, item: tasks.TaskItem) -> float:
    """Teacher-forced log-prob of `item`'s reference response under `model` (a fingerprint of the weights)."""
    import torch

    from study.policy.model import token_logp

    input_ids, targets, mask = collate(tok, [item], max_len=model.study_config.max_seq_len)  # (1, S) each
    with torch.no_grad():
        return float((token_logp(model, input_ids, targets).cpu() * mask).sum())


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------
def _band_distance(value: float, band: tuple[float, float]) -> float:
    return max(band[0] - value, value - band[1], 0.0)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class Check:
    """One check of the policy during SFT: its pass@1 against the band, and what that decides."""

    step: int
    """SFT steps trained when checked."""
    pass_at_1: float
    """Mean pass@1 on the in-distribution eval set (k samples at temperature 1)."""
    truncation_rate: float
    """Fraction of those samples cut at max_new_tokens."""
    loss: float
    """Mean SFT loss over the steps since the previous check (NaN at step 0)."""
    distance: float
    """Distance of pass@1 to the band (0 inside)."""
    outcome: str
    """"in_band" or "overshoot" (stop here), or "budget" (below the band: train on)."""
    wall_s: float
    """Seconds since the cold start began."""
    eval_s: float
    """Seconds this check took."""

    def row(self) -> dict[str, float]:
        """The check as coldstart.json's trajectory keeps it."""
        return {
            "step": self.step,
            "pass_at_1": self.pass_at_1,
            "truncation_rate": self.truncation_rate,
            "loss": self.loss,
            "wall_s": self.wall_s,
        }


def check_policy(
    engine: Any,
    model: torch.nn.Module,
    tok: TaskTokenizer,
    items: Sequence[tasks.TaskItem],
    settings: ColdStartSettings,
    step: int,
    *,
    loss: float,
    since: float,
) -> Check:
    """Score the policy's pass@1 at SFT `step` (the sampling seed derived from the settings' seed and the step) and
    place it against the band. `since`: the cold start's perf_counter start."""
    t = time.perf_counter()
    model.eval()
    seed = settings.seed * 1_000_003 + step
    score, truncated = eval_pass_at_1(
        engine, model, tok, items, k=settings.eval_samples, seed=seed, max_new_tokens=settings.max_new_tokens
    )
    model.train()
    lo, hi = settings.band
    outcome = "in_band" if lo <= score <= hi else "overshoot" if score > hi else "budget"
    now = time.perf_counter()
    distance = _band_distance(score, settings.band)
    return Check(
        step=step,
        pass_at_1=score,
        truncation_rate=truncated,
        loss=loss,
        distance=distance,
        outcome=outcome,
        wall_s=now - since,
        eval_s=now - t,
    )


def train_coldstart(settings: ColdStartSettings, out_dir: Path, *, progress: bool = False) -> dict[str, Any]:
    """Train per `settings` and write the directory's files into `out_dir` (coldstart.json last); its record."""
    import torch
    from tqdm import tqdm

    from study.core.weights import export_hf
    from study.policy.model import build_policy
    from study.policy.optim import build_optimizer
    from study.rollout import get_engine

    cfg = settings.model_config
    out_dir.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t_all = time.perf_counter()
    with _threads(settings.threads):
        # -- tokenizer and initial weights ---------------------------------------------------------------------
        t0 = time.perf_counter()
        init_path = _init_policy_path(settings.init) if settings.init is not None else None
        if init_path is not None and (init_path.parent / "tokenizer.json").is_file():
            tok = TaskTokenizer.load(init_path.parent)  # the checkpoint's own token ids
        else:
            tok = build_tokenizer(cfg.vocab_size, [settings.task], n_per_task=settings.tokenizer_n_per_task)
        if tok.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tok.vocab_size} ids > model.vocab_size = {cfg.vocab_size}")
        tok.save(out_dir, model_max_length=cfg.max_seq_len)
        times["tokenizer_s"] = time.perf_counter() - t0

        model = build_policy(cfg, seed=settings.seed, dtype="fp32")
        if init_path is not None:
            load_policy(model, read_policy_file(init_path), where=str(init_path))
        model.train()
        optimizer = build_optimizer(model, lr=settings.lr, weight_decay=settings.weight_decay)
        warmup = max(settings.warmup_steps, 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        engine = get_engine("hf", cfg, dtype="fp32")
        stream = tasks.make_task(
            settings.task, seed=settings.seed, held_out_test=settings.held_out_test, **settings.knobs
        )
        eval_items = tasks.eval_set(settings.task, "in_dist", size=settings.eval_size, knobs=settings.knobs)
        longest = max(len(tok.encode_prompt(i.prompt)) for i in eval_items) + settings.max_new_tokens
        if longest > cfg.max_seq_len:
            raise ValueError(f"eval prompt + max_new_tokens = {longest} > model.max_seq_len = {cfg.max_seq_len}")

        # -- SFT until the band ------------------------------------------------------------------------------------
        losses: list[float] = []
        checks: list[Check] = []
        best: tuple[Check, dict[str, torch.Tensor]] | None = None  # the check nearest the band and its weights
        train_s = 0.0

        bar = tqdm(
            total=settings.max_steps,
            desc=f"coldstart {settings.label}/{settings.task}",
            disable=not progress,
            file=sys.stderr,
        )
        step = 0
        while True:
            # a check every eval_every steps and at the budget's end; at step 0 only a given checkpoint is checked
            if (step % settings.eval_every == 0 or step == settings.max_steps) and (step or settings.init is not None):
                window = losses[-settings.eval_every :]
                record = check_policy(
                    engine,
                    model,
                    tok,
                    eval_items,
                    settings,
                    step,
                    loss=sum(window) / len(window) if window else math.nan,
                    since=t_all,
                )
                checks.append(record)
                if best is None or record.distance < best[0].distance:
                    best = (record, copy.deepcopy(model.state_dict()))
                bar.set_postfix(loss=f"{record.loss:.3f}", pass_at_1=f"{record.pass_at_1:.3f}")
                if record.outcome != "budget":
                    break
            if step >= settings.max_steps:
                break
            t = time.perf_counter()
            items = stream.take(settings.batch_size, start=step * settings.batch_size)
            input_ids, targets, loss_mask = collate(tok, items, max_len=cfg.max_seq_len)  # (B, S) each
            loss, _ = sft_loss(model, input_ids, targets, loss_mask)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"coldstart: non-finite SFT loss {float(loss)} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if settings.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
            step += 1
            train_s += time.perf_counter() - t
            bar.update(1)
        bar.close()
        times["train_s"], times["eval_s"] = train_s, sum(c.eval_s for c in checks)
        assert best is not None  # at least one check ran: max_steps >= 1
        chosen, weights = best
        model.load_state_dict(weights)

        # -- write: policy, HF export, the record last -----------------------------------------------------------
        t0 = time.perf_counter()
        # Tensors only: megatron's `_extra_state` entries are None (load with strict=False).
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        atomic_write(out_dir / "policy.pt", lambda tmp: torch.save(state, tmp))
        export_hf(model, cfg, out_dir)
        times["write_s"] = time.perf_counter() - t0
        times["total_s"] = time.perf_counter() - t_all
        record = {
            "status": checks[-1].outcome,  # how it ended; the weights kept are the check nearest the band
            "band": list(settings.band),
            "pass_at_1": chosen.pass_at_1,
            "truncation_rate": chosen.truncation_rate,
            "step": chosen.step,
            "steps_trained": step,
            "examples_seen": step * settings.batch_size,
            "probe_logp": probe_logp(model, tok, eval_items[0]),
            "settings": dataclasses.asdict(settings) | {"band": list(settings.band)},
            "hash": settings.digest,
            "hashed": settings.hashed(),
            "model_config": dataclasses.asdict(cfg),
            "tokenizer_vocab_size": tok.vocab_size,
            "timings": times,
            "checks": [c.row() for c in checks],
            "loss_curve": losses,
            "manifest": manifest(settings.seed, settings.threads),
        }
        write_json(out_dir / "coldstart.json", record)
    return record


def load_policy(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, where: str) -> None:
    """Load a Megatron state dict (strict=False for megatron's `_extra_state` entries; any other gap raises)."""
    result = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise KeyError(
            f"{where}: state dict does not fit the model: missing {missing[:4]}, "
            f"unexpected {result.unexpected_keys[:4]}"
        )
