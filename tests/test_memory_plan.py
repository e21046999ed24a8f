"""memory_plan.py, the GPU memory table of docs/fitting-a-gpu.md: its parameter counts against the published ones, its
adapter count against peft's, and its activation formulas against what autograd really keeps in a forward pass."""

import types

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

import common
import memory_plan
from plumbing import lora

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "name, total, non_embedding",  # the Qwen2.5 model cards: "Number of Parameters" and "Number of Paramaters (Non-Embedding)"
    [("Qwen2.5-0.5B", 0.49, 0.36), ("Qwen2.5-1.5B", 1.54, 1.31), ("Qwen2.5-3B", 3.09, 2.77), ("Qwen2.5-7B", 7.61, 6.53)],
)
def test_the_qwen25_configs_have_the_published_parameter_counts(name, total, non_embedding):
    model = memory_plan.build_on_meta(Qwen2Config(**memory_plan.QWEN25[name]))
    count = memory_plan.parameter_count(model)
    embedding = model.get_input_embeddings().weight.numel()
    embedding *= 1 if model.config.tie_word_embeddings else 2  # the 7B's output layer is a matrix of its own
    assert round(count / 1e9, 2) == pytest.approx(total, abs=0.011)  # 7,615,616,512 is 7.61B on its card
    assert round((count - embedding) / 1e9, 2) == pytest.approx(non_embedding, abs=0.011)


def small_llama(kv_heads: int) -> LlamaConfig:
    """Two shapes for the activation formulas: without and with grouped key/value heads, an MLP of 3 h or 2.5 h."""
    return LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=192 if kv_heads == 4 else 160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
    )


def test_the_adapter_count_is_peft_s():
    from transformers import AutoModelForCausalLM

    for config in (small_llama(4), small_llama(2)):
        model = AutoModelForCausalLM.from_config(config)
        expected = memory_plan.adapter_parameter_count(memory_plan.build_on_meta(config), 8)
        args = types.SimpleNamespace(lora_rank=8, lora_alpha=0, lora_target_modules=lora.ALL_LINEAR)
        assert lora.trainable_parameter_count(lora.add_adapter(model, args))[0] == expected


def saved_bytes_per_token(model, sequence_length: int, autocast: bool) -> float:
    """Bytes of the tensors autograd keeps for the backward pass of common.completion_logprobs, per token, from the
    difference between two sequence lengths (what does not grow with the tokens, like autocast's weight copies, cancels);
    the model's own weights are not counted."""

    def kept(length):
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(3, model.config.vocab_size, (4, length), generator=torch.Generator().manual_seed(0))
        context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
            common.completion_logprobs(model, ids, torch.ones_like(ids), 4, 1.0)
        return sum(storages.values())

    return (kept(2 * sequence_length) - kept(sequence_length)) / (4 * sequence_length)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("kind", ["full, fp32", "lora, fp32", "full, bf16 autocast", "lora, bf16 base and autocast"])
def test_the_activation_formulas_count_what_autograd_keeps(kv_heads, kind):
    """Within 8%: what the formulas leave out is outside the layers (the embedding's output, the final norm, the output
    layer's input), a few h per token against 4 layers' worth. CPU autocast to bf16 stands in for a GPU's."""
    from transformers import AutoModelForCausalLM

    config = small_llama(kv_heads)
    rank = 8 if kind.startswith("lora") else 0
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16 if "bf16 base" in kind else torch.float32)
    if rank:
        model = lora.add_adapter(model, types.SimpleNamespace(lora_rank=rank, lora_alpha=0, lora_target_modules="all-linear"))
    measured = saved_bytes_per_token(model, 32, autocast="autocast" in kind)
    formula = memory_plan.activation_bytes_per_token(config, rank, on_gpu="autocast" in kind)
    assert formula == pytest.approx(measured, rel=0.08)
