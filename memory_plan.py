"""What a training step needs in GPU memory, from a model's config: weights, gradients, optimizer state, the reference,
the activations and logits of one micro-batch, and generation's KV cache, for full training (fp32 weights, bf16
autocast) and for LoRA (--lora-rank, the frozen weights in bf16). docs/fitting-a-gpu.md explains every term.

    python memory_plan.py                                          # the table of docs/fitting-a-gpu.md (Qwen2.5 0.5B-7B)
    python memory_plan.py --model-name-or-path Qwen/Qwen2.5-7B-Instruct --lora-rank 16 --sequence-length 2048

Parameter counts are exact (the model is built on PyTorch's meta device, which allocates nothing). The activation
formulas count what autograd keeps for the backward pass in a Llama-type decoder layer (RMSNorm, attention with
grouped key/value heads through SDPA, SwiGLU MLP); tests/test_memory_plan.py checks them against the saved tensors of
real forward passes.
"""

from dataclasses import dataclass

import torch
import tyro

import common

GIB = 2**30

# Qwen2.5's configs (config.json on the hub), so that the table needs no download
QWEN25 = {
    "Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    "Qwen2.5-3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16),
    "Qwen2.5-7B": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4
    ),
}
for name, fields in QWEN25.items():
    fields.setdefault("num_key_value_heads", 2)
    fields.update(vocab_size=152_064 if name.endswith("7B") else 151_936, tie_word_embeddings=not name.endswith("7B"))


@dataclass
class Args:
    model_name_or_path: str = ""
    """a model folder or hub id whose config.json to read (default: the Qwen2.5 table of docs/fitting-a-gpu.md)"""
    lora_rank: int = 16
    """the adapter's rank for the LoRA columns (every linear layer but the output layer, as --lora-target-modules' default)"""
    micro_batch_size: int = 8
    """responses per forward/backward pass"""
    sequence_length: int = 1024
    """tokens per response, prompt included"""
    rollout_responses: int = 256
    """responses generated at once in a rollout (--num-prompts x --group-size per process; KV cache)"""


def build_on_meta(config):
    """The model of `config`, built on the meta device: shapes without memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def adapter_parameter_count(model, rank: int) -> int:
    """A LoRA adapter of rank r on every linear layer but the output layer (peft's all-linear): r (in + out) each."""
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return sum(rank * (m.in_features + m.out_features) for m in linears)


def layer_shapes(config) -> tuple[int, int, int, int]:
    """hidden size h, key/value width kv (key/value heads x head size), MLP width I, layers L."""
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    return h, config.num_key_value_heads * head_dim, config.intermediate_size, config.num_hidden_layers


def activation_bytes_per_token(config, lora_rank: int = 0, on_gpu: bool = True) -> float:
    """Bytes autograd keeps per token for the backward pass, summed over the layers (the final norm and the output
    layer's input add about 12 h bytes more; the logits are chunked, see `logits_bytes`). Per layer:
    - full training under bf16 autocast (fp32 weights; the residual stream and RMSNorm in fp32, each linear layer's
      input cast to bf16 separately): 32 h + 4 kv + 8 I bytes;
    - LoRA with a bf16 base under autocast: a frozen layer keeps no input of its own, but its adapter does, and the
      adapter's rank-r intermediate too: 24 h + 4 kv + 8 I + 14 r;
    - on the CPU in fp32 (this machine's check): 4 (8 h + 2 kv + 4 I) full, 4 (6 h + 2 kv + 4 I + 7 r) with LoRA."""
    h, kv, inter, layers = layer_shapes(config)
    if on_gpu:
        per_layer = 32 * h + 4 * kv + 8 * inter if not lora_rank else 24 * h + 4 * kv + 8 * inter + 14 * lora_rank
    else:
        per_layer = 4 * (8 * h + 2 * kv + 4 * inter) if not lora_rank else 4 * (6 * h + 2 * kv + 4 * inter + 7 * lora_rank)
    return layers * per_layer


def checkpointed_activation_bytes_per_token(config, lora_rank: int = 0) -> float:
    """With --gradient-checkpointing on a GPU: each layer's input only (fp32 residual stream, bf16 with a bf16 base),
    and one layer's full activations while it is recomputed in the backward pass."""
    h, kv, inter, layers = layer_shapes(config)
    return layers * h * (2 if lora_rank else 4) + activation_bytes_per_token(config, lora_rank) / layers


def logits_bytes() -> int:
    """common.completion_logprobs holds one chunk of LOGITS_CHUNK fp32 logits and its log-softmax and probabilities."""
    return 3 * 4 * common.LOGITS_CHUNK


def kv_cache_bytes(config, responses: int, length: int) -> float:
    """Generation's KV cache in bf16: a key and a value of width kv per layer and token."""
    h, kv, _, layers = layer_shapes(config)
    return 2 * 2 * layers * kv * responses * length


def plan(config, args: Args) -> dict:
    """Bytes of each term, for full training and for LoRA, with a reference model (beta > 0)."""
    model = build_on_meta(config)
    params, adapter = parameter_count(model), adapter_parameter_count(model, args.lora_rank)
    tokens = args.micro_batch_size * args.sequence_length
    full = {
        "weights": 4 * params,  # fp32 master weights
        "bf16 copies (autocast)": 2 * params,  # kept from the forward pass for the backward pass
        "gradients": 4 * params,
        "AdamW state": 8 * params,  # two fp32 moments
        "reference": 4 * params,  # a second fp32 model (beta > 0)
        "activations": tokens * activation_bytes_per_token(config),
        "activations, checkpointed": tokens * checkpointed_activation_bytes_per_token(config),
        "logits (chunked)": logits_bytes(),
    }
    lora = {
        "weights": 2 * params + 4 * adapter,  # the bf16 base and the fp32 adapter
        "bf16 copies (autocast)": 2 * adapter,
        "gradients": 4 * adapter,
        "AdamW state": 8 * adapter,
        "reference": 0,  # the base with the adapter switched off
        "activations": tokens * activation_bytes_per_token(config, args.lora_rank),
        "activations, checkpointed": tokens * checkpointed_activation_bytes_per_token(config, args.lora_rank),
        "logits (chunked)": logits_bytes(),
    }
    kv = kv_cache_bytes(config, args.rollout_responses, args.sequence_length)
    return {"params": params, "adapter": adapter, "full": full, "lora": lora, "kv_cache": kv}


STATIC = ("weights", "bf16 copies (autocast)", "gradients", "AdamW state", "reference")
CARDS_GIB = (24, 48, 80)
HEADROOM_GIB = 1.5  # the CUDA context and the allocator's fragmentation


def peak(terms: dict, kv_cache: float, checkpointed: bool) -> float:
    """What lives throughout (weights, gradients, optimizer state, reference) plus the larger of the update's share
    (autocast's weight copies, the activations, a chunk of logits) and generation's KV cache: never alive together."""
    update = terms["bf16 copies (autocast)"] + terms["activations, checkpointed" if checkpointed else "activations"]
    throughout = sum(terms[k] for k in STATIC if k != "bf16 copies (autocast)")
    return throughout + max(update + terms["logits (chunked)"], kv_cache)


def smallest_card(need: float) -> str:
    fits = [c for c in CARDS_GIB if need / GIB + HEADROOM_GIB <= c]
    return f"{fits[0]} GB" if fits else "none (use --fsdp)"


def table(configs: dict, args: Args) -> list[str]:
    gib = lambda n: f"{n / GIB:.1f}"  # noqa: E731
    lines = [
        "| model | training | weights | autocast copies | gradients | AdamW | reference | activations | checkpointed "
        "| KV cache | peak | smallest card | peak, checkpointed | smallest card, checkpointed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, config in configs.items():
        p = plan(config, args)
        for kind, terms in (("full", p["full"]), (f"LoRA r={args.lora_rank}", p["lora"])):
            count = f"{p['params'] / 1e9:.2f}B" if kind == "full" else f"{p['adapter'] / 1e6:.1f}M trained"
            cells = [gib(terms[k]) for k in (*STATIC, "activations", "activations, checkpointed")]
            cells.append(gib(p["kv_cache"]))
            for checkpointed in (False, True):
                need = peak(terms, p["kv_cache"], checkpointed)
                cells += [gib(need), smallest_card(need)]
            lines.append(f"| {name} ({count}) | {kind} | {' | '.join(cells)} |")
    return lines


if __name__ == "__main__":
    args = tyro.cli(Args)
    from transformers import AutoConfig, Qwen2Config

    if args.model_name_or_path:
        configs = {args.model_name_or_path: AutoConfig.from_pretrained(args.model_name_or_path)}
    else:
        configs = {name: Qwen2Config(**fields) for name, fields in QWEN25.items()}
    print("\n".join(table(configs, args)))
