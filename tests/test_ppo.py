"""ppo.py's reward, GAE and losses against worked numbers: PPO (Schulman et al. 2017), GAE (Schulman et al. 2015) and the
KL-shaped reward of InstructGPT (Ouyang et al. 2022)."""

import math
import tempfile
from types import SimpleNamespace

import pytest
import torch

import ppo
import sft
from helpers import clip_table, tiny_model


def args(**overrides):
    return ppo.Args(**{"max_new_tokens": 8, **overrides})


def gae(rewards, values, lam, gamma=1.0):
    """GAE of one response in float64: a few roundings (u64 = 1.1e-16) of values < 2 per step, far below 1e-12."""
    rewards, values = torch.tensor([rewards], dtype=torch.float64), torch.tensor([values], dtype=torch.float64)
    return ppo.compute_gae(rewards, values, torch.ones_like(rewards, dtype=torch.bool), args(lam=lam, gamma=gamma))


def test_gae_example_of_section_5_5():
    """Rewards (0, 0, 1), values (0.2, 0.4, 0.7), V = 0 after the last token."""
    close = lambda x, expected: torch.allclose(x, torch.tensor([expected], dtype=torch.float64), rtol=0, atol=1e-12)
    advantages, returns = gae([0.0, 0.0, 1.0], [0.2, 0.4, 0.7], lam=0.9)
    assert close(advantages, [0.713, 0.57, 0.3])
    assert close(returns, [0.913, 0.97, 1.0])  # lambda-returns A + V
    advantages, returns = gae([0.0, 0.0, 1.0], [0.2, 0.4, 0.7], lam=1.0)
    assert close(advantages, [0.8, 0.6, 0.3])  # Monte Carlo return 1 minus V
    assert close(returns, [1.0, 1.0, 1.0])


def test_gae_is_the_tail_corrected_mix_of_n_step_estimates():
    """GAE (Schulman et al. 2015, eq. 16) as a mix of n-step estimates: A_0 = (1 - lambda) A^(1) + (1 - lambda) lambda A^(2) +
    lambda^2 A^(3), weights 0.1, 0.09, 0.81."""
    r, v, lam = [0.0, 0.0, 1.0], [0.2, 0.4, 0.7, 0.0], 0.9
    n_step = [sum(r[:n]) + v[n] - v[0] for n in (1, 2, 3)]  # (0.2, 0.5, 0.8)
    weights = [(1 - lam), (1 - lam) * lam, lam**2]
    # Python floats (float64): a few roundings of values < 1, a few u64 = 1e-16
    assert weights == pytest.approx([0.1, 0.09, 0.81], abs=1e-12) and n_step == pytest.approx([0.2, 0.5, 0.8], abs=1e-12)
    advantages, _ = gae(r, v[:3], lam)
    assert advantages[0, 0].item() == pytest.approx(sum(w * a for w, a in zip(weights, n_step)), abs=1e-12)


def test_gae_discount():
    advantages, _ = gae([0.0, 1.0], [0.5, 0.5], lam=1.0, gamma=0.5)
    # exactly: every quantity is a multiple of 1/4, exact in binary floating point
    assert torch.equal(advantages, torch.tensor([[0.0 + 0.5 * 1.0 - 0.5, 1.0 - 0.5]], dtype=torch.float64))


def test_gae_on_a_variable_length_batch_ignores_padding():
    """Each row equals its own computation alone; values and rewards on padding are garbage and change nothing."""
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    garbage_rewards = torch.where(mask, rewards, 1e3)
    garbage_values = torch.where(mask, values, -1e3)
    advantages, returns = ppo.compute_gae(garbage_rewards, garbage_values, mask, args())
    for i, n in enumerate(mask.sum(dim=1).tolist()):
        alone, alone_returns = ppo.compute_gae(rewards[i : i + 1, :n], values[i : i + 1, :n], mask[i : i + 1, :n], args())
        # float64: <= 5 steps of sums of values < 10 (randn), by the same operations: < 1e-14 even if ordered apart
        assert torch.allclose(advantages[i, :n], alone[0], rtol=0, atol=1e-12)
        assert torch.allclose(returns[i, :n], alone_returns[0], rtol=0, atol=1e-12)
    assert torch.equal(advantages[~mask], torch.zeros(int((~mask).sum())))
    # the last valid token bootstraps from V = 0: its advantage is r - V
    assert advantages[0, 2].item() == pytest.approx((rewards[0, 2] - values[0, 2]).item(), abs=1e-12)  # float64


def test_kl_shaped_reward_sequence():
    """InstructGPT (Ouyang et al. 2022, eq. 2) per token: r_t = -beta (log pi_old - log pi_ref) at every response token, plus
    the score at the last one."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.1, -0.2, -0.3, -0.4]], dtype=torch.float64)
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5, 3.0], [-0.1, -0.1, -0.1, -0.1]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rewards = ppo.compute_rewards(torch.tensor([1.0, 0.0], dtype=torch.float64), logprobs, ref_logprobs, mask, args(beta=0.1))
    expected = torch.tensor([[-0.05, 0.1, 0.0 + 1.0, 0.0], [0.0, 0.01, 0.02, 0.03]], dtype=torch.float64)
    assert torch.allclose(rewards, expected, rtol=0, atol=1e-12)  # float64: a difference, a product and a sum, < 1e-15
    no_kl = ppo.compute_rewards(torch.tensor([1.0, 0.0]), logprobs, None, mask, args(beta=0.0))
    assert torch.equal(no_kl, torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_clip_table_of_section_8_4():
    for advantage, ratio, value, slope in clip_table():
        logprobs = torch.tensor([[math.log(0.2 * ratio)]], dtype=torch.float64, requires_grad=True)
        old = torch.log(torch.tensor([[0.2]], dtype=torch.float64))
        advantages = torch.tensor([[float(advantage)]], dtype=torch.float64)
        loss, _ = ppo.compute_policy_loss(logprobs, old, advantages, torch.ones(1, 1, dtype=torch.bool), args())
        (-loss).backward()
        # float64: the ratio comes back from exp(log) within a few u64 = 1e-16; values and slopes are < 4
        assert -loss.item() == pytest.approx(value, abs=1e-12), (advantage, ratio)
        assert logprobs.grad.item() / ratio == pytest.approx(slope, abs=1e-12), (advantage, ratio)


def test_two_action_example_of_section_4_3():
    """pi(a) = 0.3 with return 5, pi(b) = 0.7 with return 1: V = 2.2, A = (2.8, -1.2), expected gradient 0.84."""
    u = torch.tensor(math.log(0.3 / 0.7), dtype=torch.float64, requires_grad=True)  # sigmoid(u) = 0.3
    values = torch.tensor([[2.2]], dtype=torch.float64)
    expected = 0.0
    for action, ret in ((0, 5.0), (1, 1.0)):
        rewards = torch.tensor([[ret]], dtype=torch.float64)
        advantages, _ = ppo.compute_gae(rewards, values, torch.ones(1, 1, dtype=torch.bool), args())
        logprob = torch.nn.functional.logsigmoid(u if action == 0 else -u).view(1, 1)
        loss, _ = ppo.compute_policy_loss(logprob, logprob.detach(), advantages, torch.ones(1, 1, dtype=torch.bool), args())
        (grad,) = torch.autograd.grad(-loss, u)
        expected += torch.sigmoid(u if action == 0 else -u).item() * grad.item()
    # float64: two terms of size < 3, each a few roundings: < 1e-15
    assert advantages.item() == pytest.approx(-1.2, abs=1e-12)
    assert expected == pytest.approx(0.84, abs=1e-12)
    assert expected == pytest.approx(4 * 0.3 * 0.7, abs=1e-12)  # d/du [5 sigmoid(u) + (1 - sigmoid(u))]


def test_value_loss_and_its_clipped_variant():
    f64 = dict(dtype=torch.float64)
    values, old_values = torch.tensor([[1.0, 0.0]], **f64), torch.tensor([[0.0, 0.0]], **f64)
    returns = torch.tensor([[2.0, 1.0]], **f64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = ppo.compute_value_loss(values, old_values, returns, mask, args())
    assert loss.item() == (0.5 * 1 + 0.5 * 1) / 2  # exactly: halves of squares of integers
    clipped, m = ppo.compute_value_loss(values, old_values, returns, mask, args(value_clip_eps=0.2))
    # float64: a clamp at 0.2, a square and a mean of values < 2: a few u64 = 1e-16
    assert clipped.item() == pytest.approx((0.5 * 1.8**2 + 0.5 * 1) / 2, abs=1e-12)  # V = 1 is clipped to 0.2, first token
    assert m["train/value_clip_frac"].mean().item() == 0.5  # exactly: one of two tokens
    values.requires_grad_(True)
    loss, _ = ppo.compute_value_loss(values, old_values, returns, torch.tensor([[True, False]]), args())
    loss.backward()
    assert values.grad.tolist() == [[-1.0, 0.0]]  # (V - R) on the valid token, nothing on padding


def test_policy_loss_micro_batches_add_up_to_the_token_mean():
    torch.manual_seed(0)
    logprobs, old = -torch.rand(6, 4, dtype=torch.float64), -torch.rand(6, 4, dtype=torch.float64)
    advantages, mask = torch.randn(6, 4, dtype=torch.float64), torch.rand(6, 4) > 0.3
    whole, _ = ppo.compute_policy_loss(logprobs, old, advantages, mask, args())
    parts = sum(
        ppo.compute_policy_loss(logprobs[i], old[i], advantages[i], mask[i], args(), mask.sum())[0]
        for i in torch.arange(6).split(2)
    )
    # float64: the same 24 terms of size < 10 (|A| r, r < e) summed in two orders: < 24 * 24 * 10 u64 = 6e-13
    assert parts.item() == pytest.approx(whole.item(), abs=1e-12)


def test_critic_reads_the_value_of_each_prefix():
    """The value at completion position t is the critic's value of the prefix (x, y_<t) alone: the same body and head
    run on that prefix without padding and without anything after it, read at its last position. Zero at the start."""
    model, input_ids, attention_mask, mask = tiny_model(batch=3)
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        sft.build_tokenizer().save_pretrained(path)  # a model folder with its tokenizer, as Critic expects
        critic = ppo.Critic(
            SimpleNamespace(model_name_or_path=path, cache_dir="", task="addition", lora_rank=0), torch.float32
        )
    T = mask.shape[1]
    values = critic(input_ids, attention_mask, T)
    assert values.shape == mask.shape and torch.equal(values, torch.zeros_like(values))
    torch.nn.init.normal_(critic.head.weight), torch.nn.init.constant_(critic.head.bias, 0.3)
    values = critic(input_ids, attention_mask, T)
    # The batch and each prefix alone run at different shapes, so the CPU's kernels may order the float32 sums
    # differently (see FORWARD_ATOL in test_common.py): up to (4 * 384 + 128) u = 1e-4 of the sizes involved, and the
    # head's 128 products w h (w ~ N(0, 1)) have sizes adding up to < 90: a value moves by < 9e-3, whatever its own size
    # (hence abs, not rel). Reading the wrong prefix moves it by 0.25 or more.
    with torch.no_grad():
        for i in range(3):
            real = input_ids[i][attention_mask[i].bool()]  # the row without its left padding
            prompt_len = int(attention_mask[i, :-T].sum())
            for t in range(int(mask[i].sum())):
                prefix = real[: prompt_len + t][None]  # (1, P + t): x and y_<t
                hidden = critic.body(prefix, use_cache=False).last_hidden_state[0, -1]
                assert values[i, t].item() == pytest.approx(critic.head(hidden).item(), abs=1e-2), (i, t)
