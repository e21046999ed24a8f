"""grpo.py's advantage and loss against the numbers and properties of DeepSeekMath §4.1 and of PPO (Schulman et al. 2017)."""

import itertools
import math

import pytest
import torch

import common
import grpo
from helpers import clip_table, policy_gradient_of, true_gradient


def args(**overrides):
    return grpo.Args(**{"beta": 0.0, "max_new_tokens": 8, **overrides})


# --- advantages ------------------------------------------------------------------------------------------------------


def test_advantages_one_one_minus_one():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert torch.equal(grpo.compute_advantages(rewards, 4, eps=0.0), torch.tensor([1.0, -1.0, 1.0, -1.0]))
    # the default numerical epsilon only nudges them: std 0.5, so |A| = 0.5 / (0.5 + 1e-4) = 1 - 2e-4, inside 1e-3
    assert torch.allclose(grpo.compute_advantages(rewards, 4), torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-3)


def test_advantages_one_success_in_eight_is_sqrt7():
    # float64: a mean and a std of 8 terms, a sqrt and a division: a few u64 = 1e-16 of values < 3, far inside 1e-12
    rewards = torch.tensor([1.0] + [0.0] * 7, dtype=torch.float64)
    adv = grpo.compute_advantages(rewards, 8, eps=0.0)
    assert adv[0].item() == pytest.approx(math.sqrt(7), abs=1e-12)
    assert torch.allclose(adv[1:], torch.full((7,), -1 / math.sqrt(7), dtype=torch.float64), rtol=0, atol=1e-12)
    adv = grpo.compute_advantages(1 - rewards, 8, eps=0.0)  # seven successes: the lone failure gets -sqrt(7)
    assert adv[0].item() == pytest.approx(-math.sqrt(7), abs=1e-12)
    assert torch.allclose(adv[1:], torch.full((7,), 1 / math.sqrt(7), dtype=torch.float64), rtol=0, atol=1e-12)


def test_advantages_use_population_std():
    rewards = torch.tensor([0.0, 1.0, 3.0], dtype=torch.float64)
    expected = (rewards - rewards.mean()) / rewards.std(unbiased=False)
    # float64, 3 terms of size < 3: a few u64 = 1e-16; the sample std (divide by G - 1) moves them by 0.25 or more
    assert torch.allclose(grpo.compute_advantages(rewards, 3, eps=0.0), expected, rtol=0, atol=1e-12)
    unbiased = (rewards - rewards.mean()) / rewards.std()
    assert not torch.allclose(grpo.compute_advantages(rewards, 3, eps=0.0), unbiased, rtol=0, atol=1e-12)


@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_zero_variance_groups_get_exactly_zero(eps):
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3, 1.0, 0.0, 1.0])
    adv = grpo.compute_advantages(rewards, 3, eps=eps)
    assert torch.equal(adv[:9], torch.zeros(9))
    assert torch.isfinite(adv).all() and adv[9:].abs().min() > 0.5


def test_groups_are_independent_and_zero_mean():
    torch.manual_seed(0)
    rewards = torch.rand(40, dtype=torch.float64)
    adv = grpo.compute_advantages(rewards, 8)
    # float64: sum |A| <= 8 over a group (sum A^2 <= 8), so its mean is off by < 8 u64 = 1e-15
    assert torch.allclose(adv.view(5, 8).mean(dim=1), torch.zeros(5, dtype=torch.float64), rtol=0, atol=1e-12)
    rewards[:8] += 100.0  # shifting one group's rewards leaves every advantage unchanged
    # float64: r + 100 and the group's sum near 800 round by < 6e-14 (half an ulp at 800), divided by the group's std,
    # 0.26 at seed 0: < 3e-13. (float32 would round by 3e-5 here: why this test is in float64.)
    assert torch.allclose(grpo.compute_advantages(rewards, 8), adv, rtol=0, atol=1e-12)


# --- loss ------------------------------------------------------------------------------------------------------------


def test_on_policy_ratio_is_one_and_nothing_is_clipped():
    logprobs = -torch.rand(6, 5)
    _, m = grpo.compute_loss(logprobs, logprobs, None, torch.randn(6), torch.ones(6, 5, dtype=torch.bool), args())
    m = common.pool_metrics([m], min_max=("train/ratio",))
    # exactly: log pi - log pi_old = 0 and exp(0) = 1, so k3 = 1 - 1 - 0 = 0
    assert m["train/ratio"] == 1 and m["train/ratio_min"] == 1 and m["train/ratio_max"] == 1
    assert m["train/clip_frac_low"] == 0 and m["train/clip_frac_high"] == 0 and m["kl/old_approx"] == 0


def test_clip_table_of_section_8_4():
    """The six rows of the clip table: objective value and slope d/d ratio, eps = 0.2."""

    def objective(ratio, advantage):
        old = torch.log(torch.tensor([[0.2]], dtype=torch.float64))
        logprobs = (old + math.log(ratio)).requires_grad_(True)
        advantages = torch.tensor([advantage], dtype=torch.float64)
        loss, _ = grpo.compute_loss(logprobs, old, None, advantages, torch.ones(1, 1, dtype=torch.bool), args())
        (-loss).backward()
        return -loss.item(), logprobs.grad.item() / ratio  # d obj / d ratio = d obj / d logprob / ratio

    for advantage, ratio, value, slope in clip_table():
        got_value, got_slope = objective(ratio, advantage)
        # float64: the ratio comes back from exp(log) within a few u64 = 1e-16; values and slopes are < 4
        assert got_value == pytest.approx(value, abs=1e-12), (advantage, ratio)
        assert got_slope == pytest.approx(slope, abs=1e-12), (advantage, ratio)


def test_clip_fractions_count_only_tokens_on_a_plateau():
    """Clipped (zero-gradient) tokens: A > 0 with ratio > 1 + eps, A < 0 with ratio < 1 - eps; the others are not."""
    ratios = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]])  # row 0 has A > 0, row 1 has A < 0
    _, m = grpo.compute_loss(
        ratios.log(), torch.zeros(2, 3), None, torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool), args()
    )
    m = common.pool_metrics([m])
    # a count of 1 in 6 tokens: the float32 mean rounds 1/6 once, by < u = 6e-8 relative
    assert m["train/clip_frac_high"] == pytest.approx(1 / 6, rel=1e-6)
    assert m["train/clip_frac_low"] == pytest.approx(1 / 6, rel=1e-6)


def test_approximate_kl_to_the_old_policy_is_k3():
    ratios = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    old, ones = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    _, m = grpo.compute_loss(ratios.log(), old, None, torch.ones(1, dtype=torch.float64), ones, args())
    expected = ((0.5 - 1 - math.log(0.5)) + (2.0 - 1 - math.log(2.0))) / 2  # E_old[r - 1 - log r] = 0.25: the logs cancel
    # k3 in float64, then pool_metrics' float32 mean of 2 terms: a rounding to float32 and a sum, < 3 u = 2e-7 relative
    assert common.pool_metrics([m])["kl/old_approx"].item() == pytest.approx(expected, rel=1e-6) and expected > 0.1


def test_token_coefficients_are_1_over_20_and_1_over_200():
    """Two responses of 10 and 100 tokens, advantage +1, ratio 1: per-response means weight tokens 1/(G L_i)."""
    mask = torch.zeros(2, 100, dtype=torch.bool)
    mask[0, :10], mask[1, :] = True, True
    logprobs = torch.full((2, 100), -1.0, dtype=torch.float64, requires_grad=True)
    loss, _ = grpo.compute_loss(logprobs, logprobs.detach(), None, torch.ones(2, dtype=torch.float64), mask, args())
    (-loss).backward()
    # float64: each coefficient is two divisions (by |o_i|, by G): within 2 u64 = 2e-16 relative
    assert torch.allclose(logprobs.grad[0, :10], torch.full((10,), 1 / 20, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.allclose(logprobs.grad[1], torch.full((100,), 1 / 200, dtype=torch.float64), rtol=1e-12, atol=0)


def test_padding_gets_no_gradient_and_does_not_change_the_loss():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    old, ref, adv = -torch.rand(3, 5), -torch.rand(3, 5), torch.tensor([1.0, -0.5, 2.0])
    losses = []
    for garbage in (0.0, 30.0):
        torch.manual_seed(1)
        logprobs = torch.where(mask, -torch.rand(3, 5), -garbage).requires_grad_(True)
        old_, ref_ = old.masked_fill(~mask, 7.0), ref.masked_fill(~mask, -9.0)  # garbage on padding too
        loss, _ = grpo.compute_loss(logprobs, old_, ref_, adv, mask, args(beta=0.1))
        loss.backward()
        assert torch.equal(logprobs.grad[~mask], torch.zeros(int((~mask).sum())))
        assert (logprobs.grad[mask] != 0).all()
        losses.append(loss.item())
    assert losses[0] == losses[1]  # exactly: padding enters every sum as an exact 0, the valid tokens are the same numbers


# --- expectations by exact enumeration over a tiny softmax policy ---------------------------------


def expected_gradient(theta, rewards, group_size, advantage_fn):
    """E over all ordered groups of G actions of -grad(compute_loss), on-policy, one token per response."""
    probs = torch.softmax(theta, dim=0)
    total = torch.zeros_like(theta)
    for group in itertools.product(range(len(theta)), repeat=group_size):
        actions = torch.tensor(group)
        advantages = advantage_fn(rewards[actions])
        loss = lambda lp, adv=advantages: grpo.compute_loss(lp, lp.detach(), None, adv, lp == lp, args())[0]
        grad = policy_gradient_of(loss, theta, actions)
        total += probs[actions].prod() * grad
    return total


@pytest.mark.parametrize("group_size", [2, 3, 4])
def test_mean_centred_baseline_scales_the_gradient_by_g_minus_1_over_g(group_size):
    """Leave-one-out versus mean baselines (Kool et al. 2019; Ahmadian et al. 2024, §2.3): with the group mean (which includes
    the response itself) as baseline, E[grad] = (G-1)/G * grad E[R]."""
    theta, rewards = torch.tensor([0.3, -0.5, 1.1], dtype=torch.float64), torch.tensor([0.0, 1.0, 10.0], dtype=torch.float64)
    mean_centred = lambda r: r - r.mean()
    got = expected_gradient(theta, rewards, group_size, mean_centred)
    # float64: a sum of 3^G <= 81 terms of size < 10 (probabilities times gradients): < 81 * 10 u64 = 1e-13
    assert torch.allclose(got, (group_size - 1) / group_size * true_gradient(theta, rewards), rtol=0, atol=1e-12)


def test_standardisation_can_change_the_direction():
    """Standardised advantages are not a rescaled policy gradient (Liu et al. 2025, §3.1): uniform 3-action policy, G = 2:
    rewards (0,1,10) and (0,9,10) both give E[grad] = (-2/9, 0, 2/9)."""
    theta = torch.zeros(3, dtype=torch.float64)
    standardised = lambda r: grpo.compute_advantages(r, len(r), eps=0.0)
    for rewards, truth in (([0.0, 1.0, 10.0], [-11 / 9, -8 / 9, 19 / 9]), ([0.0, 9.0, 10.0], [-19 / 9, 8 / 9, 11 / 9])):
        rewards = torch.tensor(rewards, dtype=torch.float64)
        expected = expected_gradient(theta, rewards, 2, standardised)
        # float64: 9 groups, terms of size < 10: < 9 * 10 u64 = 1e-14
        assert torch.allclose(expected, torch.tensor([-2 / 9, 0.0, 2 / 9], dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.allclose(true_gradient(theta, rewards), torch.tensor(truth, dtype=torch.float64), rtol=0, atol=1e-12)


def test_k3_value_is_reverse_kl_but_its_gradient_is_forward_kl():
    """k3 (Schulman 2020, "Approximating KL divergence"; DeepSeekMath eq. 4): on samples from pi, E[k3] = KL(pi || ref) while
    E[grad k3] = grad KL(ref || pi)."""
    theta = torch.tensor([0.4, -0.2, 0.9], dtype=torch.float64)
    ref = torch.softmax(torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64), dim=0)
    probs, ones = torch.softmax(theta, dim=0), torch.ones(1, 1, dtype=torch.bool)

    def loss_of(logprobs, action):  # beta = 1 and zero advantage: the loss is k3 alone
        ref_logprobs = torch.log(ref[action]).view(1, 1)
        return grpo.compute_loss(logprobs, logprobs.detach(), ref_logprobs, torch.zeros(1), ones, args(beta=1.0))

    value, grad = 0.0, torch.zeros(3, dtype=torch.float64)
    for a in range(3):
        value += probs[a] * loss_of(torch.log_softmax(theta, dim=0)[a].view(1, 1), a)[1]["kl/ref"].mean()
        grad += probs[a] * -policy_gradient_of(lambda lp, a=a: loss_of(lp, a)[0], theta, torch.tensor([a]))
    theta_ = theta.clone().requires_grad_(True)
    p = torch.softmax(theta_, dim=0)
    reverse, forward = (p * (p.log() - ref.log())).sum(), (ref * (ref.log() - p.log())).sum()
    # float64: sums of 3 terms of size < 2: < 1e-15. The reverse KL's gradient is 0.1 away from the forward one's here.
    assert value == pytest.approx(reverse.item(), abs=1e-12)
    assert torch.allclose(grad, torch.autograd.grad(forward, theta_, retain_graph=True)[0], rtol=0, atol=1e-12)
    assert not torch.allclose(grad, torch.autograd.grad(reverse, theta_)[0], rtol=0, atol=1e-3)
