"""Hand-derived numbers for every variant, with the arithmetic written out.

One shared batch: one group of G = 2 responses, padded to T = 3.
    response 0: 3 tokens, advantage A_0 = +2
    response 1: 2 tokens (+1 padding position), advantage A_1 = -1
Token ratios w = pi_theta / pi_old are set through logp = old_logp + log w; padding holds garbage (logp = 50) that
must not leak into any value or gradient.
"""

import math

import pytest
import torch

import algorithms
from algorithms.dapo import overlong_penalty
from tests.algorithms.helpers import ADV, MASK, W_TOKEN, batch, grad_of


def test_grpo_hand_numbers_and_gradient() -> None:
    logp, old = batch(W_TOKEN)
    loss, m = algorithms.get("grpo").loss(logp, old, ADV, MASK)
    # response 0 (A = 2, eps_high 0.27): min(1.5*2, 1.27*2) = 2.54 (clipped high); 0.9*2 = 1.8; 1.0*2 = 2.0
    seq0 = (2.54 + 1.8 + 2.0) / 3
    # response 1 (A = -1, eps_low 0.2): min(-0.5, -0.8) = -0.8 (clipped low); min(-1.1, -1.1) = -1.1
    seq1 = (-0.8 + -1.1) / 2
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, abs=1e-6)  # seq-mean-token-mean
    assert m["clip_frac_high"] == pytest.approx(1 / 5) and m["clip_frac_low"] == pytest.approx(1 / 5)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.9 + 1.0 + 0.5 + 1.1) / 5, abs=1e-6)
    assert (m["ratio_max"], m["ratio_min"]) == (pytest.approx(1.5), pytest.approx(0.5))
    # d(-J)/d logp_{i,t} = -(1/G)(1/|y_i|) w A on unclipped tokens, 0 on clipped tokens and padding
    expected = torch.tensor([[0.0, -0.9 * 2 / 3 / 2, -1.0 * 2 / 3 / 2], [0.0, 1.1 / 2 / 2, 0.0]])
    torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-6, rtol=0)


def test_grpo_clip_inactive_on_the_wrong_side() -> None:
    # w = 1.5 with A < 0 and w = 0.5 with A > 0: min() picks the unclipped branch, so nothing is clipped.
    logp, old = batch([[0.5, 1.0, 1.0], [1.5, 1.0]])
    loss, m = algorithms.get("grpo").loss(logp, old, ADV, MASK)
    seq0 = (0.5 * 2 + 2.0 + 2.0) / 3  # min(1.0, 0.8*2=1.6) = 1.0
    seq1 = (-1.5 + -1.0) / 2  # min(-1.5, -1.27) = -1.5
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, abs=1e-6)
    assert m["clip_frac"] == 0.0
    g = grad_of(loss, logp)
    assert g[0, 0].item() == pytest.approx(-0.5 * 2 / 3 / 2, abs=1e-6)  # gradient flows through both
    assert g[1, 0].item() == pytest.approx(1.5 / 2 / 2, abs=1e-6)


def test_grpo_ignores_nan_and_inf_padding() -> None:
    logp, old = batch(W_TOKEN)
    ref, _ = algorithms.get("grpo").loss(logp, old, ADV, MASK)
    for garbage in (float("nan"), float("inf"), -float("inf")):
        bad = torch.where(MASK.bool(), logp.detach(), garbage).requires_grad_(True)
        bad_old = torch.where(MASK.bool(), old, garbage)
        loss, m = algorithms.get("grpo").loss(bad, bad_old, ADV, MASK)
        assert loss.item() == pytest.approx(ref.item(), abs=1e-7)
        assert torch.isfinite(grad_of(loss, bad)).all()
        assert all(math.isfinite(v) for v in m.values())


def test_dapo_hand_numbers_and_token_mean() -> None:
    logp, old = batch(W_TOKEN)
    loss, m = algorithms.get("dapo").loss(logp, old, ADV, MASK)
    # eps_high 0.28: min(3.0, 1.28*2) = 2.56; then 1.8, 2.0; response 1: -0.8, -1.1; mean over all 5 tokens
    assert loss.item() == pytest.approx(-(2.56 + 1.8 + 2.0 - 0.8 - 1.1) / 5, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    # every token weighs 1/5 whatever its response's length
    expected = torch.tensor([[0.0, -0.9 * 2 / 5, -1.0 * 2 / 5], [0.0, 1.1 / 5, 0.0]])
    torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-6, rtol=0)
    assert algorithms.get("dapo").dynamic_sampling


def test_dapo_overlong_penalty() -> None:
    # Lmax = 10, Lcache = 0.2 * 10 = 2: 0 up to 8, ((10 - 2) - L) / 2 inside (8, 10], -1 beyond 10
    got = overlong_penalty(torch.tensor([3, 8, 9, 10, 11]), max_len=10)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    shaped = algorithms.get("dapo").reward_shaping(torch.tensor([1.0, 1.0]), torch.tensor([8, 9]), 10)
    torch.testing.assert_close(shaped, torch.tensor([1.0, 0.5]))


def test_dr_grpo_hand_numbers() -> None:
    logp, old = batch(W_TOKEN)
    alg = algorithms.get("dr_grpo")
    # clip 0.2/0.2: min(3.0, 1.2*2) = 2.4; 1.8; 2.0 -> sum 6.2; response 1: -0.8 - 1.1 = -1.9
    loss, _ = alg.loss(logp, old, ADV, MASK, norm_len=4)
    assert loss.item() == pytest.approx(-(6.2 / 4 + -1.9 / 4) / 2, abs=1e-6)
    loss_t, _ = alg.loss(logp, old, ADV, MASK)  # norm_len 0: the padded width T = 3
    assert loss_t.item() == pytest.approx(-(6.2 / 3 + -1.9 / 3) / 2, abs=1e-6)
    # advantages: r - mean, no std: group [1, 0] -> [0.5, -0.5]; group [1, 1, 1, 0]... (size 2 here)
    adv = alg.advantages(torch.tensor([1.0, 0.0, 0.3, 0.3]), 2)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_gspo_hand_numbers_and_eq10_gradient() -> None:
    # Token log-ratios l: response 0 [0.3, -0.1, 0.1] (mean 0.1), response 1 [-0.2, 0.0] (mean -0.1)
    logp, old = batch([[math.exp(0.3), math.exp(-0.1), math.exp(0.1)], [math.exp(-0.2), 1.0]])
    loss, m = algorithms.get("gspo").loss(logp, old, ADV, MASK, eps_low=0.1, eps_high=0.1)
    s0, s1 = math.exp(0.1), math.exp(-0.1)  # 1.10517, 0.90484
    # response 0: min(2 s0, 1.1 * 2) = 2.2 (clipped high); response 1: min(-s1, -clip(s1)) = -s1 (inside [0.9, 1.1])
    assert loss.item() == pytest.approx(-(2.2 - s1) / 2, abs=1e-6)
    assert m["clip_frac_high"] == pytest.approx(3 / 5)  # the clipped response counts all 3 of its tokens
    assert m["clip_frac_low"] == 0.0
    assert m["ratio_mean"] == pytest.approx((s0 + s1) / 2, abs=1e-6)
    assert (m["ratio_max"], m["ratio_min"]) == (pytest.approx(s0), pytest.approx(s1))
    # Eq. 10: grad J = (1/G) sum_i s_i A_i (1/|y_i|) sum_t grad log pi(y_{i,t}) over unclipped responses
    expected = torch.tensor([[0.0, 0.0, 0.0], [-(1 / 2) * s1 * -1.0 / 2, -(1 / 2) * s1 * -1.0 / 2, 0.0]])
    torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-6, rtol=0)


def test_gspo_eq10_on_random_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        b, t = 6, 9
        mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=gen)[:, None]).float()
        old = -torch.rand(b, t, generator=gen) * 3
        logp = (old + 1e-3 * torch.randn(b, t, generator=gen)).requires_grad_(True)
        adv = torch.randn(b, generator=gen)
        loss, _ = algorithms.get("gspo").loss(logp, old, adv, mask)
        n = mask.sum(-1)
        s = (((logp.detach() - old) * mask).sum(-1) / n).exp()
        eps_low, eps_high = algorithms.get("gspo").hparams.values()
        live = ~(((s < 1 - eps_low) & (adv < 0)) | ((s > 1 + eps_high) & (adv > 0)))
        # -(1/G) s_i A_i / |y_i| on every token of an unclipped response
        expected = -(live * s * adv / n)[:, None] * mask / b
        torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-7, rtol=1e-5)


def test_gspo_refuses_token_advantages() -> None:
    logp, old = batch(W_TOKEN)
    with pytest.raises(ValueError, match="per-sequence advantages"):
        algorithms.get("gspo").loss(logp, old, ADV[:, None].expand(2, 3), MASK)


@pytest.mark.parametrize("seed", range(6))
def test_gspo_token_equals_gspo_with_sequence_advantages(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t = 16, 7
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=gen)[:, None]).float()
    old = -torch.rand(b, t, generator=gen) * 2
    delta = torch.randn(b, t, generator=gen) * 2e-3  # around the 3e-4 / 4e-4 clip range: some clip, some not
    adv = torch.randn(b, generator=gen)
    results = []
    for name, a in (("gspo", adv), ("gspo_token", adv), ("gspo_token", adv[:, None].expand(b, t))):
        logp = (old + delta).requires_grad_(True)
        loss, m = algorithms.get(name).loss(logp, old, a, mask)
        results.append((loss.detach(), grad_of(loss, logp), m))
    (loss_ref, g_ref, m_ref), *others = results
    assert 0 < m_ref["clip_frac"] < 1, "the batch should exercise both clipped and unclipped responses"
    for loss, g, m in others:
        torch.testing.assert_close(loss, loss_ref, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(g, g_ref, atol=1e-8, rtol=1e-5)
        # ratio_mean differs by design: gspo_token's is token-weighted (its ratio is per token), gspo's per sequence
        for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "ratio_max", "ratio_min"):
            assert m[key] == pytest.approx(m_ref[key], abs=1e-6), key


def test_grpo_and_gspo_coincide_on_length_one_responses() -> None:
    gen = torch.Generator().manual_seed(1)
    b, t = 16, 4
    mask = torch.zeros(b, t)
    mask[:, 0] = 1.0  # every response is a single token
    old = -torch.rand(b, t, generator=gen)
    delta = torch.randn(b, t, generator=gen) * 0.5
    adv = torch.randn(b, generator=gen)
    out = {}
    for name in ("grpo", "gspo"):
        logp = (old + delta).requires_grad_(True)
        loss, m = algorithms.get(name).loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.25)
        out[name] = (loss.detach(), grad_of(loss, logp), m)
    torch.testing.assert_close(out["grpo"][0], out["gspo"][0])
    torch.testing.assert_close(out["grpo"][1], out["gspo"][1])
    assert out["grpo"][2]["clip_frac"] == pytest.approx(out["gspo"][2]["clip_frac"])
    assert out["grpo"][2]["clip_frac"] > 0


def test_replay_variants_share_their_loss() -> None:
    logp, old = batch(W_TOKEN)
    for plain, replay in (("grpo", "grpo_rr"), ("grpo", "grpo_r3"), ("gspo", "gspo_rr")):
        a, b = algorithms.get(plain), algorithms.get(replay)
        assert a.loss_fn is b.loss_fn and a.hparams == b.hparams
        adv = ADV
        la, ma = a.loss(logp, old, adv, MASK)
        lb, mb = b.loss(logp, old, adv, MASK)
        assert la.item() == lb.item() and ma == mb
    assert algorithms.get("grpo_rr").routing == "replay"
    assert algorithms.get("gspo_rr").routing == "replay"
    assert algorithms.get("grpo_r3").routing == "rollout_replay"
    assert algorithms.get("grpo").routing == algorithms.get("gspo").routing == "free"


def test_cispo_hand_numbers_and_gradient() -> None:
    logp, old = batch([[6.0, 0.9, 1.0], [0.5, 1.1]])
    loss, m = algorithms.get("cispo").loss(logp, old, ADV, MASK)
    # sg(min(w, 5)) A log pi: 5*2*(-1+log 6), 0.9*2*(-2+log .9), 1*2*(-0.5); 0.5*-1*(-1.5+log .5), 1.1*-1*(-0.3+log 1.1)
    lp = logp.detach()
    terms = [
        5 * 2 * lp[0, 0].item(),
        0.9 * 2 * lp[0, 1].item(),
        1.0 * 2 * lp[0, 2].item(),
        0.5 * -1 * lp[1, 0].item(),
        1.1 * -1 * lp[1, 1].item(),
    ]
    assert lp[0, 0].item() == pytest.approx(-1 + math.log(6.0))
    assert loss.item() == pytest.approx(-sum(terms) / 5, abs=1e-6)
    # gradient -sg(min(w, 5)) A / N on every token: no token loses its gradient
    expected = torch.tensor([[-5 * 2 / 5, -0.9 * 2 / 5, -1.0 * 2 / 5], [0.5 / 5, 1.1 / 5, 0.0]])
    torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-6, rtol=0)
    assert m["clip_frac"] == 0.0 and m["is_trunc_frac"] == pytest.approx(1 / 5)


def test_gmpo_hand_numbers_and_gradient() -> None:
    # l: response 0 [0.5, -0.1, 0.1], A = +2: clip above at 0.4; response 1 [-0.6, 0.2], A = -1: clip below at -0.4
    logp, old = batch([[math.exp(0.5), math.exp(-0.1), math.exp(0.1)], [math.exp(-0.6), math.exp(0.2)]])
    loss, m = algorithms.get("gmpo").loss(logp, old, ADV, MASK)
    r0 = math.exp((0.4 - 0.1 + 0.1) / 3)  # 1.14263
    r1 = math.exp((-0.4 + 0.2) / 2)  # 0.90484
    assert loss.item() == pytest.approx(-(2 * r0 + -1 * r1) / 2, abs=1e-6)
    assert (m["clip_frac_high"], m["clip_frac_low"]) == (pytest.approx(1 / 5), pytest.approx(1 / 5))
    # -(1/G) A_i R_i / |y_i| on unclipped tokens, 0 on the clipped ones
    expected = torch.tensor([[0.0, -2 * r0 / 3 / 2, -2 * r0 / 3 / 2], [0.0, r1 / 2 / 2, 0.0]])
    torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-6, rtol=0)
    assert m["ratio_mean"] == pytest.approx((math.exp(0.5 / 3) + math.exp(-0.2)) / 2, abs=1e-6)


def test_sapo_hand_numbers_and_gradient() -> None:
    logp, old = batch([[1.5, 1.0, 0.9], [0.5, 1.1]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = algorithms.get("sapo").loss(logp, old, adv, MASK)

    def sig(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    # f(w) = sigmoid(tau (w - 1)) 4 / tau; tau = 1.0 for A > 0, 1.05 for A < 0
    seq0 = (sig(0.5) * 4 + sig(0.0) * 4 + sig(-0.1) * 4) / 3
    seq1 = -(sig(1.05 * -0.5) * 4 / 1.05 + sig(1.05 * 0.1) * 4 / 1.05) / 2
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, abs=1e-6)
    # d f(w)/d log pi = 4 sigmoid (1 - sigmoid) w (tau cancels); on-policy (w = 1) that is 1: plain policy gradient
    assert grad_of(loss, logp)[0, 1].item() == pytest.approx(-1.0 / 3 / 2, abs=1e-6)
    assert m["clip_frac"] == 0.0
    slopes = [4 * sig(x) * (1 - sig(x)) for x in (0.5, 0.0, -0.1, 1.05 * -0.5, 1.05 * 0.1)]
    assert m["soft_gate_mean"] == pytest.approx(sum(slopes) / 5, abs=1e-6)


def test_group_normalized_advantages_hand_numbers() -> None:
    # group [1, 0, 0, 0]: mean 0.25, sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5]
    # group [1, 1, 1, 1]: zero variance -> all zero
    adv = algorithms.get("grpo").advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="groups of 3"):
        algorithms.get("gspo").advantages(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        algorithms.get("gspo").advantages(torch.zeros(8), 1)
