"""bf16 training is megatron's mixed precision: bf16 compute over fp32 master weights, in the real and the emulated
mode. At the paper's lr (1e-6) an update is ~1e-2 of a typical weight's bf16 spacing (2^-8 x |w|): AdamW stepping
bf16 parameters in place rounds nearly every update away, while the masters accumulate it and the bf16 weights
follow once it passes half a spacing."""

from __future__ import annotations

import pytest
import torch

from study.core.model_config import PRESETS
from study.core.precision import Precision, apply_precision
from study.policy.model import build_policy, token_logp
from study.policy.optim import MasterWeightAdamW, build_optimizer

STEPS, LR = 30, 1e-6


def _train(spec: str, steps: int = STEPS, lr: float = LR):
    precision = Precision.parse(spec)
    model = build_policy(PRESETS["tiny"], seed=0, dtype=precision.storage_dtype)
    handle = apply_precision(model, precision)
    opt = build_optimizer(model, lr=lr)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, PRESETS["tiny"].vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        token_logp(model, ids[:, :-1], ids[:, 1:]).mean().backward()
        opt.step()
        handle.round_parameters_()
    return model, opt, before


def _moved(model, before) -> float:
    """The fraction of the layers' weights that changed (the embedding's unused rows never get a gradient)."""
    layers = [(p, before[n]) for n, p in model.named_parameters() if n.startswith("decoder.")]
    return sum(int((p != b).sum()) for p, b in layers) / sum(p.numel() for p, _ in layers)


@pytest.mark.parametrize("spec", ["bf16", "bf16-emulated"])
def test_bf16_weights_move_at_lr_1e_6(spec):
    model, opt, before = _train(spec)
    assert isinstance(opt, MasterWeightAdamW)
    if spec == "bf16":
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # real bf16 parameters, bf16 compute
    else:
        assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in model.parameters())  # stored rounded
    # the masters moved by about steps x lr (Adam's normalised step), the bf16 weights followed them
    named = zip(model.named_parameters(), opt.masters, strict=True)
    drift = torch.cat([(m - before[n].float()).abs().flatten() for (n, _), m in named if n.startswith("decoder.")])
    assert float(drift.median()) > 0.5 * STEPS * LR
    assert _moved(model, before) > 0.25  # measured 0.39 (pure bf16 AdamW: 0.03)
    for p, m in zip(model.parameters(), opt.masters, strict=True):  # the model holds its master, rounded
        assert torch.equal(p.float(), m.to(torch.bfloat16).float())


def test_pure_bf16_adamw_rounds_the_updates_away():
    """The failure mixed precision removes: torch AdamW on the bf16 parameters themselves."""
    model = build_policy(PRESETS["tiny"], seed=0, dtype="bf16")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = torch.randint(0, PRESETS["tiny"].vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        token_logp(model, ids[:, :-1], ids[:, 1:]).mean().backward()
        opt.step()
    assert _moved(model, before) < 0.1  # measured 0.03


def test_the_masters_survive_a_checkpoint():
    model, opt, _ = _train("bf16", steps=3)
    state = {k: v for k, v in opt.state_dict().items()}
    model2, opt2, _ = _train("bf16", steps=0)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, opt2.masters, strict=True))
    assert all(
        torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(opt.state.values(), opt2.state.values(), strict=True)
    )
    # a state dict without masters (torch AdamW's) takes them from the loaded weights
    opt2.load_state_dict({k: v for k, v in state.items() if k != "master_params"})
    assert all(torch.equal(m, p.float()) for m, p in zip(opt2.masters, model2.parameters(), strict=True))


def test_fp32_training_keeps_torch_adamw():
    model = build_policy(PRESETS["tiny"], seed=0, dtype="fp32")
    assert type(build_optimizer(model, lr=LR)) is torch.optim.AdamW


def test_a_parallel_layout_refuses_emulated_low_precision_training():
    from study.policy.parallel import ShardedTrainer

    model = build_policy(PRESETS["tiny"], seed=0, dtype="fp32")
    apply_precision(model, "bf16-emulated")
    with pytest.raises(ValueError, match="train_precision"):
        ShardedTrainer(model, lr=LR)


@pytest.mark.slow
def test_a_bf16_run_tracks_the_fp32_run(results):
    """A tiny GRPO run trained in bf16 (rollouts in fp32 for both, so the first step's batch is the same) gets the
    fp32 run's rewards: the first step's exactly, the later steps' on average within 0.1."""
    import json

    import pandas as pd

    from study import rl
    from study.run.config import load_config

    rewards = {}
    for prec in ("fp32", "bf16"):
        sets = [
            "algorithm=grpo",
            "steps=4",
            "eval_every=0",
            "checkpoint_every=0",
            f"train_precision={prec}",
            "rollout_precision=fp32",
        ]
        run_dir = rl.run(load_config(preset="tiny", sets=sets), results, progress=False)
        state = json.loads((run_dir / "status.json").read_text())
        assert state["state"] == "completed", state
        metrics = pd.read_parquet(run_dir / "metrics.parquet").set_index("step")
        rewards[prec] = metrics.loc[[1, 2, 3, 4], "reward_mean"].to_numpy()
    assert rewards["bf16"][0] == rewards["fp32"][0]
    assert abs(rewards["bf16"][1:].mean() - rewards["fp32"][1:].mean()) < 0.1, rewards
