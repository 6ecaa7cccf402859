"""The step's samples for the trainer: the prompts the task stream gives (the `mastered` prompt filter), the
engine's samples laid out as right-padded teacher-forcing tensors (`Batch`, made by `pad`), and a minibatch's rows of
them with what its loss is computed against (`Minibatch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from study.data import tasks
from study.policy.routing import Routes

MAX_SKIPS_PER_PROMPT = 64
"""prompt_filter = mastered: draws skipped per prompt taken before the stream's next prompt is taken mastered or not
(a task whose every prompt is mastered would otherwise never yield one)."""


def take_unmastered(stream: Any, n: int, start: int, mastered: set[str]) -> tuple[list[tasks.TaskItem], int, int]:
    """The next `n` items of the stream from position `start` whose prompts are not in `mastered`: (items, the
    position after the last draw, draws skipped). After MAX_SKIPS_PER_PROMPT skips in a row the next item is taken
    as it is."""
    items: list[tasks.TaskItem] = []
    pos, skipped, run = start, 0, 0
    while len(items) < n:
        item = stream[pos]
        pos += 1
        if item.prompt in mastered and run < MAX_SKIPS_PER_PROMPT:
            skipped += 1
            run += 1
            continue
        items.append(item)
        run = 0
    return items, pos, skipped


@dataclass
class Batch:
    """The step's kept samples as right-padded teacher-forcing tensors (prompt + response, S = longest - 1)."""

    input_ids: torch.Tensor  # (B, S) long: sequence[:-1], 0 after its end
    targets: torch.Tensor  # (B, S) long: sequence[1:], 0 after its end
    attn_mask: torch.Tensor  # (B, S) long: 1 on real inputs
    pos: torch.Tensor  # (B, T) long: index into targets of response token t (T = max_new_tokens)
    mask: torch.Tensor  # (B, T) float: 1 on response tokens
    rollout_logp: torch.Tensor  # (B, T) fp32: the engine's log-probs of the sampled tokens, 0 after the end
    advantages: torch.Tensor  # (B,) the algorithm's advantages
    engine_routes: Routes | None = None  # (B, S, L, k) the engine's routes of input_ids, where it returned them
    temperature: float = 1.0  # the engine sampled from softmax(logits / T): pi_old, pi_theta and the reference too

    @property
    def n(self) -> int:
        return self.input_ids.shape[0]

    def minibatch(self, idx: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None) -> Minibatch:
        """The rows idx and what their loss is computed against: pi_old's log-probs `old_logp` (B, T) and the KL
        reference's `ref_logp` (B, T; None: no KL hook) of every row."""
        return Minibatch(
            idx,
            old_logp[idx],
            self.advantages[idx],
            self.mask[idx],
            self.rollout_logp[idx],
            None if ref_logp is None else ref_logp[idx],
        )


class Minibatch(NamedTuple):
    """Rows of the step's batch and what their loss is computed against."""

    idx: torch.Tensor  # (b,) the rows
    old_logp: torch.Tensor  # (b, T) pi_old's log-probs
    advantages: torch.Tensor  # (b,) the algorithm's advantages
    mask: torch.Tensor  # (b, T) float: 1 on response tokens
    rollout_logp: torch.Tensor  # (b, T) the engine's log-probs of the sampled tokens
    ref_logp: torch.Tensor | None  # (b, T) KL hook: the frozen reference's log-probs


def pad(samples: list[dict[str, Any]], max_new: int, multiple: int = 1, temperature: float = 1.0) -> Batch | None:
    """The samples as a right-padded `Batch` (None for none): each tensor filled by one scatter over all samples (a
    per-sample loop of slice writes was ~2% of a step at 8x4x32 and 32x8x64 on `tiny`). The width S is the longest
    sequence - 1, rounded up to a `multiple` (parallel.tensor: sequence parallelism splits S over the tensor-parallel
    ranks); the extra columns are padding like any other (causal attention: no real token sees them; masked out)."""
    n = len(samples)
    if n == 0:
        return None
    p_len = torch.tensor([len(s["prompt"]) for s in samples])
    r_len = torch.tensor([len(s["response"]) for s in samples])
    seq_len = p_len + r_len
    width = -(-(int(seq_len.max()) - 1) // multiple) * multiple
    flat = torch.tensor([tok for s in samples for part in (s["prompt"], s["response"]) for tok in part])
    rows = torch.repeat_interleave(torch.arange(n), seq_len)  # the sample of each flat token
    cols = torch.arange(len(flat)) - torch.repeat_interleave(seq_len.cumsum(0) - seq_len, seq_len)
    full = torch.zeros(n, width + 1, dtype=torch.long)
    full[rows, cols] = flat
    am = (torch.arange(width) < (seq_len - 1)[:, None]).long()
    steps = torch.arange(max_new)
    in_resp = steps < r_len[:, None]
    roll = torch.zeros(n, max_new)
    roll[in_resp] = torch.cat([torch.as_tensor(s["logp"], dtype=roll.dtype) for s in samples])
    engine_routes = None
    if samples[0]["routes"] is not None:
        r0 = samples[0]["routes"]
        r_rows = torch.tensor([s["routes"].shape[0] for s in samples])
        routes = torch.zeros(n, width, *r0.shape[1:], dtype=r0.dtype)
        routes[torch.arange(width) < r_rows[:, None]] = torch.cat([s["routes"] for s in samples])
        engine_routes = Routes(routes)
    return Batch(
        input_ids=full[:, :-1] * am,
        targets=full[:, 1:] * am,
        attn_mask=am,
        pos=(p_len[:, None] - 1 + steps).clamp(max=width - 1),  # target index of response token t
        mask=in_resp.float(),
        rollout_logp=roll,
        advantages=torch.tensor([s["adv"] for s in samples]),
        engine_routes=engine_routes,
        temperature=temperature,
    )
