"""What a training step needs in GPU memory, from a model's config: weights, gradients, optimizer state, the reference,
opd.py's teacher, and what each phase of a step adds (generation's KV cache, the update's activations), for full training
(fp32 weights, bf16 autocast) and for LoRA (--lora-rank, the frozen weights in bf16). docs/fitting-a-gpu.md explains
every term.

    python -m benchmarks.memory_plan  # the table of docs/fitting-a-gpu.md (Qwen2.5 0.5B-7B)
    python -m benchmarks.memory_plan --model-name-or-path Qwen2.5-1.5B --micro-batch-size 8 --sequence-length 512
    python -m benchmarks.memory_plan --teacher Qwen2.5-7B --no-reference  # opd.py with a 7B teacher (its default --beta 0)
    python -m benchmarks.memory_plan --model-name-or-path Qwen/Qwen2.5-7B-Instruct --lora-rank 16 --sequence-length 2048

A step's peak is what lives throughout (weights, gradients, AdamW's state, a reference, a teacher) plus the largest of
three phases, never alive together:
1. generation: autocast's bf16 copies of every linear layer's weights (cast in each decoding step's forward, with or
   without a gradient), the KV cache, and the step's own tensors;
2. opd.py's teacher, scoring the responses one micro-batch at a time without gradient;
3. the update of one micro-batch: autocast's copies again (kept for the backward pass), the activations, and the output
   layer's chunks and weight gradient.
The policy's and the reference's own log-probs without gradient are the update's forward pass without what it keeps, so
they never exceed it. Parameter counts are exact (the model is built on PyTorch's meta device, which allocates nothing).
The formulas count a Llama-type decoder layer (RMSNorm, attention with grouped key/value heads through SDPA, SwiGLU MLP)
fed a padded batch, as every rollout is (left-padded prompts, responses that end early); tests/test_memory_plan.py
checks them against the tensors autograd saves and the peaks the CPU's allocator records in real passes, CPU autocast
standing in for a GPU's.
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
    """a name of the Qwen2.5 table (e.g. Qwen2.5-1.5B), or a model folder or hub id whose config.json to read (default:
    every model of the table)"""
    lora_rank: int = 16
    """the adapter's rank for the LoRA rows (every linear layer but the output layer, as --lora-target-modules' default)"""
    micro_batch_size: int = 8
    """responses per forward/backward pass (the scripts' --micro-batch-size; their default is the whole minibatch)"""
    sequence_length: int = 1024
    """tokens per response, prompt included (the longest prompt of a batch plus --max-new-tokens)"""
    rollout_responses: int = 256
    """responses generated at once in a rollout (--num-prompts x --group-size per process; KV cache)"""
    reference: bool = True
    """a reference model for the KL penalty (--beta > 0); --no-reference for --beta 0 (opd.py's default)"""
    teacher: str = ""
    """opd.py's --teacher: a name of the Qwen2.5 table or a model folder or hub id (default: none, as in every other script)"""


def build_on_meta(config):
    """The model of `config`, built on the meta device: shapes without memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def linear_parameter_count(model, output_layer: bool) -> int:
    """Parameters of the linear layers (weights and biases), the output layer's included or not: what bf16 autocast
    casts (the embedding and the norms stay fp32). A tied output layer is the embedding matrix, cast for the product."""
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and (output_layer or m is not head)]
    return sum(p.numel() for m in linears for p in m.parameters())


def adapter_parameter_count(model, rank: int) -> int:
    """A LoRA adapter of rank r on every linear layer but the output layer (peft's all-linear): r (in + out) each."""
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return sum(rank * (m.in_features + m.out_features) for m in linears)


def layer_shapes(config) -> tuple[int, int, int, int]:
    """hidden size h, key/value width kv (key/value heads x head size), MLP width I, layers L."""
    h = config.hidden_size
    return h, config.num_key_value_heads * head_size(config), config.intermediate_size, config.num_hidden_layers


def head_size(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def activation_bytes_per_token(config, lora_rank: int = 0, on_gpu: bool = True, sequence_length: int = 0) -> float:
    """Bytes autograd keeps per token for the backward pass, summed over the layers (the final norm and the output
    layer's input add about 12 h bytes more; the output layer is `output_layer_update_bytes`). Per layer:
    - full training under bf16 autocast (fp32 weights; the residual stream and RMSNorm in fp32, each linear layer's
      input cast to bf16 separately): 32 h + 4 kv + 8 I bytes;
    - LoRA with a bf16 base under autocast: a frozen layer keeps no input of its own, but its adapter does, and the
      adapter's rank-r intermediate too: 24 h + 4 kv + 8 I + 14 r;
    - on the CPU in fp32: 4 (8 h + 2 kv + 4 I) full, 4 (6 h + 2 kv + 4 I + 7 r) with LoRA.
    A padded batch of `sequence_length` S tokens a row (0: a mask of ones, which SDPA never sees) costs more: the
    keys and values are repeated to every head before SDPA (transformers' sdpa_attention_forward passes grouped heads
    to SDPA only without a mask), kv becomes h, and each layer's SDPA keeps the mask as an additive bias in the
    activations' dtype, S values a token: + 2 (h - kv) + S values of 2 bytes (4 on the CPU in fp32)."""
    h, kv, inter, layers = layer_shapes(config)
    if on_gpu:
        per_layer = 32 * h + 4 * kv + 8 * inter if not lora_rank else 24 * h + 4 * kv + 8 * inter + 14 * lora_rank
    else:
        per_layer = 4 * (8 * h + 2 * kv + 4 * inter) if not lora_rank else 4 * (6 * h + 2 * kv + 4 * inter + 7 * lora_rank)
    if sequence_length:
        per_layer += (2 if on_gpu else 4) * (2 * (h - kv) + sequence_length)
    return layers * per_layer


def checkpointed_activation_bytes_per_token(config, lora_rank: int = 0, sequence_length: int = 0) -> float:
    """With --gradient-checkpointing on a GPU: each layer's input only (fp32 residual stream, bf16 with a bf16 base),
    and one layer's full activations while it is recomputed in the backward pass."""
    h, kv, inter, layers = layer_shapes(config)
    return layers * h * (2 if lora_rank else 4) + activation_bytes_per_token(config, lora_rank, True, sequence_length) / layers


def logits_bytes() -> int:
    """common.completion_logprobs's chunk on the CPU check of benchmark_real_model: LOGITS_CHUNK fp32 logits and their
    log-softmax and probabilities (on a GPU, `chunk_bytes`)."""
    return 3 * 4 * common.LOGITS_CHUNK


def chunk_entries(config) -> int:
    """Logits of one chunk of common.completion_logprobs: LOGITS_CHUNK // V positions (at least one) of V entries."""
    return max(1, common.LOGITS_CHUNK // config.vocab_size) * config.vocab_size


def chunk_bytes(config) -> int:
    """One chunk's logits under autocast, C entries: the output layer's product in bf16 (2 C bytes), then in fp32 its
    log-softmax, their exp and the entropy's product (3 x 4 C) at the same time."""
    return 14 * chunk_entries(config)


def output_layer_update_bytes(config, lora_rank: int = 0) -> int:
    """The output layer in the update, on top of the activations. With LoRA (a frozen bf16 output layer) one chunk
    (`chunk_bytes`), recomputed in the backward pass. In full training the output layer's weight W (V x h) is trained
    too: each chunk casts W to bf16 (2 V h), and its gradient, in bf16 then cast to fp32, is summed over the chunks in
    an fp32 buffer of autograd's until the backward pass is done with W: at worst the buffer (4 V h), a chunk's bf16
    gradient (2 V h) and its fp32 copy (4 V h); or the buffer, W's copy and a chunk's logits."""
    h, V = config.hidden_size, config.vocab_size
    if lora_rank:
        return chunk_bytes(config)
    return max(10 * V * h, 6 * V * h + chunk_bytes(config))


def kv_cache_bytes(config, responses: int, length: int, fp32_keys: bool) -> float:
    """Generation's KV cache: a key and a value of width kv per layer and token. The values are bf16 (a linear layer's
    output under autocast); the keys take the dtype of the rotary embedding's cos and sin, which is that of the hidden
    states: fp32 in full training (fp32 embedding), bf16 with a bf16 base."""
    h, kv, _, layers = layer_shapes(config)
    return ((4 if fp32_keys else 2) + 2) * layers * kv * responses * length


def generation_step_bytes(config, responses: int, length: int, fp32_keys: bool) -> float:
    """What a decoding step adds to the cache and the weights' copies: one layer's keys a second time (the cache grows by
    torch.cat, which copies), and the last position's logits of the step before, still held while the next runs: in bf16,
    in fp32, and the sampling probabilities (10 bytes per response and vocabulary entry)."""
    _, kv, _, _ = layer_shapes(config)
    return (4 if fp32_keys else 2) * kv * responses * length + 10 * responses * config.vocab_size


def no_grad_forward_bytes(config, responses: int, length: int) -> float:
    """Peak of common.logprobs_no_grad on one micro-batch of n = responses x length tokens with fp32 weights that take no
    gradient (opd.py's teacher): nothing is kept, so the larger of two moments.
    - In a layer's MLP: the embedding's output, the layer's input, the residual and the normed input (fp32, 16 h bytes
      a token), the gate's activation, the up projection and their product (bf16, 6 I), the padded mask (bool, S a
      token) and the rotary cos and sin (fp32, 8 x head size d): n (16 h + 6 I + S + 8 d). The attention's moment is
      smaller when I > 2 h + kv + S / 3, as in every Qwen2.5 (I = 5.3-5.8 h).
    - In the output layer: the final hidden states and their completion positions (fp32, at most 8 n h), and either the
      weight's bf16 copy with one chunk's product (2 V h + 2 C) or one chunk's logits (14 C)."""
    h, _, inter, _ = layer_shapes(config)
    n, C = responses * length, chunk_entries(config)
    layer = n * (16 * h + 6 * inter + length + 8 * head_size(config))
    output_layer = 8 * n * h + max(2 * config.vocab_size * h + 2 * C, chunk_bytes(config))
    return max(layer, output_layer)


def plan(config, args: Args, teacher_config=None) -> dict:
    """Bytes of each term, for full training and for LoRA."""
    model = build_on_meta(config)
    params, adapter = parameter_count(model), adapter_parameter_count(model, args.lora_rank)
    S, tokens = args.sequence_length, args.micro_batch_size * args.sequence_length
    teacher = parameter_count(build_on_meta(teacher_config)) if teacher_config is not None else 0
    teacher_forward = no_grad_forward_bytes(teacher_config, args.micro_batch_size, S) if teacher_config is not None else 0
    shared = {
        "teacher": 4 * teacher,  # opd.py loads the teacher in fp32, with or without --lora-rank
        "teacher's forward": teacher_forward,
    }
    head = 2 * (linear_parameter_count(model, True) - linear_parameter_count(model, False))
    full = {
        "weights": 4 * params,  # fp32 master weights
        "gradients": 4 * params,
        "AdamW state": 8 * params,  # two fp32 moments
        "reference": 4 * params if args.reference else 0,  # a second fp32 model (beta > 0)
        **shared,
        "autocast copies": 2 * linear_parameter_count(model, False),  # the layers', kept for the backward pass
        "output layer's copy": head,  # cast in every decoding step too
        "activations": tokens * activation_bytes_per_token(config, 0, True, S),
        "activations, checkpointed": tokens * checkpointed_activation_bytes_per_token(config, 0, S),
        "output layer": output_layer_update_bytes(config),
        "KV cache": kv_cache_bytes(config, args.rollout_responses, S, fp32_keys=True),
        "generation step": generation_step_bytes(config, args.rollout_responses, S, fp32_keys=True),
    }
    lora = {
        "weights": 2 * params + 4 * adapter,  # the bf16 base and the fp32 adapter
        "gradients": 4 * adapter,
        "AdamW state": 8 * adapter,
        "reference": 0,  # the base with the adapter switched off
        **shared,
        "autocast copies": 2 * adapter,
        "output layer's copy": 0,  # bf16 already
        "activations": tokens * activation_bytes_per_token(config, args.lora_rank, True, S),
        "activations, checkpointed": tokens * checkpointed_activation_bytes_per_token(config, args.lora_rank, S),
        "output layer": output_layer_update_bytes(config, args.lora_rank),
        "KV cache": kv_cache_bytes(config, args.rollout_responses, S, fp32_keys=False),
        "generation step": generation_step_bytes(config, args.rollout_responses, S, fp32_keys=False),
    }
    return {"params": params, "adapter": adapter, "teacher_params": teacher, "full": full, "lora": lora}


THROUGHOUT = ("weights", "gradients", "AdamW state", "reference", "teacher")
# Each card class's memory in GiB: a 16 GB T4 has 15 GiB (15,360 MiB); the larger classes are counted at their size,
# though some of their cards have less (an A10 or L4 of 24 GB: 22.5 GiB)
CARDS_GIB = {"16 GB": 15.0, "24 GB": 24.0, "48 GB": 48.0, "80 GB": 80.0}
HEADROOM_GIB = 1.5  # the CUDA context and the allocator's fragmentation


def phases(terms: dict, checkpointed: bool) -> dict:
    """What each phase of a step adds to what lives throughout; no two are alive together."""
    activations = terms["activations, checkpointed" if checkpointed else "activations"]
    return {
        "generation": terms["autocast copies"] + terms["output layer's copy"] + terms["KV cache"] + terms["generation step"],
        "teacher's forward": terms["teacher's forward"],
        "update": terms["autocast copies"] + activations + terms["output layer"],
    }


def peak(terms: dict, checkpointed: bool) -> float:
    """What lives throughout plus the largest phase."""
    return sum(terms[k] for k in THROUGHOUT) + max(phases(terms, checkpointed).values())


def smallest_card(need: float) -> str:
    """The smallest card class of CARDS_GIB whose memory holds `need` bytes and the headroom."""
    fits = [name for name, size in CARDS_GIB.items() if need / GIB + HEADROOM_GIB <= size]
    return fits[0] if fits else "none (use --fsdp)"


def table(configs: dict, args: Args, teacher_config=None) -> list[str]:
    gib = lambda n: f"{n / GIB:.1f}"
    teacher = ("teacher", "teacher's forward") if teacher_config is not None else ()
    columns = ("weights", "gradients", "AdamW state", "reference", *teacher, "autocast copies", "activations")
    columns += ("activations, checkpointed", "output layer", "KV cache")
    header = ["model", "training", *columns, "peak", "largest phase", "smallest card"]
    header += ["peak, checkpointed", "largest phase, checkpointed", "smallest card, checkpointed"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, config in configs.items():
        p = plan(config, args, teacher_config)
        for kind, terms in (("full", p["full"]), (f"LoRA r={args.lora_rank}", p["lora"])):
            count = f"{p['params'] / 1e9:.2f}B" if kind == "full" else f"{p['adapter'] / 1e6:.1f}M trained"
            cells = [gib(terms[k]) for k in columns]
            for checkpointed in (False, True):
                each = phases(terms, checkpointed)
                need = peak(terms, checkpointed)
                cells += [gib(need), max(each, key=each.get), smallest_card(need)]
            lines.append(f"| {name} ({count}) | {kind} | {' | '.join(cells)} |")
    return lines


def load_config(name: str):
    """A config of the Qwen2.5 table by name, else the config.json of a model folder or hub id."""
    from transformers import AutoConfig, Qwen2Config

    return Qwen2Config(**QWEN25[name]) if name in QWEN25 else AutoConfig.from_pretrained(name)


def table_of(args: Args) -> list[str]:
    """The table this command prints: --model-name-or-path's rows, or every Qwen2.5 size's."""
    names = [args.model_name_or_path] if args.model_name_or_path else list(QWEN25)
    teacher_config = load_config(args.teacher) if args.teacher else None
    return table({name: load_config(name) for name in names}, args, teacher_config)


if __name__ == "__main__":
    print("\n".join(table_of(tyro.cli(Args))))
