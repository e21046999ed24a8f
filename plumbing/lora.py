"""--lora-rank: train a low-rank adapter instead of every weight (LoRA, Hu et al. 2021), through peft.

Each targeted linear layer W (the attention and MLP projections by default) gets two small matrices, A (r x in) and
B (out x r), and computes W x + (alpha / r) B A x; B starts at zero, so the adapted model starts as the base model. Only
A and B are trained (and a new head, e.g. the reward model's score): the optimizer state, the gradients and the
checkpoints hold only them, and the frozen base may be held in bf16 (`base_dtype`).

The adapter is injected into the model in place (peft.inject_adapter_in_model): the model keeps its class and
everything in common.py works on it unchanged. The reference model of the KL penalty is then the same module with the
adapter switched off (`WithoutAdapter`), not a second copy of the weights. `save_merged` writes the adapter, then the
model with the adapter merged into its weights, so that from_pretrained loads the saved folder as before."""

import os
from contextlib import contextmanager

import torch

# peft's shorthand for every linear layer but the output layer: in a transformer, the attention and MLP projections
ALL_LINEAR = "all-linear"


def base_dtype(args, device: torch.device) -> torch.dtype:
    """The dtype the weights are loaded in: float32 without --lora-rank (they are trained; bf16 autocast on a GPU does
    the arithmetic in bf16 anyway). With it, --lora-base-dtype; auto is bfloat16 on a GPU that supports it (half the
    memory of the frozen base) and float32 on the CPU (bf16 arithmetic is slow on most CPUs)."""
    if not args.lora_rank or args.lora_base_dtype == "float32":
        return torch.float32
    if args.lora_base_dtype == "bfloat16" or (device.type == "cuda" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return torch.float32


def add_adapter(model, args, trained_modules: tuple[str, ...] = ()):
    """Freeze the model and inject a LoRA adapter of rank --lora-rank into the layers --lora-target-modules names
    (scale --lora-alpha / rank; alpha 0 means twice the rank), in float32 whatever the base's dtype. `trained_modules`
    (e.g. a reward model's new head "score") are trained whole, in float32. Returns the same model object."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = args.lora_target_modules
    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha or 2 * args.lora_rank,
        lora_dropout=0.0,  # no dropout: every model here stays in eval mode, so that on-policy the ratio is exactly 1
        target_modules=targets if targets == ALL_LINEAR else [t.strip() for t in targets.split(",") if t.strip()],
        exclude_modules=list(trained_modules) or None,  # a head trained whole gets no adapter of its own
    )
    model.requires_grad_(False)
    try:
        model = inject_adapter_in_model(config, model)
    except ValueError as e:  # peft: "Target modules ... not found in the base model"
        raise SystemExit(f"--lora-target-modules {targets!r}: {str(e).splitlines()[0]}") from None
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # the adapter and its optimizer state in fp32 over a bf16 base
    for name in trained_modules:
        getattr(model, name).float().requires_grad_(True)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:  # (dist imports this module: not back)
        trained, total = trainable_parameter_count(model)
        print(f"--lora-rank {args.lora_rank}: training {trained:,} of {total:,} parameters ({100 * trained / total:.2f}%)")
    return model


def has_adapter(model) -> bool:
    return hasattr(model, "peft_config")


def adapter_layers(model) -> list:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapter_disabled(model):
    """Inside this block the model computes with its base weights only: every adapter layer returns W x."""
    layers = adapter_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # also makes the adapter's weights trainable again


class WithoutAdapter(torch.nn.Module):
    """The reference model under --lora-rank: the policy itself with its adapter switched off for each call, i.e. the
    frozen base weights, the same module and no second copy. It offers what common.py calls on a model: the forward
    pass, the output layer (without an adapter of its own, if --lora-target-modules gave it one) and the config."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, *args, **kwargs):
        with adapter_disabled(self.model):
            return self.model(*args, **kwargs)

    def get_output_embeddings(self):
        head = self.model.get_output_embeddings()
        return head.get_base_layer() if head is not None and hasattr(head, "get_base_layer") else head


@torch.no_grad()
def merged_weights(model) -> dict[str, torch.Tensor]:
    """The model's weights with the adapter merged, under the names of the model without it (what from_pretrained and
    an inference engine read): W + (alpha / r) B A for every adapted layer, in float32, the rest as they are. The model
    itself is left unchanged (save_merged is the one that merges in place)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            base = module.get_base_layer()
            delta = module.get_delta_weight("default").float()  # (alpha / r) B A, (out, in)
            weights[f"{name}.weight"] = base.weight.detach().float() + delta
            if base.bias is not None:
                weights[f"{name}.bias"] = base.bias.detach()
    for name, p in model.state_dict().items():
        if "lora_" not in name and ".base_layer." not in name:
            weights[name] = p.detach()
    return weights


def trainable_parameter_count(model) -> tuple[int, int]:
    """(trained, all) parameter counts; the base weights an adapter layer wraps are counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters())


def save_merged(model, tokenizer, path: str) -> None:
    """Write the adapter to PATH/adapter (peft's format: PeftModel.from_pretrained(base, PATH/adapter) loads it, with
    any module trained whole, e.g. the reward model's score head, as one of its modules_to_save), then merge it into the
    weights, W <- W + (alpha / r) B A, and save the model with save_pretrained in PATH. The merge is done on the CPU in
    float32 and the merged model saved in float32, whatever the base's dtype: a bf16 weight keeps 8 significant bits, so
    adding an update smaller than 2^-9 of the weight and rounding to bf16 would give the weight back unchanged. The
    model is moved and merged in place: call this once, at the end of the run."""
    from peft import get_peft_model_state_dict
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import save_file

    config = model.peft_config["default"]
    adapter = {f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    whole = {name: p for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name}
    adapter.update({f"base_model.model.{name}": p.detach().float().cpu().contiguous() for name, p in whole.items()})
    config.modules_to_save = sorted({name.rpartition(".")[0] for name in whole}) or None
    os.makedirs(os.path.join(path, "adapter"), exist_ok=True)
    config.base_model_name_or_path = getattr(model.config, "_name_or_path", None)
    config.save_pretrained(os.path.join(path, "adapter"))
    save_file(adapter, os.path.join(path, "adapter", "adapter_model.safetensors"))
    model.to(device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                module.merge()
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name), child, module.get_base_layer())
    del model.peft_config
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
