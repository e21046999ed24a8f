"""dpo.py against DPO (Rafailov et al. 2023, §4-5): the loss, its gradient, the KL-regularised optimum."""

import math
import os

import pytest
import torch

import common
import dpo
import preference_pairs
import sft
import tasks
from helpers import tiny_model
from plumbing import lora, models


def args(**overrides):
    return dpo.Args(**{"max_new_tokens": 8, **overrides})


def test_loss_value_and_metrics():
    f64 = dict(dtype=torch.float64)
    chosen, rejected = torch.tensor([-1.0, -2.0], **f64), torch.tensor([-3.0, -1.0], **f64)
    ref_chosen, ref_rejected = torch.tensor([-1.5, -2.0], **f64), torch.tensor([-2.0, -2.0], **f64)
    loss, m = dpo.compute_loss(chosen, rejected, ref_chosen, ref_rejected, args(beta=0.5))
    z = (0.75, -0.5)  # beta * Delta per pair: 0.5 * (0.5 - (-1.0)), 0.5 * (0.0 - 1.0)
    # float64: log(1 + e^-z) of 2 pairs, a few u64 = 1e-16 of values < 1
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-x)) for x in z) / 2, abs=1e-12)
    # exactly: the log-probs, beta and the means are halves and quarters, exact in binary floating point
    assert m["rewards/chosen"].mean().item() == 0.5 * (0.5 + 0.0) / 2
    assert m["rewards/rejected"].mean().item() == 0.5 * (-1.0 + 1.0) / 2
    assert m["rewards/margins"].mean().item() == sum(z) / 2
    assert m["rewards/accuracies"].mean().item() == 0.5
    same = torch.zeros(1, **f64)
    loss, m = dpo.compute_loss(same, same, same, same, args())
    assert loss.item() == pytest.approx(math.log(2), abs=1e-12)  # float64: -log sigmoid(0) within a few u64
    assert m["rewards/accuracies"].mean().item() == 0.0  # a tie is not a win


def test_gradient_is_minus_beta_sigmoid_minus_z_times_the_score_difference():
    """d loss / d log pi(y_w) = -beta sigmoid(-z) / N and d loss / d log pi(y_l) = +beta sigmoid(-z) / N."""
    beta, f64 = 0.3, dict(dtype=torch.float64)
    chosen = torch.tensor([-1.0, -4.0], **f64, requires_grad=True)
    rejected = torch.tensor([-2.0, -1.0], **f64, requires_grad=True)
    ref_chosen, ref_rejected = torch.tensor([-1.2, -3.0], **f64), torch.tensor([-1.5, -1.5], **f64)
    loss, _ = dpo.compute_loss(chosen, rejected, ref_chosen, ref_rejected, args(beta=beta))
    loss.backward()
    z = beta * ((chosen - ref_chosen) - (rejected - ref_rejected)).detach()
    # float64: a sigmoid and three products of values < 1 by two routes: a few u64 = 1e-16
    assert torch.allclose(chosen.grad, -beta * torch.sigmoid(-z) / 2, rtol=0, atol=1e-12)
    assert torch.allclose(rejected.grad, beta * torch.sigmoid(-z) / 2, rtol=0, atol=1e-12)
    assert chosen.grad[1].abs() > chosen.grad[0].abs()  # the pair the policy gets wrong (z < 0) weighs more


def test_the_kl_regularised_optimum_and_its_implied_rewards():
    """DPO §4 on five outcomes: p* = q exp(R / beta) / Z maximises E_p[R] - beta KL(p || q), and the DPO margin
    of pi = p* against pi_ref = q recovers the reward difference of any pair."""
    beta = 0.5
    q = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3], dtype=torch.float64)
    p_star = q * torch.exp(rewards / beta)
    p_star = p_star / p_star.sum()
    objective = lambda p: (p * rewards).sum() - beta * (p * (p / q).log()).sum()
    torch.manual_seed(0)
    for _ in range(200):
        nearby = torch.softmax(p_star.log() + 0.3 * torch.randn(5), dim=0)
        assert objective(nearby) < objective(p_star)
    # float64: sums of 5 terms of size < 2 (p R and p log(p / q)): < 10 u64 * 5 = 6e-15
    assert objective(p_star).item() == pytest.approx(beta * torch.log((q * torch.exp(rewards / beta)).sum()).item(), abs=1e-12)
    for win in range(5):
        for lose in range(5):
            logps = p_star.log()[[win]], p_star.log()[[lose]], q.log()[[win]], q.log()[[lose]]
            _, m = dpo.compute_loss(*logps, args(beta=beta))
            # float64: a difference of 4 logs of size < 6, times beta: < 8 u64 * 6 = 5e-15
            assert m["rewards/margins"].mean().item() == pytest.approx((rewards[win] - rewards[lose]).item(), abs=1e-12)


def test_sequence_logps_are_sums_over_completion_tokens_only():
    model, input_ids, attention_mask, mask = tiny_model(batch=4)
    prompt_len = input_ids.shape[1] - mask.shape[1]
    prompt_ids, prompt_mask = input_ids[:, :prompt_len], attention_mask[:, :prompt_len]
    completion_ids = input_ids[:, prompt_len:]
    got = dpo.sequence_logps(model, prompt_ids, prompt_mask, completion_ids, mask)
    per_token, _ = common.completion_logprobs(model, input_ids, attention_mask, mask.shape[1], 1.0)
    # The same forward on the same batch (padding after a row's end is causally after, and masked): only the sum of
    # <= 5 log-probs of size < 3 may run in another order, < 5 u * 15 = 5e-6 in float32. A mean is several nats off.
    assert torch.allclose(got, (per_token * mask).sum(dim=1), rtol=0, atol=1e-5)
    assert not torch.allclose(got, (per_token * mask).sum(dim=1) / mask.sum(dim=1), rtol=0, atol=1e-3)  # not a mean
    other_padding = completion_ids.masked_fill(~mask, 7)  # whatever sits on padding does not count
    assert torch.allclose(dpo.sequence_logps(model, prompt_ids, prompt_mask, other_padding, mask), got, rtol=0, atol=1e-5)


def test_pairs_pair_a_correct_with_a_wrong_answer_and_count_the_skipped(monkeypatch):
    model, *_ = tiny_model()
    tokenizer = sft.build_tokenizer()
    task = tasks.make_task("addition")
    # a verifier that calls an answer correct when it has an even number of characters
    monkeypatch.setattr(tasks.Task, "verify", lambda self, c, a: torch.tensor([float(len(x) % 2 == 0) for x in c]))
    torch.manual_seed(0)
    pairs, skipped = preference_pairs.sample_verifier_pairs(
        model, tokenizer, task, args(num_pair_prompts=40, group_size=4), torch.device("cpu")
    )
    assert len(pairs) + skipped == 40 and len(pairs) > 0
    for row in pairs:
        assert len(row["chosen"]) % 2 == 0 and len(row["rejected"]) % 2 == 1
    data = preference_pairs.tokenize_pairs(tokenizer, pairs[:4], torch.device("cpu"))
    chosen_ids, chosen_mask = data["chosen_ids"], data["chosen_mask"]
    for ids, mask, text in zip(chosen_ids, chosen_mask, pairs[:4]["chosen"]):
        assert ids[mask].tolist() == tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def test_pairs_built_in_another_dtype_are_cached_apart(model_dir, tmp_path, monkeypatch):
    """The pairs are sampled by the policy in its own dtype (lora.base_dtype: a bf16 LoRA base samples in bf16), so a
    run in bf16 must not read the float32 run's pairs from the cache, nor the float32 run the bf16 one's."""
    monkeypatch.setattr(tasks.Task, "verify", lambda self, c, a: torch.tensor([float(len(x) % 2 == 0) for x in c]))
    task, device, built = tasks.make_task("addition"), torch.device("cpu"), []

    def load_policy():
        built.append(1)
        return models.load_model_and_tokenizer(model_dir, "", device)

    settings = dict(model_name_or_path=model_dir, cache_dir=str(tmp_path), num_pair_prompts=8, group_size=4)
    float32_args, bf16_args = args(**settings), args(**settings, lora_rank=4, lora_base_dtype="bfloat16")
    assert (lora.base_dtype(float32_args, device), lora.base_dtype(bf16_args, device)) == (torch.float32, torch.bfloat16)
    for run_args in (float32_args, bf16_args, float32_args, bf16_args):
        preference_pairs.cached_verifier_pairs(run_args, task, load_policy, device)
    assert built == [1, 1]  # each dtype built its pairs once, then read them from the cache
    assert len([name for name in os.listdir(tmp_path) if name.startswith("dpo-pairs-")]) == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"beta": 0.0}, "--beta"),
        ({"batch_size": 6, "micro_batch_size": 4}, "--micro-batch-size"),
        ({"dataset": "./nope.json"}, "--dataset"),
    ],
)
def test_bad_input_names_the_flag(overrides, message):
    with pytest.raises(SystemExit, match=message):
        dpo.check_args(args(**overrides))
