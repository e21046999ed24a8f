"""maxrl.py's advantage against the paper's estimator (MaxRL, arXiv 2602.02710): worked numbers, and its exact
expectation, enumerated over every group of a small policy, against the gradient of the truncated maximum-likelihood
objective J_T = -sum_{k <= T} (1 - p)^k / k. Also common.pass_at_k (Chen et al. 2021, §2.1) against worked binomials,
and eval/pass@k of an evaluation against the pass@k of a model whose chance of a right answer is known."""

import itertools
import math

import pytest
import torch

import common
import grpo
import maxrl
import sft
import tasks

# --- the advantage: A_i = (R_i - mean R) / mean R = G R_i / K - 1 ------------------------------------------------------


def test_maxrl_advantage_worked_numbers():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1])  # 4 groups of G = 4: K = 1, 3, 0, 4
    expected = [
        [3, -1, -1, -1],  # K = 1: mean 1/4, (1 - 1/4) / (1/4) = 3, (0 - 1/4) / (1/4) = -1
        [1 / 3, 1 / 3, 1 / 3, -1],  # K = 3: mean 3/4, (1/4) / (3/4) = 1/3, -1
        [0, 0, 0, 0],  # K = 0: no correct response to average over
        [0, 0, 0, 0],  # K = 4: R_i = mean R
    ]
    # float32: (1 - 0.25) / 0.25 and -0.25 / 0.25 are exact; 0.25 / 0.75 is within 1 ulp (6e-8) of 1/3
    assert torch.allclose(maxrl.compute_advantages(rewards, 4), torch.tensor(expected).flatten(), rtol=0, atol=1e-7)


def test_maxrl_weights_a_hard_prompt_more_than_grpo_does():
    """GRPO divides by the std sqrt(p (1 - p)), symmetric in p and 1 - p; MaxRL by the mean p: the one success of a hard
    group (K = 1 of 8) gets 7, the one failure of an easy group (K = 7) gets -1, and the advantages of a group sum to 0."""
    hard, easy = torch.tensor([1.0] + [0] * 7), torch.tensor([1.0] * 7 + [0])
    assert maxrl.compute_advantages(hard, 8)[0].item() == 7.0  # (1 - 1/8) / (1/8), exact in binary
    assert maxrl.compute_advantages(easy, 8)[-1].item() == -1.0
    # GRPO: both are +-0.875 / sqrt(7/64) = +-2.6458 (to eps = 1e-4 in the denominator: 4e-4 relative)
    assert grpo.compute_advantages(hard, 8)[0].item() == pytest.approx(-grpo.compute_advantages(easy, 8)[-1].item(), rel=1e-6)
    for group in (hard, easy):  # a sum of 8 terms of size <= 7 in float32: within 8 * 7 * 6e-8
        assert abs(maxrl.compute_advantages(group, 8).sum().item()) < 4e-6


@pytest.mark.parametrize("group_size", [2, 3, 4])
def test_maxrl_estimator_is_unbiased_for_the_truncation_of_order_g_minus_1(group_size):
    """A policy over 3 outcomes (logits theta, outcome 0 correct, p = softmax(theta)_0). Every group of G outcomes is
    enumerated with its probability; the estimator is (1/G) sum_i A_i grad log pi(y_i), the gradient of the loss's
    -(1/G) sum_i A_i log pi(y_i) (on-policy, where the clipped ratio's gradient is the score's). Its exact expectation
    must equal grad J_(G-1)(theta) by autograd, and differ from grad J_G (what the uncentred mean over the correct ones
    would estimate). float64 throughout: sums of 3^4 = 81 terms of size < 10, rounding far below 1e-12."""
    theta = torch.tensor([-0.7, 0.4, 0.1], dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(theta, dim=0)

    def truncated_ml(order):  # J_T = -sum_{k=1}^{T} (1 - p)^k / k
        return -sum((1 - probs[0]) ** k / k for k in range(1, order + 1))

    expected = torch.autograd.grad(truncated_ml(group_size - 1), theta, retain_graph=True)[0]
    higher = torch.autograd.grad(truncated_ml(group_size), theta, retain_graph=True)[0]
    probs = probs.detach()
    mean_gradient = torch.zeros(3, dtype=torch.float64)
    for group in itertools.product(range(3), repeat=group_size):
        rewards = torch.tensor([1.0 if y == 0 else 0.0 for y in group], dtype=torch.float64)
        advantages = maxrl.compute_advantages(rewards, group_size)
        scores = torch.stack([torch.eye(3, dtype=torch.float64)[y] - probs for y in group])  # grad_theta log softmax_y
        chance = math.prod(probs[y].item() for y in group)
        mean_gradient += chance * (advantages[:, None] * scores).sum(dim=0) / group_size
    assert torch.allclose(mean_gradient, expected, rtol=0, atol=1e-12)
    assert (mean_gradient - higher).abs().max() > 1e-3  # the two orders differ by (1 - p)^(G-1) grad p, here > 1e-3


# --- pass@k: 1 - C(n - c, k) / C(n, k) -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 2, 1 - 3 / 6),  # C(3, 2) = 3 of the C(4, 2) = 6 pairs miss the one correct answer
        (5, 2, 3, 1 - 1 / 10),  # C(3, 3) = 1 of C(5, 3) = 10 triples is all wrong
        (8, 3, 1, 3 / 8),  # pass@1 is c / n
        (8, 3, 6, 1.0),  # only 5 wrong: every 6 of them hold a correct one
        (8, 0, 8, 0.0),
        (8, 8, 1, 1.0),
        (200, 1, 100, 0.5),  # c = 1: pass@k = k / n; C(200, 100) is 9e58, the product form never builds it
    ],
)
def test_pass_at_k_worked_binomials(n, c, k, expected):
    # float64: a product of at most 100 factors in [0, 1], each rounded by u64: 100 * 1.1e-16 relative
    assert common.pass_at_k(torch.tensor([c]), n, k).item() == pytest.approx(expected, rel=0, abs=1e-13)


def test_pass_at_k_samples_names_the_powers_of_two_and_n():
    assert list(common.pass_at_k_samples(torch.tensor([1, 2]), 6)) == [
        "eval/pass@1",
        "eval/pass@2",
        "eval/pass@4",
        "eval/pass@6",
    ]


class CoinModel(torch.nn.Module):
    """Answers "2" with chance P2 and "3" otherwise, then ends (EOS): the prompt pass gives those two logits, every later
    pass EOS."""

    P2 = 0.3

    def __init__(self, tokenizer):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # evaluate reads the device from the parameters
        self.two, self.three = tokenizer.convert_tokens_to_ids(["2", "3"])
        self.eos, self.vocab = tokenizer.eos_token_id, len(tokenizer)

    def forward(self, input_ids, **kwargs):
        logits = torch.full((len(input_ids), input_ids.shape[1], self.vocab), -30.0)
        if input_ids.shape[1] > 1:  # the prompt pass
            logits[:, -1, self.two], logits[:, -1, self.three] = math.log(self.P2), math.log(1 - self.P2)
        else:
            logits[:, -1, self.eos] = 0.0
        return type("Out", (), {"logits": logits})()


def test_evaluate_logs_pass_at_k_of_each_problem_and_leaves_the_random_stream_alone():
    """1,000 problems answered "2" and 1,000 answered "3" (alternating), 4 samples each. A problem whose answer has
    chance q per sample has pass@k = 1 - (1 - q)^k, so the mean over problems is 1 - ((0.7)^k + (0.3)^k) / 2. Each
    problem's estimate lies in [0, 1] (variance <= 1/4): the mean of 2,000 has a std <= 0.5 / sqrt(2000) = 0.011, and the
    tolerance is 5 of them. A plug-in 1 - (1 - c/n)^k instead of the unbiased estimator is off by 0.09 at k = 4."""
    import datasets

    tokenizer = sft.build_tokenizer()
    answers = ["2", "3"] * 1000
    data = datasets.Dataset.from_dict({"prompt": [f"{i}+0=" for i in range(2000)], "answer": answers})
    task = tasks.Task("coin", data, data, tasks.addition_answer)
    model = CoinModel(tokenizer)
    state = torch.get_rng_state()
    out = common.evaluate(model, tokenizer, task, max_new_tokens=2, eval_samples=4, temperature=1.0)
    assert torch.equal(torch.get_rng_state(), state)  # training draws the same numbers with or without pass@k
    assert out["eval/accuracy"] == 0.5  # greedy: always "3"
    for k in (1, 2, 4):
        assert out[f"eval/pass@{k}"] == pytest.approx(1 - (0.7**k + 0.3**k) / 2, abs=0.056)
    again = common.evaluate(model, tokenizer, task, max_new_tokens=2, eval_samples=4, temperature=1.0)
    assert again["eval/pass@4"] == out["eval/pass@4"]  # the same draws at every evaluation
