"""cispo.py, reinforce_pp.py, sapo.py and opd.py against their papers' formulas: values and gradients worked out by hand
(the arithmetic is in the comments), and the boundary cases of each (a clip edge, a group or a batch of equal rewards,
the gate at r = 1 and far from it, a teacher equal to the student)."""

import math

import pytest
import torch

import cispo
import grpo
import opd
import reinforce_pp
import sapo


def loss_and_grad(module, logprobs, old_logprobs, advantages, mask, args, ref_logprobs=None):
    """The loss and its gradient with respect to the token log-probs, in float64: its rounding (u64 = 1.1e-16) is then far
    below every tolerance here, which is set by the worked numbers' printed decimals. (The advantages and reference
    log-probs the tests pass are exact in float32 and promote to float64.)"""
    logprobs = torch.tensor(logprobs, dtype=torch.float64).requires_grad_(True)
    old_logprobs = torch.tensor(old_logprobs, dtype=torch.float64)
    loss, metrics = module.compute_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, args)
    loss.backward()
    return loss.item(), logprobs.grad, metrics


# --- CISPO (MiniMax-M1 §3.1): -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi, token mean -----------------------


def test_cispo_keeps_the_gradient_of_a_token_past_the_clip_with_the_clipped_weight():
    # old log-probs 0, so r = pi: ratios 0.5, 1, 1.5; A = +2; eps_low = 1 (no lower bound), eps_high = 0.28.
    # weights sg(clip(r)) = 0.5, 1, 1.28. Loss per token -w A log pi: -0.5*2*log 0.5 = 0.693147, 0, -1.28*2*log 1.5 = -1.03799;
    # token mean (3 tokens) = -0.114948. Gradient d loss / d log pi = -w A / 3 = -0.333333, -0.666667, -0.853333.
    mask = torch.ones(1, 3, dtype=torch.bool)
    logprobs = [[math.log(0.5), 0.0, math.log(1.5)]]
    loss, grad, metrics = loss_and_grad(cispo, logprobs, [[0.0, 0.0, 0.0]], torch.tensor([2.0]), mask, cispo.Args())
    assert loss == pytest.approx(-0.114948, abs=5e-7)  # printed to 6 decimals: off by at most 5e-7
    # float64: products and a division of values < 3, a few u64 = 1e-16
    assert torch.allclose(grad, torch.tensor([[-1 / 3, -2 / 3, -2.56 / 3]], dtype=torch.float64), rtol=0, atol=1e-12)
    assert metrics["train/clip_frac_high"].tolist() == [0.0, 0.0, 1.0]  # the third token's weight was clipped, A > 0
    # GRPO's clip (eps 0.2) drops that token from the gradient: d/d log pi of -min(rA, clip(r)A)/3 is -rA/3 or 0
    _, grpo_grad, _ = loss_and_grad(grpo, logprobs, [[0.0, 0.0, 0.0]], torch.tensor([2.0]), mask, grpo.Args(beta=0.0))
    assert torch.allclose(grpo_grad, torch.tensor([[-1 / 3, -2 / 3, 0.0]], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "ratio, advantage, weight",
    [
        (1.28, 1.0, 1.28),  # at the upper edge: the weight is the ratio itself
        (2.0, 1.0, 1.28),  # past it: the edge
        (2.0, -1.0, 1.28),  # past it with a negative advantage: clipped too (the weight does not look at the sign)
        (0.8, -1.0, 0.8),  # at the lower edge (eps_low = 0.2 here)
        (0.5, -1.0, 0.8),  # past it
        (0.5, 1.0, 0.8),
    ],
)
def test_cispo_weight_at_and_past_each_clip_edge(ratio, advantage, weight):
    # one token, so the gradient d loss / d log pi is -weight * A exactly
    args = cispo.Args(clip_eps_low=0.2, clip_eps_high=0.28)
    mask = torch.ones(1, 1, dtype=torch.bool)
    _, grad, _ = loss_and_grad(cispo, [[math.log(ratio)]], [[0.0]], torch.tensor([advantage]), mask, args)
    assert grad.item() == pytest.approx(-weight * advantage, abs=1e-12)  # float64: r = exp(log r) within a few u64


def test_cispo_averages_over_every_token_of_the_batch_not_per_response():
    # a 1-token and a 3-token response, on policy (weights 1), A = +1 each: every token's gradient is -1/4 (GRPO: -1/2 for
    # the short response's token, -1/6 for each of the long one's)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    _, grad, _ = loss_and_grad(
        cispo, [[-1.0] * 3, [-1.0] * 3], [[-1.0] * 3, [-1.0] * 3], torch.tensor([1.0, 1.0]), mask, cispo.Args()
    )
    # exactly: r = exp(0) = 1 and the token mean divides by 4, a power of 2
    assert torch.equal(grad, torch.tensor([[-0.25, 0.0, 0.0], [-0.25, -0.25, -0.25]], dtype=torch.float64))


# --- REINFORCE++-baseline: centre within the group, then divide by the batch's std -----------------------------------


def test_reinforce_pp_divides_by_the_std_of_the_whole_batch():
    # groups [1,0,0,0] and [1,1,0,0]: centred 0.75,-0.25,-0.25,-0.25 and 0.5,0.5,-0.5,-0.5 (batch mean 0). Population std
    # over the 8: sqrt((0.5625 + 3*0.0625 + 4*0.25) / 8) = sqrt(0.21875) = 0.467707; A = centred / (0.467707 + 1e-4).
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0], dtype=torch.float64)
    expected = [1.603225, -0.534408, -0.534408, -0.534408, 1.068816, 1.068816, -1.068816, -1.068816]
    # float64 (error ~1e-16) against numbers printed to 6 decimals: off by at most 5e-7
    expected = torch.tensor(expected, dtype=torch.float64)
    assert torch.allclose(reinforce_pp.compute_advantages(rewards, 4), expected, rtol=0, atol=5e-7)
    # GRPO divides each group by its own std (0.433013 and 0.5): 1.731651 for the first group's correct answer, 0.999800
    assert grpo.compute_advantages(rewards, 4)[[0, 4]].tolist() == pytest.approx([1.731651, 0.999800], abs=5e-7)


def test_reinforce_pp_equal_rewards_give_exactly_zero():
    group_equal = reinforce_pp.compute_advantages(torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0, 0.0]), 3)
    assert torch.equal(group_equal[:3], torch.zeros(3)) and group_equal[3:].abs().min() > 0
    assert torch.equal(reinforce_pp.compute_advantages(torch.full((6,), 0.7), 3), torch.zeros(6))  # a whole batch


def test_reinforce_pp_kl_is_k2_in_the_loss():
    # A = 0 isolates the penalty. log pi = -1.0, log pi_ref = -1.5: k2 = 0.5 * 0.5^2 = 0.125, beta * k2 = 0.005, and
    # d/d log pi = beta * (log pi - log pi_ref) = 0.02. (GRPO's k3 here: exp(-0.5) + 0.5 - 1 = 0.106531.)
    args, mask = reinforce_pp.Args(beta=0.04), torch.ones(1, 1, dtype=torch.bool)
    loss, grad, metrics = loss_and_grad(
        reinforce_pp, [[-1.0]], [[-1.0]], torch.tensor([0.0]), mask, args, torch.tensor([[-1.5]])
    )
    # float64: two or three products of values < 1, a few u64 = 1e-16
    assert loss == pytest.approx(0.005, abs=1e-12) and grad.item() == pytest.approx(0.02, abs=1e-12)
    assert metrics["kl/ref"].item() == pytest.approx(0.125, abs=1e-12)


# --- SAPO: f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau_pos = 1.0 for A > 0, tau_neg = 1.05 for A < 0 -----------------


@pytest.mark.parametrize(
    "ratio, advantage, loss, slope",
    [
        (1.0, +1.0, -2.0, -1.0),  # f(1) = 2 / tau = 2; f'(1) = 4 * 1/2 * 1/2 = 1: the unclipped surrogate's slope
        (1.0, -1.0, 1.904762, 1.0),  # tau_neg: f(1) = 2 / 1.05 = 1.904762; the slope is 1 at r = 1 whatever tau is
        # r = 3, tau = 1: s = sigmoid(2) = 0.880797, f = 4 s = 3.523188, f' = 4 s (1 - s) = 0.419974; d/d log pi = -f' r A
        (3.0, +1.0, -3.523188, -1.259923),
        # r = 3, tau = 1.05: s = sigmoid(2.1) = 0.890903, f = 4 s / 1.05 = 3.393917, f' = 0.388779, times r = 1.166336
        (3.0, -1.0, 3.393917, 1.166336),
    ],
)
def test_sapo_gate_value_and_slope(ratio, advantage, loss, slope):
    mask = torch.ones(1, 1, dtype=torch.bool)
    value, grad, metrics = loss_and_grad(
        sapo, [[math.log(ratio)]], [[0.0]], torch.tensor([advantage]), mask, sapo.Args(beta=0.0)
    )
    # Numbers printed to 6 decimals: off by at most 5e-7 (float64 throughout, tau included, rounds far below that)
    assert value == pytest.approx(loss, abs=5e-7) and grad.item() == pytest.approx(slope, abs=5e-7)


def test_sapo_gate_fades_far_from_one_where_grpo_cuts():
    # r = 1.3, A = +1: GRPO's clip gives slope 0; SAPO keeps 4 s (1 - s) r with s = sigmoid(0.3) = 0.574443: 0.977833 * 1.3
    # = 1.271183 (float64 against numbers printed to 6 decimals: off by at most 5e-7)
    mask = torch.ones(1, 1, dtype=torch.bool)
    _, grad, metrics = loss_and_grad(sapo, [[math.log(1.3)]], [[0.0]], torch.tensor([1.0]), mask, sapo.Args(beta=0.0))
    assert grad.item() == pytest.approx(-1.271183, abs=5e-7) and metrics["train/gate_weight"].item() == pytest.approx(
        0.977833, abs=5e-7
    )
    _, grpo_grad, _ = loss_and_grad(grpo, [[math.log(1.3)]], [[0.0]], torch.tensor([1.0]), mask, grpo.Args(beta=0.0))
    assert grpo_grad.item() == 0.0


# --- on-policy distillation: a per-token advantage log pi_teacher - log pi_student ------------------------------------


def test_opd_advantage_is_the_per_token_log_ratio_to_the_teacher_and_zero_on_padding():
    teacher, student = torch.tensor([[-0.5, -2.0, -9.0]]), torch.tensor([[-1.0, -1.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    assert opd.compute_advantages(teacher, student, mask).tolist() == [[0.5, -1.0, 0.0]]


def test_opd_loss_on_policy():
    # A = 0.5, -1.0 on a 2-token response, on policy (r = 1): loss = -(0.5 - 1.0) / 2 = 0.25 (mean over the response's
    # tokens), d/d log pi = -A / 2 = -0.25, 0.5; the logged reverse KL to the teacher is the mean of -A = 0.25
    mask = torch.ones(1, 2, dtype=torch.bool)
    advantages = opd.compute_advantages(torch.tensor([[-0.5, -2.0]]), torch.tensor([[-1.0, -1.0]]), mask)
    loss, grad, metrics = loss_and_grad(opd, [[-1.0, -1.0]], [[-1.0, -1.0]], advantages, mask, opd.Args())
    # exactly: halves and quarters, exact in binary floating point
    assert loss == 0.25 and grad.tolist() == [[-0.25, 0.5]] and metrics["kl/teacher"].mean().item() == 0.25


def test_opd_teacher_equal_to_student_gives_no_signal():
    torch.manual_seed(0)
    logprobs, mask = -torch.rand(3, 4) * 3, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    advantages = opd.compute_advantages(logprobs, logprobs, mask)
    loss, grad, _ = loss_and_grad(opd, logprobs.tolist(), logprobs.tolist(), advantages, mask, opd.Args())
    assert torch.equal(advantages, torch.zeros(3, 4)) and loss == 0.0 and torch.equal(grad, torch.zeros(3, 4))
