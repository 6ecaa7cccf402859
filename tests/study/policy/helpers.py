"""What the policy's tests across ranks share (test_parallel.py, test_parallel_checkpoint.py,
test_routing_parallel.py, test_grouped_experts.py): the tiny preset's fixed global batch, its GSPO loss and one update
of it at a layout, and a short RL run at one process against the same run at a parallel layout."""

from __future__ import annotations

import pytest
import torch

from study.core.model_config import PRESETS
from tests.shared import free_port, set_rank_env

CFG = PRESETS["tiny"]
ROWS, WIDTH = 4, 17


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (B, S), mask (B, S-1) of real targets, advantages (B,), pi_old offsets (B, S-1): a fixed global batch."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (ROWS, WIDTH), generator=g)
    mask = torch.ones(ROWS, WIDTH - 1)
    mask[1, 11:] = 0
    mask[3, 8:] = 0
    adv = torch.randn(ROWS, generator=g)
    # pi_old != pi_theta: rows 0-1's sequence ratios leave the trust region on the clipped side, rows 2-3's do not
    side = torch.tensor([-1.0, -1.0, 1.0, 1.0]) * adv.sign()
    offsets = 0.1 * side[:, None] + 0.05 * torch.randn(ROWS, WIDTH - 1, generator=g)
    return ids, mask, adv, offsets


def forward(model, rows):
    from study.policy.model import token_logp

    ids, mask, _, _ = batch()
    return token_logp(model, ids[rows, :-1], ids[rows, 1:], attention_mask=mask[rows].long())  # right padded


def gspo_loss(logp_full):
    import algorithms

    _, mask, adv, offsets = batch()
    alg = algorithms.get("gspo")
    old = logp_full.detach() + offsets
    return alg.loss(logp_full, old, adv, mask, **alg.check_hparams({}))


def update_at_layout(model, trainer) -> dict:  # type: ignore[no-untyped-def]
    """One GSPO update of the global batch at a parallel layout: this rank's rows through `model`, megatron's
    reduction, then `trainer`'s clipped step. Returns rows, logp, loss, metrics, grads (every gradient after the
    reduction, full weights), took_step and norm (the global gradient norm before clipping)."""
    from study.policy import parallel as P

    trainer.zero_grad()
    rows = P.data_rows(ROWS)
    logp = forward(model, rows)
    loss, metrics = gspo_loss(P.gather_rows(logp, ROWS))
    loss.backward()
    trainer.reduce()
    grads = dict(P.full_weights(model, grads=True))
    trainer.reduce = lambda: None  # already reduced: step() clips and steps
    took_step, norm = trainer.step()
    return update_record(logp, loss, metrics, grads, rows=rows, took_step=took_step, norm=norm)


def update_record(logp, loss, metrics, grads, **more) -> dict:  # type: ignore[no-untyped-def]
    """One update of the global batch as a layout's and the one process's are compared: its log-probs and loss
    (detached), the loss's metrics, the gradients by name, and `more` (the grad norm, ...)."""
    return {"logp": logp.detach(), "loss": float(loss.detach()), "metrics": metrics, "grads": grads, **more}


# ---------------------------------------------------------------------------------------------------------------------
# The RL loop across ranks
# ---------------------------------------------------------------------------------------------------------------------
RUN_SETS = [
    "steps=2",
    "eval_every=0",
    "checkpoint_every=1",
    "prompts_per_step=4",
    "group_size=4",
    "minibatches=2",
    "max_new_tokens=16",
    "algorithm=grpo_rr",
    "task_knobs={terms: [2, 3], digits: 1}",
]
# The runs start from the session's `easy_coldstart` (tests/conftest.py): a random start earns no reward, so every
# advantage, loss and gradient of the runs would be 0 and the loops' updates would go unchecked.


def rl_worker(rank: int, port: int, sets: list[str], results: str, world: int = 2) -> None:
    set_rank_env(rank, port, world)
    from study import rl
    from study.run.config import load_config

    rl.run(load_config(preset="tiny", sets=sets), results, progress=False)
    torch.distributed.destroy_process_group()


ONE_PROCESS_RUN = (
    "import sys\nfrom study import rl\nfrom study.run.config import load_config\n"
    "print(rl.run(load_config(preset='tiny', sets=sys.argv[2:]), sys.argv[1], progress=False))"
)


def one_and_layout(tmp_path, sets: list[str], layout: list[str], world: int = 2):  # type: ignore[no-untyped-def]
    """The RL run of `sets` at one process (a subprocess, results under tmp_path/one) and with the `layout` sets on
    `world` gloo processes (under tmp_path/layout): the two run directories."""
    import subprocess
    import sys
    from pathlib import Path

    import torch.multiprocessing as mp

    from study.run.config import load_config

    one = (
        subprocess.run(
            [sys.executable, "-c", ONE_PROCESS_RUN, str(tmp_path / "one"), *sets],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    mp.spawn(rl_worker, args=(free_port(), [*sets, *layout], str(tmp_path / "layout"), world), nprocs=world)
    return Path(one), tmp_path / "layout" / "runs" / load_config(preset="tiny", sets=[*sets, *layout]).run_id


CLOSE = ("loss", "grad_norm", "approx_kl", "mismatch_mean_abs", "routing_slot_mismatch", "entropy_est")
"""The columns every layout's run equals the one-process run's in to rounding (`assert_same_run`)."""


def assert_same_run(a, b, close: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    """Two steps' metrics of the one-process run `a` and a layout's `b`: steps, rewards, lengths, clip fractions and
    token counts equal; the `close` columns equal to rounding (NaN equal to NaN: a step without signal)."""
    assert list(a["step"]) == list(b["step"]) == [1, 2]
    for column in ("reward_mean", "response_len_mean", "clip_frac", "tokens_total"):
        assert list(a[column]) == list(b[column]), column
    for column in close:
        assert list(b[column]) == pytest.approx(list(a[column]), rel=1e-4, abs=1e-6, nan_ok=True), column
