"""rloo.py, dr_grpo.py, dapo.py and gspo.py against RLOO §2.3, Dr. GRPO §3.2, DAPO §3 and GSPO §4 checked against their papers'
formulas and by exact enumeration."""

import itertools
import math
import os

import pytest
import torch

import cispo
import common
import dapo
import dr_grpo
import grpo
import gspo
import opd
import ppo
import reinforce_pp
import rloo
import sapo
from helpers import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ones(n, t=1):
    return torch.ones(n, t, dtype=torch.bool)


# --- advantages ------------------------------------------------------------------------------------------------------


def test_rloo_advantage_is_leave_one_out_and_g_over_g_minus_1_times_centred():
    torch.manual_seed(0)
    rewards, g = torch.rand(24, dtype=torch.float64), 6
    adv = rloo.compute_advantages(rewards, g)
    grouped = rewards.view(-1, g)
    others = torch.stack([torch.cat([row[:i], row[i + 1 :]]).mean() for row in grouped for i in range(g)])
    # float64: sums of 6 rewards in [0, 1), a division and a difference: < 8 * 6 u64 = 5e-15
    assert torch.allclose(adv, rewards - others, rtol=0, atol=1e-12)
    assert torch.allclose(adv, (g / (g - 1) * (grouped - grouped.mean(dim=1, keepdim=True))).view(-1), rtol=0, atol=1e-12)


def test_dr_grpo_advantage_is_centred_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    # exactly: a sum of 0s and 1s, a division by 4 and a difference of quarters are exact in binary floating point
    assert torch.equal(dr_grpo.compute_advantages(rewards, 4), torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))


@pytest.mark.parametrize("module", [rloo, dr_grpo, gspo, dapo])
def test_zero_variance_groups_get_exactly_zero(module):
    adv = module.compute_advantages(torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.0, 1.0, 1.0]), 3)
    assert torch.equal(adv[:6], torch.zeros(6)) and adv[6:].abs().min() > 0


# --- expected gradients by exact enumeration over a tiny autoregressive policy ------------------
# Vocabulary {a, b, EOS}, at most two tokens: first-token logits theta[0], second-token logits theta[1 + y1]. A response
# is EOS alone (1 token) or y1 followed by any token (2 tokens; without EOS it is truncated). Seven responses in all.

RESPONSES = [(2,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
REWARDS = torch.tensor([0.0, 1.0, 0.3, 2.0, 0.0, -1.0, 0.5], dtype=torch.float64)  # float64: the tests compare at 1e-12


def response_logprobs(theta, response):
    """(1, 2) token log-probs of a response, padded with 0 where it has ended, and its (1, 2) mask."""
    first = torch.log_softmax(theta[0], dim=0)[response[0]]
    second = torch.log_softmax(theta[1 + response[0]], dim=0)[response[1]] if len(response) == 2 else theta.new_zeros(())
    return torch.stack([first, second])[None], torch.tensor([[True, len(response) == 2]])


THETA = torch.tensor([[0.2, -0.4, 0.1], [0.5, 0.0, -0.3], [-0.2, 0.3, 0.6]], dtype=torch.float64)
# The expected gradients below sum 7^G <= 343 terms, each a group's gradient (entries < 2) times its probability: in
# float64 a sum of n terms is off by < n u64 times the sum of their sizes, here < 343 * 2 * 1.1e-16 = 8e-14.
ENUMERATION_ATOL = 1e-12


def expected_gradient(module, group_size, shape_reward=None, **overrides):
    """E over all ordered groups of G responses of -grad(module.compute_loss) at the on-policy point, theta = THETA."""
    args = module.Args(beta=0.0, **overrides)
    theta = THETA.clone().requires_grad_(True)
    probs = torch.stack([response_logprobs(theta, r)[0].sum() for r in RESPONSES]).exp().detach()
    total = torch.zeros_like(theta)
    for group in itertools.product(range(len(RESPONSES)), repeat=group_size):
        logprobs, mask = map(torch.cat, zip(*(response_logprobs(theta, RESPONSES[i]) for i in group)))
        rewards = REWARDS[list(group)]
        if shape_reward is not None:
            rewards = shape_reward(rewards, group, logprobs.detach(), mask)
        advantages = module.compute_advantages(rewards, group_size)
        loss, _ = module.compute_loss(logprobs, logprobs.detach(), None, advantages, mask, args)
        (grad,) = torch.autograd.grad(loss, theta)
        total -= probs[list(group)].prod() * grad
    return total


def true_gradient(beta=0.0, ref_theta=None):
    """grad of E[R] - beta * KL(pi || pi_ref) over the seven responses, at theta = THETA."""
    theta = THETA.clone().requires_grad_(True)
    logp = torch.stack([response_logprobs(theta, r)[0].sum() for r in RESPONSES])
    objective = (logp.exp() * REWARDS).sum()
    if beta:
        ref_logp = torch.stack([response_logprobs(ref_theta, r)[0].sum() for r in RESPONSES])
        objective = objective - beta * (logp.exp() * (logp - ref_logp)).sum()
    return torch.autograd.grad(objective, theta)[0]


@pytest.mark.parametrize("group_size", [2, 3])
def test_rloo_expected_gradient_is_the_true_gradient(group_size):
    """RLOO §2.3: the leave-one-out baseline and the per-response token sum give an unbiased sequence-level gradient."""
    assert torch.allclose(expected_gradient(rloo, group_size), true_gradient(), rtol=0, atol=ENUMERATION_ATOL)


@pytest.mark.parametrize("group_size", [2, 3])
def test_mean_centred_expected_gradient_is_g_minus_1_over_g_of_it(group_size):
    """Dr. GRPO §3.2: the group mean includes the response itself; Dr. GRPO also divides by C = max_new_tokens."""
    got = expected_gradient(dr_grpo, group_size, max_new_tokens=2)
    assert torch.allclose(got, (group_size - 1) / group_size / 2 * true_gradient(), rtol=0, atol=ENUMERATION_ATOL)


def test_grpo_length_normalisation_is_not_a_rescaled_true_gradient():
    """Dr. GRPO §3.1: 1/|o_i| weights responses by their length, so no single factor recovers the true gradient."""
    got, truth = expected_gradient(grpo, 2), true_gradient()
    factor = (got * truth).sum() / (truth * truth).sum()
    assert not torch.allclose(got, factor * truth, rtol=0, atol=1e-3)  # the closest multiple is 0.056 away


def test_rloo_with_the_kl_in_the_reward_is_unbiased_for_the_regularised_objective():
    """RLOO §2.3 (the KL penalty in the reward, as in Ziegler et al. 2019): on-policy, R - beta * sum_t (log pi - log pi_ref)
    as a constant reward gives grad(E[R] - beta KL)."""
    ref_theta, beta = torch.tensor([[0.0, 0.3, -0.1], [0.2, 0.2, 0.0], [0.1, -0.5, 0.4]], dtype=torch.float64), 0.5

    def shape(rewards, group, logprobs, mask):  # rloo.py's KL-shaped reward, with pi_old = pi_theta (on-policy)
        ref_logprobs = torch.cat([response_logprobs(ref_theta, RESPONSES[i])[0] for i in group])
        return rloo.compute_kl_rewards(rewards, logprobs, ref_logprobs, mask, rloo.Args(beta=beta))

    assert torch.allclose(expected_gradient(rloo, 2, shape), true_gradient(beta, ref_theta), rtol=0, atol=ENUMERATION_ATOL)


def test_rloo_kl_shaped_reward_sums_k1_over_valid_tokens_only():
    """R - beta * sum_t (log pi_old - log pi_ref): (1 - 0.5 * (0.5 - 1.0), 0 - 0.5 * (0.1 + 0.2 + 0.3)); padding ignored."""
    old = torch.tensor([[-1.0, -2.0, 50.0], [-0.1, -0.2, -0.3]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -50.0], [-0.2, -0.4, -0.6]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    shaped = rloo.compute_kl_rewards(torch.tensor([1.0, 0.0], dtype=torch.float64), old, ref, mask, rloo.Args(beta=0.5))
    # float64: 3 differences, a sum and a product of values < 2: < 8 u64 = 1e-15
    assert torch.allclose(shaped, torch.tensor([1.25, -0.3], dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(
        rloo.compute_kl_rewards(torch.tensor([1.0, 0.0]), None, None, mask, rloo.Args(beta=0.0)), torch.tensor([1.0, 0.0])
    )


# --- token weights (Dr. GRPO §3.1, DAPO §3.3) --------------------------------------------------------------------------------


def token_gradients(module, args, **kwargs):
    """Two responses of 10 and 100 tokens, advantage +1, ratio 1: the gradient of the objective on each token."""
    mask = torch.zeros(2, 100, dtype=torch.bool)
    mask[0, :10], mask[1, :] = True, True
    logprobs = torch.full((2, 100), -1.0, dtype=torch.float64, requires_grad=True)
    loss, _ = module.compute_loss(logprobs, logprobs.detach(), None, torch.ones(2, dtype=torch.float64), mask, args, **kwargs)
    (-loss).backward()
    return logprobs.grad[0, :10], logprobs.grad[1]


def all_equal_to(x, value):
    """Every entry within 1e-12 relative of value: a token's weight is one or two float64 divisions, < 2 u64 = 2e-16."""
    return torch.allclose(x, torch.full_like(x, value), rtol=1e-12, atol=0)


def test_dr_grpo_weights_every_token_1_over_200_at_c_100():
    short, long = token_gradients(dr_grpo, dr_grpo.Args(max_new_tokens=100))
    assert all_equal_to(short, 1 / 200) and all_equal_to(long, 1 / 200)


def test_dapo_weights_every_token_1_over_110():
    short, long = token_gradients(dapo, dapo.Args())
    assert all_equal_to(short, 1 / 110) and all_equal_to(long, 1 / 110)


def test_rloo_sums_over_tokens():
    short, long = token_gradients(rloo, rloo.Args())
    assert all_equal_to(short, 1 / 2) and all_equal_to(long, 1 / 2)


# --- clipping --------------------------------------------------------------------------------------------------------


def test_dapo_clip_higher():
    """eps_high = 0.28: a positive-advantage token at ratio 1.25 keeps its gradient, at 1.3 it has none."""
    for ratio, has_gradient in ((1.25, True), (1.3, False), (0.7, True)):
        logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
        loss, _ = dapo.compute_loss(logprobs, torch.zeros(1, 1), None, torch.tensor([1.0]), ones(1), dapo.Args())
        loss.backward()
        assert (logprobs.grad.abs().item() > 0) == has_gradient, ratio
    logprobs = torch.tensor([[math.log(0.75)]], requires_grad=True)  # negative advantage: the lower bound stays 0.2
    loss, _ = dapo.compute_loss(logprobs, torch.zeros(1, 1), None, torch.tensor([-1.0]), ones(1), dapo.Args())
    loss.backward()
    assert logprobs.grad.item() == 0


def test_dapo_loss_with_every_token_masked_out_is_zero():
    loss, metrics = dapo.compute_loss(
        -torch.rand(2, 3), -torch.rand(2, 3), None, torch.ones(2), ones(2, 3) & False, dapo.Args(), 7
    )
    assert loss.item() == 0 and metrics == {}


def test_gspo_sequence_ratio_is_the_geometric_mean_not_the_sequence_ratio():
    """1000 tokens at per-token ratio 1.01: W = 1.01^1000 ~ 2.1e4, while GSPO's q = 1.01."""
    old = torch.full((1, 1000), -2.0, dtype=torch.float64)
    logprobs = old + math.log(1.01)
    _, m = gspo.compute_loss(logprobs, old, None, torch.ones(1, dtype=torch.float64), ones(1, 1000), gspo.Args())
    w = torch.exp((logprobs - old).sum()).item()
    # float64: -2 + log 1.01 rounds by up to u64 * 2 = 2e-16, the same on all 1000 tokens: the sum of the log-ratios
    # (about 10) is off by < 1000 * 2e-16 plus its own roundings, < 1e-12 relative on W and on q
    assert w == pytest.approx(1.01**1000, rel=1e-12) and 2.0e4 < w < 2.2e4
    assert m["train/ratio"].mean().item() == pytest.approx(1.01, rel=1e-12)


def test_gspo_clipped_response_has_zero_gradient_on_every_token():
    """Response 0 (A > 0) has q = 1.001 > 1 + 4e-4: clipped as a whole. Response 1 (q = 1) gets q A / |o| per token."""
    old = torch.zeros(2, 4)
    logprobs = torch.stack([torch.full((4,), math.log(1.001)), torch.zeros(4)]).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    loss, _ = gspo.compute_loss(logprobs, old, None, torch.tensor([1.0, 1.0]), mask, gspo.Args())
    (-loss).backward()
    assert torch.equal(logprobs.grad[0], torch.zeros(4))
    # 1/G * q A / |o| = 1/2 * 1/2, exactly: q = exp(0) = 1 and the rest are divisions by powers of 2
    assert torch.equal(logprobs.grad[1], torch.tensor([0.25, 0.25, 0.0, 0.0]))


def test_gspo_and_grpo_coincide_on_policy():
    torch.manual_seed(0)
    logprobs = -torch.rand(4, 6, dtype=torch.float64)
    mask = torch.rand(4, 6) > 0.3
    mask[:, 0] = True
    advantages = torch.randn(4, dtype=torch.float64)
    grads = []
    for module in (grpo, gspo):
        lp = logprobs.clone().requires_grad_(True)
        loss, _ = module.compute_loss(lp, lp.detach(), None, advantages, mask, module.Args(beta=0.0))
        loss.backward()
        grads.append(lp.grad)
    # float64: A / (|o| G) by two routes of a few roundings each, |A| < 3: < 1e-15
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-12)


# --- DAPO's reward shaping and dynamic sampling ------------------------------------------------------------------------


def test_soft_overlong_punishment_has_three_regions():
    """L_max = 20, L_cache = 5: 0 up to 15 tokens, linear to -1 at 20, -1 beyond."""
    args = dapo.Args(max_new_tokens=20, overlong_buffer=5)
    lengths = torch.tensor([3, 15, 16, 18, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    # float32: an integer over 5, rounded once, against the rounded decimal: < 2 u = 1.2e-7 of values <= 1
    assert torch.allclose(dapo.compute_overlong_penalty(lengths, args), expected, rtol=0, atol=1e-6)


def test_dynamic_sampling_keeps_exactly_the_groups_with_mixed_scores():
    """DAPO eq. 11: a group is kept when its verifier scores are neither all correct nor all wrong."""
    torch.manual_seed(0)
    for _ in range(20):
        scores = (torch.rand(64) > torch.rand(1)).float()
        scores[:8], scores[8:16] = 1.0, 0.0  # one group all correct, one all wrong, for sure
        keep = dapo.filter_groups(scores, 8)
        assert not keep[0] and not keep[1]
        assert ((scores.view(-1, 8).std(dim=1) > 0) == keep).all()


# --- micro-batching --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [grpo, rloo, dr_grpo, gspo, dapo, cispo, reinforce_pp, sapo, opd])
def test_micro_batches_leave_the_gradient_unchanged(module):
    """One minibatch of 6 responses through a real model, whole or in micro-batches of 2 and 3, with beta = 0.04 (the k3
    term, in the scripts that have it in their loss): each micro-batch returns its share of the minibatch's loss, so the
    gradient is the same, up to float32 rounding."""
    model, input_ids, attention_mask, mask = tiny_model(batch=6, seed=1)
    advantages, args = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.3]), module.Args(beta=0.04, max_new_tokens=8)
    if module is opd:  # a per-token advantage: the response's, varied along its tokens
        advantages = advantages[:, None] * torch.linspace(0.5, 1.5, mask.shape[1])
    # log pi - log pi_old per response: GSPO clips responses 0 (A > 0) and 5 (A < 0) as a whole, and not 1, 2 and 4
    offsets = torch.tensor([0.01, 1e-4, 1e-4, 0.01, 0.0, -0.01])[:, None]
    with torch.no_grad():
        old = common.completion_logprobs(model, input_ids, attention_mask, mask.shape[1], 1.0)[0] - offsets
        ref = old - 0.1 * torch.arange(mask.shape[1]) / mask.shape[1]  # (B, T) the reference, away from the policy
        _, m = module.compute_loss(old + offsets, old, ref, advantages, mask, args)
    clip_high = common.pool_metrics([m]).get("train/clip_frac_high")  # (SAPO has a gate, not a clip)
    if module is gspo:  # positive advantages both clipped (response 0) and not (responses 2 and 4)
        # a count of tokens over the total: float32's mean rounds it once, < u = 6e-8 relative
        assert clip_high == pytest.approx(mask[0].sum().item() / mask.sum().item(), rel=1e-6)
    normaliser = {"num_tokens": mask.sum()} if module in (dapo, cispo) else {"num_responses": 6}

    def gradient(micro):
        model.zero_grad()
        for idx in torch.arange(6).split(micro):
            logprobs = common.completion_logprobs(model, input_ids[idx], attention_mask[idx], mask.shape[1], 1.0)[0]
            loss, _ = module.compute_loss(logprobs, old[idx], ref[idx], advantages[idx], mask[idx], args, *normaliser.values())
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    whole = gradient(6)
    assert whole.abs().sum() > 0
    # A micro-batch runs the model at another batch shape, where the CPU's kernels may order each float32 sum differently:
    # forward and backward through 4 layers of sums over <= 384 terms, up to 8 * 384 u = 2e-4 of the gradient's scale
    # (as FORWARD_ATOL in test_common.py), plus 6 eps for adding the 6 responses in another order. A micro-batch that
    # returned its own mean instead of its share of the minibatch's loss would be off by a factor of 2 or 3.
    for micro in (2, 3):
        assert torch.allclose(gradient(micro), whole, rtol=0, atol=2e-4 * whole.abs().max())


# --- numerics at masked positions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [grpo, rloo, dr_grpo, gspo, dapo, ppo, cispo, reinforce_pp, sapo, opd])
def test_a_150_nat_gap_at_a_masked_position_leaves_the_gradient_finite(module):
    """Padding after EOS can hold any log-prob. exp(150) overflows float32, and 0 * inf = NaN would flow back through
    the mask: the log-ratios (to pi_old, and k3's to pi_ref) must be masked before exp."""
    mask = torch.tensor([[True, True, False], [True, True, True]])
    logprobs = torch.tensor([[-1.0, -2.0, -150.0], [-0.5, -1.0, -1.5]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -300.0], [-0.4, -1.2, -1.4]])  # logprobs - old = +150 on the padding
    ref = torch.tensor([[-1.0, -2.1, 0.0], [-0.6, -1.0, -1.6]])  # ref - logprobs = +150 on the padding
    for advantages in (torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])):
        logprobs.grad = None
        if module is ppo:
            loss, metrics = ppo.compute_policy_loss(logprobs, old, advantages[:, None].expand(2, 3), mask, ppo.Args())
        elif module is opd:  # a per-token advantage
            loss, metrics = opd.compute_loss(logprobs, old, ref, advantages[:, None].expand(2, 3), mask, opd.Args(beta=0.1))
        else:
            loss, metrics = module.compute_loss(logprobs, old, ref, advantages, mask, module.Args(beta=0.1, max_new_tokens=8))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all(), module.__name__
        assert logprobs.grad[0, 2] == 0 and (logprobs.grad[0, :2] != 0).all()
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values())


def test_gspo_logs_the_token_level_kl_to_the_old_policy():
    """Token log-ratios +0.3 and -0.3 give q = 1, yet the policy has moved: k3 per token averages 0.045, as in GRPO."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    logprobs = torch.tensor([[0.3, -0.3]], dtype=torch.float64)
    expected = ((math.exp(0.3) - 1 - 0.3) + (math.exp(-0.3) - 1 + 0.3)) / 2
    for module in (gspo, grpo):
        _, m = module.compute_loss(logprobs, old, None, torch.ones(1, dtype=torch.float64), ones(1, 2), module.Args(beta=0.0))
        # k3 in float64, then pool_metrics' float32 mean of 2 terms: a rounding to float32 and a sum, < 3 u = 2e-7 relative
        assert common.pool_metrics([m])["kl/old_approx"].item() == pytest.approx(expected, rel=1e-6), module.__name__
    assert expected == pytest.approx(0.0453, abs=5e-5)  # the docstring's 0.0453, printed to 4 decimals
