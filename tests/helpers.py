"""Shared test fixtures: a clip table of PPO's surrogate, exact policy gradients of a tiny softmax policy, a tiny random
model."""

import torch

import common
import sft


def clip_table():
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7), eps = 0.2, old probability 0.2: (advantage, ratio, clipped
    objective, slope d objective / d ratio)."""
    return [
        (+2, 0.5, 1.0, 2.0),
        (+2, 1.1, 2.2, 2.0),
        (+2, 1.5, 2.4, 0.0),
        (-2, 0.5, -1.6, 0.0),
        (-2, 1.1, -2.2, -2.0),
        (-2, 1.5, -3.0, -2.0),
    ]


def policy_gradient_of(loss_fn, theta, actions):
    """-d loss / d theta for a single-step softmax policy with logits theta; loss_fn gets log pi(actions) as (G, 1)."""
    theta = theta.clone().requires_grad_(True)
    logprobs = torch.log_softmax(theta, dim=0)[actions][:, None]
    (grad,) = torch.autograd.grad(loss_fn(logprobs), theta)
    return -grad


def true_gradient(theta, rewards):
    """grad_theta E_{a ~ softmax(theta)}[r_a] = p_j (r_j - sum_k p_k r_k)."""
    probs = torch.softmax(theta, dim=0)
    return probs * (rewards - (probs * rewards).sum())


def tiny_model(batch=6, seed=0, prompt_len=4, completion_len=5):
    """A randomly initialised tiny Llama and a batch of left-padded prompts followed by completions of varied length."""
    torch.manual_seed(seed)
    tokenizer = sft.build_tokenizer()
    model = sft.build_tiny_model(tokenizer)
    prompt_ids = torch.randint(3, len(tokenizer), (batch, prompt_len))
    prompt_mask = torch.ones(batch, prompt_len, dtype=torch.long)
    prompt_mask[::2, :2] = 0  # every other prompt is left-padded
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, tokenizer.pad_token_id)
    completion_ids = torch.randint(3, len(tokenizer), (batch, completion_len))
    lengths = torch.arange(batch) % completion_len + 1
    completion_ids[torch.arange(batch), lengths - 1] = tokenizer.eos_token_id
    mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
    completion_ids = completion_ids.masked_fill(~mask, tokenizer.pad_token_id)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
    return model, input_ids, attention_mask, mask
