"""Invariants of every registered variant, property-tested with hypothesis.

- padding does not change the loss, its gradient on response tokens, or any metric;
- permuting the sequences of a batch (with their advantages) does not either;
- clip fractions lie in [0, 1] and low + high = total.
"""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import algorithms

NAMES = algorithms.names()


@st.composite
def batches(draw: st.DrawFn) -> dict:
    name = draw(st.sampled_from(NAMES))
    groups = draw(st.integers(1, 3))
    group_size = draw(st.integers(2, 4))
    b = groups * group_size
    t = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-4, 1e-2, 0.3, 1.5]))  # from inside GSPO's clip range to far off-policy
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, t + 1, (b,), generator=gen)  # empty responses allowed
    mask = (torch.arange(t)[None] < lens[:, None]).float()
    old = -torch.rand(b, t, generator=gen) * 4
    logp = old + scale * torch.randn(b, t, generator=gen)
    rewards = (torch.rand(b, generator=gen) > 0.5).float()
    roll = old + scale * torch.randn(b, t, generator=gen)
    return {
        "name": name,
        "group_size": group_size,
        "mask": mask,
        "old": old,
        "logp": logp,
        "rewards": rewards,
        "roll": roll,
    }


def run(alg: algorithms.Algorithm, logp, old, adv, mask, roll):  # type: ignore[no-untyped-def]
    logp = logp.clone().requires_grad_(True)
    hp = dict(alg.hparams)
    if "norm_len" in hp:
        hp["norm_len"] = 8  # a fixed constant: with 0 it is the padded width, which padding changes by design
    extra = {"rollout_logp": roll} if alg.needs_rollout_logp else {}
    loss, metrics = alg.loss(logp, old, adv, mask, **hp, **extra)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def assert_metrics_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (key, a[key], b[key])


@given(batches(), st.integers(1, 4), st.sampled_from([0.0, 1e4, -1e4, float("nan")]))
def test_padding_does_not_change_anything(data: dict, extra: int, garbage: float) -> None:
    alg = algorithms.get(data["name"])
    adv = alg.advantages(data["rewards"], data["group_size"])
    base = run(alg, data["logp"], data["old"], adv, data["mask"], data["roll"])

    def pad(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.cat([x, torch.full((x.shape[0], extra), value)], dim=1)

    padded = run(
        alg,
        pad(data["logp"], garbage),
        pad(data["old"], -garbage if math.isfinite(garbage) else garbage),
        adv,
        pad(data["mask"], 0.0),
        pad(data["roll"], garbage),
    )
    torch.testing.assert_close(padded[0], base[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(padded[1][:, : base[1].shape[1]], base[1], atol=1e-7, rtol=1e-5)
    assert (padded[1][:, base[1].shape[1] :] == 0).all()
    assert_metrics_close(padded[2], base[2])


@given(batches(), st.randoms(use_true_random=False))
def test_permuting_sequences_does_not_change_anything(data: dict, rnd) -> None:  # type: ignore[no-untyped-def]
    alg = algorithms.get(data["name"])
    adv = alg.advantages(data["rewards"], data["group_size"])
    base = run(alg, data["logp"], data["old"], adv, data["mask"], data["roll"])
    perm = list(range(adv.numel()))
    rnd.shuffle(perm)
    p = torch.tensor(perm)
    out = run(alg, data["logp"][p], data["old"][p], adv[p], data["mask"][p], data["roll"][p])
    torch.testing.assert_close(out[0], base[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[1], base[1][p], atol=1e-7, rtol=1e-5)
    assert_metrics_close(out[2], base[2])


@given(batches())
def test_clip_fractions_are_fractions(data: dict) -> None:
    alg = algorithms.get(data["name"])
    adv = alg.advantages(data["rewards"], data["group_size"])
    loss, grad, m = run(alg, data["logp"], data["old"], adv, data["mask"], data["roll"])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    for key in ("clip_frac", "clip_frac_low", "clip_frac_high"):
        assert 0.0 <= m[key] <= 1.0, (key, m[key])
    assert math.isclose(m["clip_frac_low"] + m["clip_frac_high"], m["clip_frac"], abs_tol=1e-6)
    assert m["ratio_min"] <= m["ratio_mean"] + 1e-6 and m["ratio_mean"] <= m["ratio_max"] + 1e-6
