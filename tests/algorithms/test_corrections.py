"""Mismatch corrections (TIS, MIS, IcePop) composed with losses: hand-derived numbers on the shared batch.

rho_t = pi_train_old / pi_rollout is set through rollout_logp = old_logp - log rho.
"""

import math

import pytest
import torch

import algorithms
from algorithms.grpo import grpo_loss
from algorithms.gspo import gspo_loss
from tests.algorithms.helpers import ADV, MASK, W_TOKEN, batch, grad_of

# GRPO's per-token terms on the shared batch (see test_losses.test_grpo_hand_numbers_and_gradient)
GRPO_TERMS = [[2.54, 1.8, 2.0], [-0.8, -1.1]]


def rollout_logp(old: torch.Tensor, rho: list[list[float]]) -> torch.Tensor:
    log_rho = torch.tensor([[math.log(x) for x in row] + [0.0] * (3 - len(row)) for row in rho])
    return torch.where(MASK.bool(), old - log_rho, -7.0)


def test_grpo_tis_hand_numbers() -> None:
    logp, old = batch(W_TOKEN)
    roll = rollout_logp(old, [[3.0, 1.0, 0.5], [1.5, 2.5]])
    loss, m = algorithms.get("grpo_tis").loss(logp, old, ADV, MASK, rollout_logp=roll)
    # weights min(rho, 2): [2, 1, 0.5], [1.5, 2]
    seq0 = (2.54 * 2 + 1.8 * 1 + 2.0 * 0.5) / 3
    seq1 = (-0.8 * 1.5 + -1.1 * 2) / 2
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, abs=1e-6)
    assert m["tis_trunc_frac"] == pytest.approx(2 / 5)
    assert m["tis_weight_mean"] == pytest.approx((2 + 1 + 0.5 + 1.5 + 2) / 5, abs=1e-6)
    # the clip decisions are grpo's (weights are positive)
    assert m["clip_frac_low"] == pytest.approx(1 / 5) and m["clip_frac_high"] == pytest.approx(1 / 5)
    # gradient: grpo's, each token scaled by its weight
    expected = torch.tensor([[0.0, -0.9 * 2 / 3 / 2, -1.0 * 2 * 0.5 / 3 / 2], [0.0, 1.1 * 2 / 2 / 2, 0.0]])
    torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-6, rtol=0)
    assert algorithms.get("grpo_tis").hparams["tis_c"] == 2.0
    assert algorithms.get("grpo_tis").needs_rollout_logp


def test_mis_drops_whole_sequences() -> None:
    mis = algorithms.with_mis(grpo_loss)
    logp, old = batch(W_TOKEN)
    # prod rho: 3 * 1 * 0.5 = 1.5 (kept, inside [1/3, 3]); 1.5 * 2.5 = 3.75 (dropped)
    roll = rollout_logp(old, [[3.0, 1.0, 0.5], [1.5, 2.5]])
    loss, m = mis(logp, old, ADV, MASK, rollout_logp=roll, eps_low=0.2, eps_high=0.27, mis_c=3.0)
    seq0 = sum(GRPO_TERMS[0]) / 3
    assert loss.item() == pytest.approx(-(seq0 + 0.0) / 2, abs=1e-6)  # G stays 2: the normaliser is grpo's
    assert m["mis_reject_frac"] == pytest.approx(2 / 5)
    assert grad_of(loss, logp)[1].abs().sum().item() == 0.0


def test_icepop_masks_tokens() -> None:
    icepop = algorithms.with_icepop(grpo_loss)
    logp, old = batch(W_TOKEN)
    # rho 6.0 and 0.4 fall outside [0.5, 5]: those two tokens are dropped, the normalisers stay
    roll = rollout_logp(old, [[6.0, 1.0, 0.4], [1.5, 2.5]])
    loss, m = icepop(logp, old, ADV, MASK, rollout_logp=roll)
    seq0 = (0.0 + 1.8 + 0.0) / 3
    seq1 = sum(GRPO_TERMS[1]) / 2
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, abs=1e-6)
    assert m["icepop_mask_frac"] == pytest.approx(2 / 5)


def test_corrections_stack() -> None:
    stacked = algorithms.with_icepop(algorithms.with_tis(grpo_loss))
    logp, old = batch(W_TOKEN)
    roll = rollout_logp(old, [[6.0, 1.0, 0.5], [1.5, 2.5]])
    loss, m = stacked(logp, old, ADV, MASK, rollout_logp=roll)
    # IcePop drops rho = 6; TIS weights the rest by min(rho, 2): [-, 1, 0.5], [1.5, 2]
    seq0 = (0.0 + 1.8 * 1 + 2.0 * 0.5) / 3
    seq1 = (-0.8 * 1.5 + -1.1 * 2) / 2
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, abs=1e-6)
    assert {"tis_weight_mean", "icepop_mask_frac"} <= set(m)


def test_mis_composes_with_sequence_level_gspo_and_token_corrections_do_not() -> None:
    try:
        algorithms.register("test_gspo_mis", label="GSPO + MIS")(algorithms.with_mis(gspo_loss))
        alg = algorithms.get("test_gspo_mis")
        assert set(alg.hparams) == {"eps_low", "eps_high", "mis_c"} and alg.ratio_level == "sequence"
        logp, old = batch([[1.0, 1.0, 1.0], [1.0, 1.0]])
        roll = rollout_logp(old, [[1.0, 1.0, 1.0], [2.0, 2.0]])  # prod 4 > 3: response 1 dropped
        loss, m = alg.loss(logp, old, ADV, MASK, rollout_logp=roll)
        assert loss.item() == pytest.approx(-(2.0 * 1.0 + 0.0) / 2, abs=1e-6)
        assert m["mis_reject_frac"] == pytest.approx(2 / 5)
    finally:
        algorithms.unregister("test_gspo_mis")
    with pytest.raises(ValueError, match="token-level correction cannot wrap a sequence-level ratio"):
        algorithms.register("test_gspo_tis", label="x")(algorithms.with_tis(gspo_loss))
    assert "test_gspo_tis" not in algorithms.names()


def test_corrections_need_rollout_logp() -> None:
    logp, old = batch(W_TOKEN)
    with pytest.raises(ValueError, match="rollout_logp"):
        algorithms.get("grpo_tis").loss(logp, old, ADV, MASK)
    with pytest.raises(ValueError, match="rollout_logp shape"):
        algorithms.get("grpo_tis").loss(logp, old, ADV, MASK, rollout_logp=old[:, :2])


def test_correction_hparams_are_validated() -> None:
    alg = algorithms.get("grpo_tis")
    with pytest.raises(ValueError, match=r"grpo_tis.tis_c = -1.*valid range is \(0.0, inf\)"):
        alg.check_hparams({"tis_c": -1})
