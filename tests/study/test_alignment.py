"""Rewards, advantages, response masks and minibatch indices line up through the RL loop's own code path.

Two levels:
1. End to end through `rl.run` (tiny preset, scratch weights, one step, 4 minibatches): each sample gets a unique
   advantage tag, so every row the loss sees names the engine sample it must be. Each row's mask length, pi_old
   log-probs and (first minibatch) pi_theta log-probs must be the engine's for that very sample; flipping ONE
   sample's advantage must negate that sample's per-token gradient d loss / d logp and leave every other row's
   gradient bit-identical.
2. Unit, on `study.batch.pad` + `token_logp` + `alg.loss` with a real tiny policy: flipping one sample's advantage
   changes the parameter gradient by exactly -2 x that sample's own contribution.
"""

import dataclasses
from pathlib import Path

import pytest
import torch

import algorithms
from study import parts, rl
from study.batch import pad
from study.core.model_config import preset
from study.policy.model import build_policy, token_logp
from study.run.config import load_config

B_PROMPTS, G, M, T = 4, 4, 4, 16


def _tag(i: int) -> float:
    """Unique advantage of sample i (alternating sign; |tag| identifies the sample)."""
    return (-1.0) ** i * (1.0 + i / 64.0)


def _one_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, flip: int | None = None) -> dict:
    """One RL step of `name` with tagged advantages (sample `flip`'s tag negated); what the engine returned and, per
    minibatch, what the loss saw and its gradient w.r.t. logp."""
    rec: dict = {"rollouts": [], "mb": []}
    real_get, real_engine = algorithms.get, parts.get_engine

    def get(n: str):  # type: ignore[no-untyped-def]
        alg = real_get(n)

        def advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
            tags = torch.tensor([_tag(i) for i in range(rewards.numel())])
            if flip is not None:
                tags[flip] = -tags[flip]
            return tags

        def loss(logp, old_logp, adv, mask, **kw):  # type: ignore[no-untyped-def]
            entry = {
                "adv": adv.clone(),
                "old": old_logp.detach().clone(),
                "logp": logp.detach().clone(),
                "mask": mask.clone(),
                "grad": None,
            }
            logp.register_hook(lambda g: entry.__setitem__("grad", g.detach().clone()))
            rec["mb"].append(entry)
            return alg.loss_fn(logp, old_logp, adv, mask, **kw)

        return dataclasses.replace(alg, loss_fn=loss, advantages_fn=advantages)

    def engine(*args, **kwargs):  # type: ignore[no-untyped-def]
        eng = real_engine(*args, **kwargs)
        generate = eng.generate

        def recording(*a, **k):  # type: ignore[no-untyped-def]
            out = generate(*a, **k)
            rec["rollouts"].append(out)
            return out

        eng.generate = recording
        return eng

    monkeypatch.setattr(algorithms, "get", get)
    monkeypatch.setattr(parts, "get_engine", engine)
    sets = [
        f"algorithm={name}",
        "coldstart=scratch",
        "steps=1",
        "eval_every=0",
        "checkpoint_every=0",
        f"prompts_per_step={B_PROMPTS}",
        f"group_size={G}",
        f"minibatches={M}",
        f"max_new_tokens={T}",
    ]
    cfg = load_config(preset="tiny", sets=sets)
    rl.run(cfg, tmp_path / f"flip{flip}", progress=False)
    monkeypatch.undo()
    assert len(rec["rollouts"]) == 1 and len(rec["mb"]) == M
    return rec


def _sample_of(adv: float) -> int:
    return min(range(B_PROMPTS * G), key=lambda i: abs(abs(_tag(i)) - abs(adv)))


@pytest.mark.parametrize("name", ["grpo", "gspo", "grpo_rr"])
def test_each_loss_row_is_its_engine_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    rec = _one_step(tmp_path, monkeypatch, name)
    rollout = rec["rollouts"][0]
    seen: list[int] = []
    for m, mb in enumerate(rec["mb"]):
        for row in range(mb["adv"].shape[0]):
            i = _sample_of(float(mb["adv"][row]))
            assert float(mb["adv"][row]) == pytest.approx(_tag(i), abs=1e-6), "advantage tag mangled"
            seen.append(i)
            n = len(rollout.tokens[i])
            assert mb["mask"][row].tolist() == [1.0] * n + [0.0] * (T - n), f"mask of sample {i}"
            # pi_old recomputed by the trainer = the engine's log-probs of the very same sample (fp32: ~1e-6)
            torch.testing.assert_close(mb["old"][row, :n], rollout.logprobs[i], atol=1e-4, rtol=0)
            if m == 0:  # the first update runs at pi_old: identical log-probs, no update in between
                assert torch.equal(mb["logp"][row, :n], mb["old"][row, :n])
            g = mb["grad"][row]
            assert g is not None and not g[n:].any(), "gradient leaks onto padding"
            # minimising the loss raises the log-prob of positive-advantage tokens: d loss / d logp < 0 there
            if m == 0:
                assert bool((torch.sign(g[:n]) == -torch.sign(mb["adv"][row])).all()), f"sign of sample {i}"
    assert sorted(seen) == list(range(B_PROMPTS * G)), "every sample in exactly one minibatch"


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_flipping_one_advantage_flips_only_that_samples_gradient(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    base = _one_step(tmp_path, monkeypatch, name)
    first = base["mb"][0]
    k = _sample_of(float(first["adv"][1]))  # a sample of the first minibatch (ratio exactly 1: no clipping)
    flipped = _one_step(tmp_path, monkeypatch, name, flip=k)
    a, b = first, flipped["mb"][0]
    rows = [_sample_of(float(x)) for x in a["adv"]]
    assert rows == [_sample_of(float(x)) for x in b["adv"]], "the same rows in the same order"
    for row, i in enumerate(rows):
        assert torch.equal(a["logp"][row], b["logp"][row])
        if i == k:
            assert float(b["adv"][row]) == -float(a["adv"][row])
            assert a["grad"][row].abs().sum() > 0
            torch.testing.assert_close(b["grad"][row], -a["grad"][row], atol=0, rtol=1e-6)
        else:
            assert torch.equal(b["grad"][row], a["grad"][row]), f"sample {i}'s gradient changed (flipped {k})"


@pytest.mark.parametrize("name", ["grpo", "gspo", "dr_grpo", "cispo"])
def test_one_sample_parameter_gradient_through_pad(name: str) -> None:
    """pad + token_logp (+ response positions) + alg.loss on a real tiny policy: flipping A_k changes the parameter
    gradient by exactly -2 x the gradient of sample k's own term."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    policy = build_policy(cfg, seed=1, dtype="fp32")
    alg = algorithms.get(name)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(6):
        p = torch.randint(3, 200, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
        r = torch.randint(3, 200, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        samples.append({"prompt": p, "response": r, "logp": torch.zeros(len(r)), "adv": _tag(i), "routes": None})
    batch = pad(samples, 6)

    def grads(adv: torch.Tensor, only: int | None = None) -> torch.Tensor:
        policy.zero_grad(set_to_none=True)
        lp = token_logp(policy, batch.input_ids, batch.targets, attention_mask=batch.attn_mask, positions=batch.pos)
        old = lp.detach()
        hp = alg.check_hparams({})
        extra = {"rollout_logp": old} if alg.needs_rollout_logp else {}
        if only is not None:  # sample `only`'s term alone: every other advantage 0
            adv = torch.where(torch.arange(len(adv)) == only, adv, 0.0)
        loss, _ = alg.loss(lp, old, adv, batch.mask, **hp, **extra)
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None])

    adv = batch.advantages.clone()
    k = 3
    g = grads(adv)
    flipped = adv.clone()
    flipped[k] = -flipped[k]
    g_flip = grads(flipped)
    g_k = grads(adv, only=k)
    torch.testing.assert_close(g_flip - g, -2 * g_k, atol=1e-6, rtol=1e-4)
    assert g_k.abs().sum() > 0
