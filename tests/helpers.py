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


def tiny_model_that_transforms_its_logits(kind: str, vocab: int = 18):
    """A randomly initialised tiny causal LM whose forward changes its logits after the output layer: Falcon-H1 scales
    them (lm_head_multiplier), RecurrentGemma soft-caps them (logits_soft_cap), Gemma 3n soft-caps them too, with the
    field on its text config."""
    from transformers import AutoModelForCausalLM, FalconH1Config, Gemma3nTextConfig, RecurrentGemmaConfig

    torch.manual_seed(0)
    shared = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if kind == "falcon_h1":
        config = FalconH1Config(**shared, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8)
        config.update(dict(mamba_d_state=8, mamba_n_groups=1, lm_head_multiplier=0.3))
    elif kind == "recurrent_gemma":
        config = RecurrentGemmaConfig(**shared, lru_width=32, attention_window_size=16, logits_soft_cap=1.0)
    else:
        config = Gemma3nTextConfig(**shared, num_key_value_heads=2, head_dim=8, final_logit_softcapping=1.0)
        config.update(
            dict(vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=8, laurel_rank=4, num_kv_shared_layers=0)
        )
        config.update(dict(layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0, 0.0]))
    return AutoModelForCausalLM.from_config(config).eval()
