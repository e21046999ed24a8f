"""Plumbing shared by every script: seeding, device, several processes (torchrun: DDP, FSDP2), the built-in task and
its reward, the built-in tiny model, sampling, evaluation, preference pairs, reward-model scoring and metrics logging.
No advantage estimator and no loss lives here: those are in the scripts."""

import atexit
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import random
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from safetensors import SafetensorError

# ---------------------------------------------------------------------------------------------------------------------
# Seeding and device
# ---------------------------------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA


def get_device(name: str) -> torch.device:
    """The device of this process. Under torchrun it is this process's GPU (LOCAL_RANK) or the CPU, and the first call
    joins the run's process group (NCCL on GPUs, gloo on CPUs): see the section "Several processes" below."""
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine (use --device auto or cpu)")
    if name not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"--device {name!r}: allowed values are auto, cpu, cuda")
    device = torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")
    if world_size() > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return device


def autocast(device: torch.device):
    """bf16 autocast on a GPU that supports it (parameters and optimizer state stay fp32); nothing on CPU."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# ---------------------------------------------------------------------------------------------------------------------
# Several processes: torchrun, with DDP (replicated weights, averaged gradients) or FSDP2 (--fsdp: sharded weights)
# ---------------------------------------------------------------------------------------------------------------------
#
# Without torchrun every function here is the identity and the scripts run exactly as one process. Under
# `torchrun --nproc-per-node N`, each process (rank) generates its share of the step's prompts (whole groups),
# computes its loss on them, and the gradients are averaged over the ranks, so that an update equals one process's
# update on the union of the ranks' rollouts. The scripts see the plain model throughout: `distribute` keeps the DDP or
# FSDP2 module on the side, and the passes that must go through it (log-probs with a gradient; every pass under FSDP2)
# are routed there by `run`. Reductions that are global in the algorithm use `count_share` or `gather`; metrics are
# pooled over ranks by `aggregate` and `MetricsLogger`; rank 0 alone writes files.

_alone = False  # inside `alone()`: this process works by itself (rank 0 building a cache), without collectives


def world_size() -> int:
    """The number of processes of this run: torchrun's WORLD_SIZE, 1 without torchrun."""
    return 1 if _alone else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return 0 if _alone else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Whether this process writes files and prints (rank 0, or the only process)."""
    return rank() == 0


@contextmanager
def alone():
    """Rank 0 builds something once (the built-in warm-up, the preference pairs) while the other ranks wait in
    `barrier`: inside this block its functions run as a single process's would, without collectives."""
    global _alone
    _alone, before = True, _alone
    try:
        yield
    finally:
        _alone = before


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def wait_for(path: str) -> None:
    """The ranks other than 0 wait until rank 0 has built `path` (moved into place when complete), polling the file
    system rather than waiting in a collective, which would time out (after 10 minutes with NCCL) on a long build."""
    while not is_main() and not os.path.exists(path):
        time.sleep(2)
    barrier()


def _comm(x: torch.Tensor) -> torch.Tensor:
    """A copy of x on the device the process group communicates on (NCCL needs CUDA tensors)."""
    return x.to("cuda" if dist.get_backend() == "nccl" else "cpu", copy=True)


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The sum (or "min", "max") over ranks of x, on x's device; x itself without torchrun."""
    if world_size() == 1:
        return x
    y = _comm(torch.as_tensor(x))
    dist.all_reduce(y, {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return y.to(torch.as_tensor(x).device)


def rank_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of x. A loss normalised by rank_mean(count) instead of this rank's count becomes, once DDP or
    FSDP2 averages the gradients over ranks, the loss normalised by the count of the whole batch (a global token mean)."""
    return all_reduce(x) / world_size()


def count_share(count: torch.Tensor) -> torch.Tensor:
    """The normaliser of a mean over the whole batch (e.g. its valid tokens), as this rank's share: the count over all
    ranks, at least 1, divided by the number of ranks (in one process: max(count, 1)). A rank's sum divided by it,
    once DDP or FSDP2 averages the gradients over ranks, is the sum over all ranks divided by their total count."""
    return rank_mean(count).clamp(min=1 / world_size())


def everywhere(flag: bool) -> bool:
    """Whether flag holds on every rank (flag itself without torchrun): for decisions all ranks must take together."""
    return bool(all_reduce(torch.tensor(int(flag)), "min")) if world_size() > 1 else flag


def gather(x: torch.Tensor) -> torch.Tensor:
    """The 1-D tensors x of every rank (their lengths may differ), concatenated in rank order; x without torchrun."""
    if world_size() == 1:
        return x
    sizes = [_comm(torch.zeros(1, dtype=torch.long)) for _ in range(world_size())]
    dist.all_gather(sizes, _comm(torch.tensor([len(x)])))
    width = int(max(s.item() for s in sizes))
    padded = _comm(torch.cat([x.detach(), x.new_zeros(width - len(x))]))
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(pieces, sizes)]).to(x.device)


def shard(items):
    """This rank's contiguous share of a global list or tensor (the whole of it without torchrun): rank r gets the
    r-th of world_size() equal parts. The length must be a multiple of world_size() (checked with the flags)."""
    size = len(items) // world_size()
    return items[rank() * size : (rank() + 1) * size]


def check_divisible(args, flag: str) -> None:
    """Under torchrun, --FLAG (a global count: prompts, pairs) must split evenly over the processes."""
    value = getattr(args, flag)
    if value % world_size():
        raise SystemExit(
            f"--{flag.replace('_', '-')} {value}: must split evenly over the {world_size()} processes of this torchrun "
            f"(it is the count of the whole step, shared out between the processes)"
        )


def check_distributed_args(args) -> None:
    if getattr(args, "fsdp", False) and world_size() == 1:
        raise SystemExit("--fsdp: shards the model over the processes of torchrun; run under torchrun --nproc-per-node N")


class _Root(torch.nn.Module):
    """What DDP or FSDP2 wraps: a module whose forward runs fn(model, ...). Whatever a script computes with the model
    (log-probs in chunks, a generation step, values) thus runs inside the wrapper's forward and gets its hooks (DDP's
    gradient averaging, FSDP2's gathering of the weights that the layers do not own), while the script keeps the plain
    model for `generate`, `evaluate` and saving."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def distribute(args, *models):
    """Under torchrun, wrap each model for training over several processes; returns the models to use instead (the
    same objects, except a plain nn.Module under DDP, which comes back as its DDP module); the identity without
    torchrun. Without --fsdp (DDP) a trained model is replicated and its gradients averaged; a frozen one (the
    reference) is left alone. With --fsdp every model is sharded with FSDP2: each transformer layer is its own unit
    (the model's `_no_split_modules`) and the rest of the model (embeddings, final norm, output layer) one root unit;
    the optimizer must be created afterwards, on the sharded parameters. Then sampling is seeded per rank
    (--seed + rank), so that the ranks do not generate the same responses from the same prompts."""
    if world_size() == 1:
        return models
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as shard_on
    from torch.nn.parallel import DistributedDataParallel

    device, fsdp = next(p.device for m in models if m is not None for p in m.parameters()), getattr(args, "fsdp", False)
    if fsdp:  # one mesh over every rank, on this run's device (not the machine's accelerator)
        mesh = init_device_mesh(device.type, (world_size(),))
        fully_shard = lambda module: shard_on(module, mesh=mesh)  # noqa: E731
        # our outputs (log-probs, values) are never changed in place, which FSDP2 warns about for views
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    ddp = lambda module: DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)  # noqa: E731
    out = []
    for model in models:
        is_lm = model is not None and hasattr(model, "generate")  # a transformers model: scripts call it directly
        if model is None or (not fsdp and not any(p.requires_grad for p in model.parameters())):
            out.append(model)  # nothing to do (a frozen model under DDP is simply loaded on every rank)
        elif not fsdp:
            if is_lm:
                model.__dict__["_distributed"] = ddp(_Root(model))  # in __dict__: not a submodule of the model
            out.append(model if is_lm else ddp(model))
        else:
            layer_types = {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or []}
            for module in model.modules():
                if type(module).__name__ in layer_types:
                    fully_shard(module)
            if is_lm:
                model.__dict__["_distributed"] = fully_shard(_Root(model))
            else:
                fully_shard(model)
            out.append(model)
    torch.manual_seed(args.seed + rank())  # sampling differs between ranks; the weights were made identical above
    return tuple(out)


def _is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or isinstance(model.__dict__.get("_distributed"), FSDPModule)


def run(model, fn: Callable, *args, **kwargs):
    """fn(model, *args, **kwargs), inside the model's DDP or FSDP2 wrapper when it needs one: DDP for a pass with a
    gradient (so that the backward pass averages the gradients), FSDP2 for every pass (it gathers the weights)."""
    wrapper = model.__dict__.get("_distributed")
    if wrapper is None or not (torch.is_grad_enabled() or _is_sharded(model)):
        return fn(model, *args, **kwargs)
    return wrapper(fn, *args, **kwargs)


def _call(model, *args, **kwargs):
    return model(*args, **kwargs)


def local(x):
    """A full plain tensor from x: an FSDP2 DTensor is gathered (every rank must call this), anything else is x."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def save_model(model, tokenizer, path: str) -> None:
    """save_pretrained of the model and its tokenizer, by rank 0; under FSDP2 the shards are gathered first, so that
    the folder loads with from_pretrained exactly like a single process's."""
    state = {k: local(v) for k, v in model.state_dict().items()} if _is_sharded(model) else None
    if is_main():
        model.save_pretrained(path, state_dict=state)
        tokenizer.save_pretrained(path)
    barrier()


# ---------------------------------------------------------------------------------------------------------------------
# Tasks: a prompt, a reference answer, and a verifier that scores a completion 1 (correct) or 0
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Task:
    name: str
    train: "datasets.Dataset"  # noqa: F821  columns: prompt, answer (and solution: what the warm-up imitates)
    eval: "datasets.Dataset"  # noqa: F821  fixed held-out split, never trained on
    extract_answer: Callable[[str], str | None]  # completion text -> the final answer it states (or None)
    max_new_tokens: int = 256  # the generation budget a script uses unless --max-new-tokens says otherwise
    instruction: str = ""  # the answer format, told to a chat model as its system message (default: INSTRUCTIONS[name])
    chat: bool = False  # whether the prompts were rendered with a chat template (apply_chat_template)

    def reward(self, completions: list[str], answers: list[str]) -> torch.Tensor:
        """1.0 for a correct final answer, 0.0 otherwise. A truncated completion is scored like any other."""
        return torch.tensor([float(self.extract_answer(c) == a) for c, a in zip(completions, answers)])


def split_by_key(dataset, num_held_out: int, key: Callable[[dict], object], seed: int):
    """Split `dataset` into (rest, held_out) so that rows with the same key are never on both sides: whole key groups
    go to the held-out side, in a shuffled order fixed by `seed`, while they fit into `num_held_out` rows. The key
    names what must not leak: for addition the unordered pair of operands, so that "45+07=" is never trained on when
    "07+45=" (same answer) is held out."""
    groups = {}
    for i, row in enumerate(dataset.to_list()):
        groups.setdefault(key(row), []).append(i)
    order = list(groups.values())
    random.Random(seed).shuffle(order)
    held_out = []
    for rows in order:
        if len(held_out) + len(rows) <= num_held_out:
            held_out += rows
    held = set(held_out)
    return dataset.select([i for i in range(len(dataset)) if i not in held]), dataset.select(sorted(held_out))


def addition_operands(row: dict) -> tuple[int, int]:
    """The unordered pair {a, b} of an addition prompt "aa+bb=": a problem and its commuted twin share it."""
    a, b = row["prompt"].rstrip("=").split("+")
    return tuple(sorted((int(a), int(b))))


def _addition_answer(completion: str) -> str | None:
    return completion.strip() or None


def make_addition_task(num_eval: int = 500) -> Task:
    """The built-in task: two-digit addition "07+45=", answered by the digits of the sum in reverse order, then EOS.

    The sum is written least-significant digit first (52 -> "25", 125 -> "521"), as in Lee et al. 2023, "Teaching
    Arithmetic to Small Transformers", and the operands are zero-padded to two digits: each answer digit then depends
    on two aligned input digits and one carry, which a 1M-parameter model learns in about a minute on a CPU. Sums
    without carries are easy and sums with two carries are hard, so a group of responses can be all correct, all
    wrong, or mixed. The held-out split is fixed (its own seed) and split by the unordered pair of operands: neither
    a held-out problem nor its commuted twin is ever trained on."""
    import datasets

    problems = [(a, b) for a in range(100) for b in range(100)]
    answers = [str(a + b)[::-1] for a, b in problems]
    prompts = [f"{a:02d}+{b:02d}=" for a, b in problems]
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "answer": answers, "solution": answers})
    train, held_out = split_by_key(dataset, num_eval, addition_operands, seed=1234)
    return Task(name="addition", train=train, eval=held_out, extract_answer=_addition_answer, max_new_tokens=8)


def scratchpad_solution(a: int, b: int, digits: int = 3) -> str:
    """The worked solution of a + b, one column at a time from the least significant digit, the carry written out,
    then the sum after a lone "=": 482 + 396 gives "2+6=8 8+9=17 4+3+1=8 =878"."""
    columns, carry = [], 0
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        columns.append(f"{x}+{y}{'+1' if carry else ''}={x + y + carry}")
        carry = (x + y + carry) // 10
    return " ".join(columns) + f" ={a + b}"


def _scratchpad_answer(completion: str) -> str | None:
    """The number after the last lone "=" (one that starts a word): the final answer, whatever the working says."""
    answers = re.findall(r"(?:^|\s)=(\d+)", completion)
    return answers[-1] if answers else None


def make_scratchpad_task(num_eval: int = 500, num_problems: int = 20000) -> Task:
    """The built-in long-answer task: three-digit addition "482+396=" worked column by column with its carries
    ("2+6=8 8+9=17 4+3+1=8 =878", then EOS; see scratchpad_solution), rewarded on the final answer alone. A correct
    response is 21 to 31 tokens long (with EOS) and its length depends on the carries; a model that loses its way can ramble
    until --max-new-tokens (64 by default, twice the longest correct answer). `num_problems` distinct problems are
    drawn (fixed seed) from the million, and the held-out split is split by the unordered pair of operands."""
    import datasets

    rng = random.Random(4321)
    problems = list(dict.fromkeys((rng.randrange(1000), rng.randrange(1000)) for _ in range(2 * num_problems)))[:num_problems]
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [f"{a:03d}+{b:03d}=" for a, b in problems],
            "answer": [str(a + b) for a, b in problems],
            "solution": [scratchpad_solution(a, b) for a, b in problems],
        }
    )
    train, held_out = split_by_key(dataset, num_eval, addition_operands, seed=1234)
    return Task("scratchpad", train, held_out, _scratchpad_answer, max_new_tokens=64)


def _gsm8k_answer(completion: str) -> str | None:
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", completion)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def make_gsm8k_task(num_eval: int = 500) -> Task:
    """GSM8K from the Hugging Face hub (needs internet once): the last number in the completion must equal the answer."""
    import datasets

    def convert(split):
        try:
            with offline_unless_hub_reachable():
                ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
        except OSError as e:  # offline without a cached copy: ConnectionError, or DatasetNotFoundError in offline mode
            raise SystemExit(
                f"--task gsm8k: openai/gsm8k is not in the local datasets cache and the hub cannot be reached "
                f"({type(e).__name__}); run once with internet, or use --task addition (built in)"
            ) from None
        return ds.map(
            lambda x: {"prompt": f"Question: {x['question']}\nAnswer:", "answer": x["answer"].split("####")[-1].strip()},
            remove_columns=ds.column_names,
        )

    return Task("gsm8k", convert("train"), convert("test").select(range(num_eval)), _gsm8k_answer)


TASKS: dict[str, Callable[[], Task]] = {
    "addition": make_addition_task,
    "scratchpad": make_scratchpad_task,
    "gsm8k": make_gsm8k_task,
}
BUILTIN_TASKS = ("addition", "scratchpad")  # the tasks the built-in model can be warmed up on


# Each task's verifier and generation budget, for a user's data scored like the task (--dataset), and the system
# message a chat model gets: the answer format, which is all the verifier reads.
VERIFIERS = {"addition": (_addition_answer, 8), "scratchpad": (_scratchpad_answer, 64), "gsm8k": (_gsm8k_answer, 256)}
INSTRUCTIONS = {
    "addition": "Add the two numbers. Reply with the digits of the sum in reverse order, ones digit first, and nothing else.",
    "scratchpad": "Add the two numbers column by column from the ones digit, like 2+6=8 8+9=17 4+3+1=8, then = and the sum.",
    "gsm8k": "Solve the problem step by step. End your reply with the final answer as a plain number.",
}


def make_task(name: str, dataset: str = "", num_eval: int = 500) -> Task:
    """The task called `name` (checked by check_common_args before anything expensive). With `dataset` (--dataset), a
    user's prompt / answer rows replace its data and are scored by its verifier; `num_eval` of them (at most half) are
    held out for evaluation, split by prompt, so that no prompt is both trained on and evaluated."""
    if not dataset:
        return TASKS[name]()
    import datasets

    rows = load_data_set(dataset, "--dataset", ("prompt", "answer"))
    rows = datasets.Dataset.from_dict(
        {"prompt": [str(p) for p in rows["prompt"]], "answer": [str(a).strip() for a in rows["answer"]]}
    )
    if len(set(rows["prompt"])) < 2:
        raise SystemExit(f"--dataset {dataset!r}: needs at least two distinct prompts (one to train on, one held out)")
    train, held_out = split_by_key(rows, min(num_eval, len(rows) // 2), lambda row: row["prompt"], seed=1234)
    if name in VERIFIERS:
        extract_answer, max_new_tokens = VERIFIERS[name]
    else:  # a task of your own: its verifier and budget, from the task itself
        own = TASKS[name]()
        extract_answer, max_new_tokens = own.extract_answer, own.max_new_tokens
    return Task(name, train, held_out, extract_answer, max_new_tokens)


def load_data_set(path: str, flag: str, columns: tuple[str, ...]):
    """A data set a user names with `flag`: a .json, .jsonl, .csv or .parquet file, a folder saved with `save_to_disk`,
    or a hub id, with `columns`. Anything else is refused in one line naming the flag, before any model is loaded."""
    import datasets

    builders = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    extension = os.path.splitext(path)[1].lower()
    if os.path.isfile(path) and extension not in builders:
        raise SystemExit(
            f"{flag} {path!r}: cannot read {extension or 'this'} files; give .json, .jsonl, .csv, .parquet or a folder"
        )
    try:
        if os.path.isdir(path):
            ds = datasets.load_from_disk(path)
            ds = ds["train"] if isinstance(ds, datasets.DatasetDict) and "train" in ds else ds
        elif os.path.isfile(path):
            ds = datasets.load_dataset(builders[extension], data_files=path, split="train")
        else:
            with offline_unless_hub_reachable():
                ds = datasets.load_dataset(path, split="train")
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as e:  # unreadable, or a hub id out of reach
        raise SystemExit(f"{flag} {path!r}: cannot be loaded ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(ds, datasets.Dataset):
        raise SystemExit(f"{flag} {path!r}: holds several splits and none is called train")
    missing = set(columns) - set(ds.column_names)
    if missing:
        raise SystemExit(
            f"{flag} {path!r}: missing column(s) {', '.join(sorted(missing))} (it has {', '.join(ds.column_names)})"
        )
    return ds


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


def apply_chat_template(task: Task, tokenizer, mode: str) -> Task:
    """--chat-template: with 'auto' (when the tokenizer has a chat template) or 'on', every prompt is rendered as a
    conversation, the task's answer format as the system message (INSTRUCTIONS), the prompt as the user turn, then the
    generation prompt; with 'none' (or 'auto' and no template, as for base models) the prompts stay plain text. A
    template that refuses a system role gets the instruction at the head of the user turn instead."""
    if mode == "none" or (mode == "auto" and not tokenizer.chat_template):
        return task
    if not tokenizer.chat_template:
        raise SystemExit("--chat-template on: the model's tokenizer has no chat template (use auto or none)")
    from jinja2.exceptions import TemplateError

    instruction = task.instruction or INSTRUCTIONS.get(task.name, "")

    def render(prompt: str) -> str:
        turns = [{"role": "system", "content": instruction}] if instruction else []
        turns.append({"role": "user", "content": prompt})
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except TemplateError:  # e.g. no system role: the instruction opens the user turn
            turns = [{"role": "user", "content": f"{instruction}\n\n{prompt}".strip()}]
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)

    rendered = lambda ds: ds.map(lambda row: {"prompt": render(row["prompt"])})  # noqa: E731
    return dataclasses.replace(task, train=rendered(task.train), eval=rendered(task.eval), chat=True)


# ---------------------------------------------------------------------------------------------------------------------
# The built-in tiny model: a Llama-architecture causal LM with a character-level tokenizer, saved as an ordinary
# Hugging Face model so that it loads through AutoModelForCausalLM / AutoTokenizer exactly like a hub model.
# ---------------------------------------------------------------------------------------------------------------------

CHARS = "0123456789+-*= "


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_tiny_model(tokenizer, max_positions: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def cache_root(cache_dir: str = "") -> str:
    """--cache-dir, else $TINY_RLHF_CACHE, else ~/.cache/tiny-rlhf."""
    return cache_dir or os.environ.get("TINY_RLHF_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tiny-rlhf"))


@functools.cache  # once per process, so that editing the sources during a run cannot change the answer
def builtin_model_dir(cache_dir: str, task: str = "addition") -> str:
    """Where the built-in model warmed up on `task` is cached. The folder name carries a hash of the warm-up recipe
    (sft.py, its settings for the task, and the code that builds the task, tokenizer and model), so that changing it
    trains a new model instead of silently reusing a stale one."""
    import inspect

    import sft

    recipe_parts = (
        sft.Args,
        sft.encode,
        sft.greedy_accuracy,
        sft.warm_up,
        TASKS[task],
        split_by_key,
        addition_operands,
        build_tokenizer,
        build_tiny_model,
        tokenize_prompts,
        generate,
        evaluate,
    )
    sources = [inspect.getsource(f) for f in recipe_parts]
    if task == "scratchpad":
        sources.append(inspect.getsource(scratchpad_solution))
    recipe = json.dumps(vars(sft.task_args(task)), sort_keys=True) + "".join(sources)
    return os.path.join(cache_root(cache_dir), f"builtin-{task}-{hashlib.sha1(recipe.encode()).hexdigest()[:10]}")


def looks_like_hub_id(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is not None and ".." not in name


def check_model_path(name: str) -> None:
    """Fail fast on a model path that cannot exist, before any expensive work."""
    if name != "builtin" and not os.path.isdir(name) and (not looks_like_hub_id(name) or os.path.exists(name)):
        raise SystemExit(f"--model-name-or-path {name!r}: no such directory, and not a hub id like 'Qwen/Qwen2.5-0.5B'")
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise SystemExit(f"--model-name-or-path {name!r}: no config.json in this folder (save a model with save_pretrained)")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if os.path.isdir(name) and not any(os.path.isfile(os.path.join(name, f)) for f in tokenizer_files):
        raise SystemExit(f"--model-name-or-path {name!r}: no tokenizer in this folder (save it too, with save_pretrained)")


def resolve_model_path(name: str, cache_dir: str, task: str = "addition") -> str:
    """'builtin' means the tiny model after its supervised warm-up on the built-in `task` (sft.py), trained the first
    time it is needed and cached on disk: return its folder. Anything else is returned as it is, for from_pretrained."""
    check_model_path(name)
    if name != "builtin":
        return name
    path = builtin_model_dir(cache_dir, task)
    # under torchrun rank 0 warms up (alone) while the others wait: every rank must take the same decision
    missing = not everywhere(os.path.isfile(os.path.join(path, "config.json")))
    if missing:
        if is_main():
            import sft

            print(f"Warming up the built-in model once (supervised, cached in {path}) ...")
            with alone():
                sft.warm_up(dataclasses.replace(sft.task_args(task), output_dir=path + ".partial"))
            os.replace(path + ".partial", path)  # only a finished warm-up ever sits at `path`
        wait_for(os.path.join(path, "config.json"))
    return path


def load_model_and_tokenizer(name: str, cache_dir: str, device: torch.device, task: str = "addition", auto_class=None, **kw):
    """Load a causal LM and its tokenizer, through AutoModelForCausalLM and AutoTokenizer, for the built-in model
    (warmed up on `task`) and for a hub model alike. `auto_class` loads another head on the same body, e.g.
    AutoModelForSequenceClassification with num_labels=1 (passed on in `kw`) for a reward model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name, cache_dir, task)
    auto_class = auto_class or AutoModelForCausalLM
    load = lambda **local: (  # noqa: E731
        AutoTokenizer.from_pretrained(path, padding_side="left", **local),
        auto_class.from_pretrained(path, dtype=torch.float32, **kw, **local),
    )
    try:
        tokenizer, model = load_local_first(load, path)
    except LOAD_ERRORS as e:
        raise SystemExit(load_error_message(name, path, e)) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe here: masks are built from the first EOS, not from pad
    return model.to(device), tokenizer


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
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def load_local_first(load: Callable, path: str):
    """load(**kwargs) of a `from_pretrained` call. A folder loads as it is; a hub id loads from the local Hugging Face
    cache first, so that a cached model loads offline at once, and from the hub only if it is not cached there."""
    if os.path.isdir(path):
        return load()
    try:
        return load(local_files_only=True)
    except OSError:
        if reason := hub_unreachable():
            raise SystemExit(
                f"--model-name-or-path {path!r}: not in the local Hugging Face cache, and the hub cannot be reached "
                f"({reason}). Without internet, pass a local folder saved with save_pretrained"
            ) from None
        return load()


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached, or None when it accepts a connection. One TCP connection with a short
    timeout, so that an offline machine is told so at once rather than after the hub client's minute of retries. With
    HF_HUB_OFFLINE set the answer says so; behind a proxy we cannot probe, so we let the hub client try."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout).close()
    except OSError as e:
        return f"{url.hostname}: {e.strerror or type(e).__name__}"
    return None


@contextmanager
def offline_unless_hub_reachable():
    """Load data sets in offline mode (the local cache only, at once) when the hub cannot be reached: a cached data set
    then loads without a minute of retries, and a missing one fails at once."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = saved or hub_unreachable() is not None
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


# What loading raises for a folder or hub id without a loadable model: missing files, an unreachable hub and unknown
# repositories (OSError), a tokenizer that cannot be built (ValueError, ImportError), damaged weights (SafetensorError).
LOAD_ERRORS = (OSError, ValueError, ImportError, SafetensorError)


def load_error_message(name: str, path: str, error: Exception) -> str:
    """One line that names the flag (or the cache folder) and the likely fix."""
    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]
    if name == "builtin":
        return (
            f"the cached built-in model in {path} cannot be loaded ({reason}); delete that folder and run again to rebuild it"
        )
    if os.path.isdir(path):
        return f"--model-name-or-path {name!r}: cannot load a model and its tokenizer from this folder ({reason})"
    return (
        f"--model-name-or-path {name!r}: not in the local Hugging Face cache, and downloading it failed ({reason}). "
        "Without internet, pass a local folder saved with save_pretrained"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Sampling and scoring sequences
# ---------------------------------------------------------------------------------------------------------------------


def tokenize_prompts(tokenizer, prompts: list[str], device: torch.device):
    """Left-padded prompt ids (B, P) and attention mask (B, P): every prompt ends in the last column."""
    enc = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and those of the model's generation config (chat models
    often have several, e.g. an end-of-turn token besides end-of-text)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
    return sorted({i for i in (tokenizer.eos_token_id, *ids) if i is not None})


def completion_mask(completion_ids: torch.Tensor, eos_ids) -> torch.Tensor:
    """(B, T) mask of valid completion tokens: every generated token up to and including the first EOS, nothing after.
    Built from EOS alone, so it stays right when a tokenizer uses the same id for padding and EOS."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_ids, device=completion_ids.device)).int()
    return (is_eos.cumsum(dim=1) - is_eos) == 0


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float):
    """Sample completions token by token with a KV cache. temperature > 0 samples from softmax(logits / temperature)
    with no top-k or top-p, so that the behaviour policy is exactly the one whose log-probs the scripts compute;
    temperature == 0 is greedy. Returns completion ids (B, T) (pad after the first EOS), mask (B, T), truncated (B,).
    Under FSDP2 every rank runs the same number of forward passes (each gathers weights from all ranks): a rank stops
    only when the responses of every rank have ended."""
    folder = os.environ.get("TINY_RLHF_ROLLOUTS")
    if folder and temperature > 0:
        args = (model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature)
        return _record_or_replay(folder, tokenizer.pad_token_id, prompt_ids, prompt_mask, lambda: _generate(*args))
    return _generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature)


def _generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float):
    from transformers import DynamicCache

    eos_ids, pad_token_id = torch.tensor(eos_token_ids(model, tokenizer), device=prompt_ids.device), tokenizer.pad_token_id
    if not prompt_mask[:, -1].all():
        raise ValueError("generate needs left-padded prompts (see tokenize_prompts)")
    batch_size = prompt_ids.shape[0]
    input_ids, attention_mask = prompt_ids, prompt_mask
    position_ids = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    cache, done, tokens = DynamicCache(), torch.zeros(batch_size, dtype=torch.bool, device=prompt_ids.device), []
    for _ in range(max_new_tokens):
        with autocast(prompt_ids.device):
            kw = {"attention_mask": attention_mask, "position_ids": position_ids, "cache": cache, "logits_to_keep": 1}
            out = run(model, _call, input_ids, **kw)
        logits = out.logits[:, -1, :].float()  # (B, V)
        probs = torch.softmax(logits / temperature, dim=-1) if temperature > 0 else None
        if not torch.isfinite(logits).all() or (probs is not None and not torch.isfinite(probs).all()):
            raise SystemExit("non-finite logits while sampling: the model diverged, or --temperature is too small")
        next_token = torch.multinomial(probs, num_samples=1).squeeze(1) if temperature > 0 else logits.argmax(dim=-1)
        next_token = next_token.masked_fill(done, pad_token_id)  # (B,)
        tokens.append(next_token)
        done = done | torch.isin(next_token, eos_ids)
        if all_reduce(done.all().long(), "min") if _is_sharded(model) else done.all():
            break
        input_ids = next_token[:, None]
        attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=1)
        position_ids = position_ids[:, -1:] + 1
    completion_ids = torch.stack(tokens, dim=1)  # (B, T)
    truncated = ~torch.isin(completion_ids, eos_ids).any(dim=1)  # hit max_new_tokens without an EOS
    return completion_ids, completion_mask(completion_ids, eos_ids), truncated


_rollout_calls = Counter()  # sampled generate calls so far, per TINY_RLHF_ROLLOUTS folder


def _record_or_replay(folder: str, pad_token_id: int, prompt_ids, prompt_mask, sample: Callable):
    """TINY_RLHF_ROLLOUTS=FOLDER, for the tests of several processes and for debugging: the n-th sampled `generate` of
    rank r is saved to FOLDER/n-rank{r}.pt, or read back from there if that file exists (the same rollouts again, e.g.
    under FSDP2 after DDP). A single process finding the files of a run of several processes replays the union of the
    ranks' rollouts, in rank order, for exactly the same prompts: then its update should equal theirs."""
    call = _rollout_calls[folder]
    _rollout_calls[folder] += 1
    prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
    files = sorted(f for f in os.listdir(folder) if f.startswith(f"{call:04d}-rank")) if os.path.isdir(folder) else []
    mine = os.path.join(folder, f"{call:04d}-rank{rank()}.pt")
    if world_size() == 1 and len(files) > 1:
        saved = [torch.load(os.path.join(folder, f"{call:04d}-rank{r}.pt")) for r in range(len(files))]
    elif os.path.isfile(mine):
        saved = [torch.load(mine)]
    else:
        completion_ids, mask, truncated = sample()
        os.makedirs(folder, exist_ok=True)
        torch.save({"prompts": prompts, "rollout": [completion_ids.cpu(), mask.cpu(), truncated.cpu()]}, mine)
        return completion_ids, mask, truncated
    if [p for s in saved for p in s["prompts"]] != prompts:
        raise ValueError(f"TINY_RLHF_ROLLOUTS: the rollouts saved in {folder} (call {call}) are for other prompts")
    pads = (pad_token_id, False, False)
    return tuple(cat_padded([s["rollout"][i] for s in saved], pad).to(prompt_ids.device) for i, pad in enumerate(pads))


# Entries of the (positions, vocabulary) logits computed at once: 2^24 floats, 64 MB in fp32 (110 positions at Qwen2.5's
# vocabulary of 151,936, the whole batch at the built-in model's 18 tokens).
LOGITS_CHUNK = 2**24

# Config fields of models that transform their logits after the output layer (Gemma 2's softcapping, Cohere's and
# Granite's scaling): completion_logprobs then uses the model's own forward, which holds the pass's whole logits.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def completion_logprobs(model, input_ids, attention_mask, completion_len: int, temperature: float, entropy_grad=False):
    """log pi(y_t | x, y_<t) of each of the last `completion_len` tokens of `input_ids`, computed from logits / temperature
    so that they are the log-probs of the distribution the tokens were sampled from. Returns logprobs (B, T) and the
    entropy of each of those next-token distributions (B, T; with a gradient only if `entropy_grad`). Positions run
    from each row's first real token, exactly as in `generate`.

    Memory: the logits of the whole pass, (B, T, V) in fp32, would be the largest tensor of a step at a real vocabulary,
    and a plain log_softmax and entropy hold several copies of them. They are never materialised here: the body's last
    hidden states at the completion positions go through the output layer LOGITS_CHUNK // V positions at a time. Without
    a gradient each chunk is freed before the next; with one, each chunk is recomputed in the backward pass instead of
    being kept (activation checkpointing of the output layer: one more pass through it). Either way one chunk's logits
    and their softmax temporaries are alive at a time, whatever B, T and V.

    Under torchrun the pass runs inside the model's DDP or FSDP2 wrapper (see `run`)."""
    args = (input_ids, attention_mask, completion_len, temperature, entropy_grad)
    return run(model, _completion_logprobs, *args)


def _completion_logprobs(model, input_ids, attention_mask, completion_len: int, temperature: float, entropy_grad: bool):
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    targets = input_ids[:, -completion_len:]  # (B, T)
    head = model.get_output_embeddings()
    if head is None or any(getattr(model.config, name, None) for name in LOGIT_TRANSFORMS):  # its own forward: whole logits
        with autocast(input_ids.device):
            out = model(
                input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=completion_len + 1,
                use_cache=False,
            )
        logprobs, entropy = head_logprobs(None, out.logits[:, :-1], targets, temperature)
    else:
        with autocast(input_ids.device):
            body = getattr(model, model.base_model_prefix)
            hidden = body(
                input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        hidden = hidden[:, -completion_len - 1 : -1].reshape(-1, hidden.shape[-1])  # (B T, H): t predicts token t
        size = max(1, LOGITS_CHUNK // head.weight.shape[0])  # positions per chunk
        pieces = []
        for h, y in zip(hidden.split(size), targets.reshape(-1).split(size)):
            if torch.is_grad_enabled():
                pieces.append(torch.utils.checkpoint.checkpoint(head_logprobs, head, h, y, temperature, use_reentrant=False))
            else:
                pieces.append(head_logprobs(head, h, y, temperature))
        logprobs, entropy = (torch.cat(x).view_as(targets) for x in zip(*pieces))
    return logprobs, entropy if entropy_grad and torch.is_grad_enabled() else entropy.detach()


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log softmax(logits / temperature) at `targets`, and the entropy of that distribution, for positions whose
    hidden states are `hidden` (..., H) through the output layer `head` (or whose logits are `hidden`, with head None).
    Returns two tensors shaped like `targets`."""
    if head is not None:
        with autocast(hidden.device):
            hidden = head(hidden)
    all_logprobs = torch.log_softmax(hidden.float() / temperature, dim=-1)  # (..., V)
    entropy = -(all_logprobs.exp() * all_logprobs).sum(dim=-1)
    return all_logprobs.gather(-1, targets[..., None]).squeeze(-1), entropy


@torch.no_grad()
def frozen_logprobs(model, input_ids, attention_mask, completion_len: int, temperature: float, chunk_size: int):
    """completion_logprobs without gradient, `chunk_size` rows at a time (old and reference log-probs)."""
    chunks = zip(input_ids.split(chunk_size), attention_mask.split(chunk_size))
    return torch.cat([completion_logprobs(model, ids, mask, completion_len, temperature)[0] for ids, mask in chunks])


def cat_padded(tensors: list[torch.Tensor], value=0, left: bool = False) -> torch.Tensor:
    """Concatenate (B_i, L_i) tensors along the batch, padding each to the longest L_i on the right (or the left).
    1-D tensors are concatenated as they are."""
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    out = torch.full((sum(len(t) for t in tensors), width), value, dtype=tensors[0].dtype, device=tensors[0].device)
    row = 0
    for t in tensors:
        columns = slice(width - t.shape[1], width) if left else slice(0, t.shape[1])
        out[row : row + len(t), columns] = t
        row += len(t)
    return out


def decode(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor) -> list[str]:
    """The text of each completion: its valid tokens without the final EOS. Special tokens sampled inside an answer
    are kept (and make it wrong), rather than silently dropped."""
    lengths = (mask.sum(dim=1) - (~truncated).long()).tolist()  # drop the EOS of responses that ended
    return [tokenizer.decode(ids[:n], skip_special_tokens=False) for ids, n in zip(completion_ids.tolist(), lengths)]


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation and logging
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, tokenizer, task: Task, max_new_tokens: int, dataset=None, batch_size: int = 512, num_samples=4) -> dict:
    """Greedy accuracy on the task's fixed held-out split (or on `dataset`), with the mean response length and, under
    "samples", what the model said to the first `num_samples` problems (to read, beside the score)."""
    dataset = task.eval if dataset is None else dataset
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, lengths, samples = [], [], []
    rows = torch.arange(len(dataset)).tensor_split(world_size())[rank()]  # under torchrun: this rank's share
    num_batches = math.ceil(math.ceil(len(dataset) / world_size()) / batch_size)  # the same on every rank (FSDP2)
    for part in rows.split(batch_size) if world_size() == 1 else rows.tensor_split(num_batches):
        batch = dataset[part.tolist()]
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, batch["prompt"], device)
        ids, mask, truncated = generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature=0.0)
        texts = decode(tokenizer, ids, mask, truncated)
        correct.append(task.reward(texts, batch["answer"]))
        lengths.append(mask.sum(dim=1).float().cpu())
        for i in range(min(num_samples - len(samples), len(texts))):  # the first problems, the same at every evaluation
            fed = tokenizer.decode(prompt_ids[i][prompt_mask[i].bool()])  # the prompt as the model saw it
            samples.append(
                {"prompt": fed, "completion": texts[i], "answer": batch["answer"][i], "reward": correct[-1][i].item()}
            )
    model.train(was_training)
    correct, lengths = torch.cat(correct).float(), torch.cat(lengths)
    if world_size() > 1:  # every rank's problems: sums and counts over ranks
        total, length, count = all_reduce(torch.stack([correct.sum(), lengths.sum(), torch.tensor(len(correct))]).double())
        correct, lengths = (total / count).view(1), (length / count).view(1)
    return {
        "eval/accuracy": correct.mean().item(),
        "eval/response_length": lengths.mean().item(),
        "samples": samples,  # MetricsLogger writes these to samples.jsonl, not to metrics.jsonl
    }


def lengths_by_outcome(lengths: torch.Tensor, scores: torch.Tensor) -> dict:
    """Mean length in tokens of the correct responses (verifier score 1) and of the wrong ones, each logged only when
    the batch has one: whether wrong answers grow longer than right ones is what Dr. GRPO's length fix is about."""
    picks = {"rollout/response_length_correct": scores == 1, "rollout/response_length_wrong": scores != 1}
    return {name: lengths[pick].float() for name, pick in picks.items() if pick.any()}  # samples: MetricsLogger averages


# ---------------------------------------------------------------------------------------------------------------------
# Preference pairs (dpo.py, reward_model.py) and learned reward models (--reward-model)
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def build_verifier_pairs(policy, tokenizer, task: Task, args, device: torch.device):
    """Pairs (prompt, chosen, rejected) from the policy's own answers, judged by the task's verifier: each of
    args.num_pair_prompts training problems is answered args.group_size times at temperature 1, and the most frequent
    correct answer is paired with the most frequent wrong one (problems without both are skipped and counted).
    Returns (datasets.Dataset, skipped)."""
    import datasets
    from tqdm import tqdm

    rng = random.Random(0)  # the same pairs for every seed
    prompts_all = task.train[rng.sample(range(len(task.train)), min(args.num_pair_prompts, len(task.train)))]
    pairs, skipped = {"prompt": [], "chosen": [], "rejected": []}, 0
    for start in tqdm(range(0, len(prompts_all["prompt"]), 64), desc="building pairs"):
        prompts, answers = prompts_all["prompt"][start : start + 64], prompts_all["answer"][start : start + 64]
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [p for p in prompts for _ in range(args.group_size)], device)
        completion_ids, mask, truncated = generate(policy, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, 1.0)
        texts = decode(tokenizer, completion_ids, mask, truncated)
        correct = task.reward(texts, [a for a in answers for _ in range(args.group_size)])  # (B,)
        ended = ~truncated  # only answers that ended with EOS
        for i, prompt in enumerate(prompts):
            group = range(i * args.group_size, (i + 1) * args.group_size)
            good = Counter(texts[j] for j in group if correct[j] == 1 and ended[j])
            bad = Counter(texts[j] for j in group if correct[j] == 0 and ended[j])
            if not good or not bad:
                skipped += 1
                continue
            # the most frequent correct and wrong answers: the policy's likeliest success against its likeliest mistake
            pairs["prompt"].append(prompt)
            pairs["chosen"].append(good.most_common(1)[0][0])
            pairs["rejected"].append(bad.most_common(1)[0][0])
    return datasets.Dataset.from_dict(pairs), skipped


def verifier_pairs(args, task: Task, load_policy: Callable, device: torch.device):
    """The built-in preference pairs of args.model_name_or_path on args.task (build_verifier_pairs), built the first
    time and cached, so that dpo.py and reward_model.py train on the same pairs and build them once. `load_policy()`
    returns (policy, tokenizer) and is called only when the pairs must be built. Returns (pairs, skipped, seconds
    spent building them: 0 from the cache)."""
    import datasets

    model_path = resolve_model_path(args.model_name_or_path, args.cache_dir, args.task)
    recipe = ["most-frequent-v1", os.path.abspath(model_path), args.task, args.num_pair_prompts, args.group_size]
    recipe += [args.max_new_tokens] + ([task.train[0]["prompt"]] if task.chat else [])  # prompts rendered how
    key = hashlib.sha1(json.dumps(recipe).encode()).hexdigest()[:10]
    pairs_dir = os.path.join(cache_root(args.cache_dir), f"dpo-pairs-{key}")
    # under torchrun rank 0 builds them (alone) while the others wait: every rank must take the same decision
    missing, start = not everywhere(os.path.isdir(pairs_dir)), time.time()
    if missing and is_main():
        policy, tokenizer = load_policy()
        with torch.random.fork_rng(devices=[]), alone():  # the same pairs whatever --seed is: they are cached for all
            torch.manual_seed(0)
            pairs, skipped = build_verifier_pairs(policy, tokenizer, task, args, device)
        pairs.save_to_disk(pairs_dir + ".partial")
        with open(os.path.join(pairs_dir + ".partial", "skipped.json"), "w") as f:
            json.dump(skipped, f)
        os.replace(pairs_dir + ".partial", pairs_dir)  # only complete pairs ever sit at pairs_dir
    wait_for(pairs_dir)
    with open(os.path.join(pairs_dir, "skipped.json")) as f:
        skipped = json.load(f)
    return datasets.load_from_disk(pairs_dir), skipped, time.time() - start if missing else 0.0


def load_preference_dataset(path: str):
    """--dataset of preference pairs (dpo.py, reward_model.py): like load_data_set, with prompt, chosen and rejected
    columns. The prompts are used as given (render them with your chat template yourself)."""
    return load_data_set(path, "--dataset", ("prompt", "chosen", "rejected"))


def tokenize_pairs(tokenizer, pairs, device: torch.device) -> dict:
    """Left-padded prompts and right-padded chosen / rejected completions, each followed by EOS: a dict of (N, L)
    tensors prompt_ids, prompt_mask, chosen_ids, chosen_mask, rejected_ids, rejected_mask."""
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, pairs["prompt"], device)
    data = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
    for key in ("chosen", "rejected"):
        ids = [tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for text in pairs[key]]
        width = max(len(i) for i in ids)
        data[f"{key}_ids"] = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids], device=device)
        data[f"{key}_mask"] = torch.tensor([[True] * len(i) + [False] * (width - len(i)) for i in ids], device=device)
    return data


def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A reward model's score R(x, y) of each row (B,): its scalar head on the last layer's hidden state at the row's
    last real token (the EOS of a finished response, the last token of a truncated one). input_ids, attention_mask:
    (B, L) with the prompt left-padded and the completion right-padded, positions as in `generate`. We pick that token
    from the attention mask ourselves: the model's own pooling looks for pad_token_id, which would skip an EOS that
    doubles as the pad token."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    backbone = getattr(model, model.base_model_prefix)
    with autocast(input_ids.device):
        hidden = backbone(input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (columns * attention_mask).argmax(dim=1)  # (B,) the rightmost attended column
    pooled = hidden.last_hidden_state[torch.arange(len(input_ids), device=input_ids.device), last]  # (B, H)
    return model.score(pooled.to(model.score.weight.dtype)).squeeze(-1).float()


def load_reward_model(path: str, tokenizer, device: torch.device):
    """--reward-model: a one-output AutoModelForSequenceClassification saved by reward_model.py, frozen. It must read the
    policy's tokens, so its tokenizer must be the policy's."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
        architecture = (config.architectures or ["an unknown architecture"])[0]
        if not architecture.endswith("ForSequenceClassification"):
            raise SystemExit(f"--reward-model {path!r}: a {architecture}, not a reward model (train one with reward_model.py)")
        if config.num_labels != 1:
            raise SystemExit(f"--reward-model {path!r}: has {config.num_labels} outputs, a reward model has one")
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        rm_tokenizer = AutoTokenizer.from_pretrained(path)
    except LOAD_ERRORS as e:
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        raise SystemExit(f"--reward-model {path!r}: cannot load a reward model and its tokenizer ({reason})") from None
    if rm_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SystemExit(f"--reward-model {path!r}: its tokenizer is not the policy's (train it from the same base model)")
    return model.to(device).eval().requires_grad_(False)


class MetricsLogger:
    """Appends one JSON object per logged step to OUTPUT_DIR/metrics.jsonl, and the evaluation's sampled answers (the
    "samples" entry of `evaluate`'s metrics), one JSON object each with the step, to OUTPUT_DIR/samples.jsonl.

    With `resume_step` (--resume) both files keep their rows up to that step (those after it were logged by the
    interrupted run after its last checkpoint, and will be logged again), new rows are appended, a step already in the
    file is not written again, and time/elapsed goes on from the last kept row. `last` is the last kept row and
    `last_eval` its latest evaluation ({} on a fresh run).

    Under torchrun every rank calls `log` with its own metrics; they are pooled over ranks (see aggregate) and rank 0
    writes them. A metric may be a tensor of samples (e.g. lengths), logged as their mean."""

    def __init__(self, output_dir: str, resume_step: int | None = None):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        samples_path = os.path.join(output_dir, "samples.jsonl")
        kept = {path: self._rows_up_to(path, resume_step) for path in (self.path, samples_path)}
        barrier()  # every rank has read the files before rank 0 rewrites them
        self.file, self.samples = io.StringIO(), io.StringIO()  # other ranks than 0 write nothing
        if is_main():
            os.makedirs(output_dir, exist_ok=True)
            self.file, self.samples = open(self.path, "w"), open(samples_path, "w")
        for file, path in ((self.file, self.path), (self.samples, samples_path)):
            file.writelines(json.dumps(row) + "\n" for row in kept[path])
            file.flush()
        rows = kept[self.path]
        self.last = rows[-1] if rows else {}
        self.last_eval = next(
            ({k: v for k, v in r.items() if k.startswith("eval/")} for r in rows[::-1] if "eval/accuracy" in r), {}
        )
        self.done_step = -1 if resume_step is None else resume_step
        self.start = time.time() - self.last.get("time/elapsed", 0.0)

    @staticmethod
    def _rows_up_to(path: str, step: int | None) -> list[dict]:
        if step is None or not os.path.isfile(path):
            return []
        rows = []
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:  # a line cut short when the interrupted run was killed
                    break
        return [row for row in rows if row["step"] <= step]

    def log(self, step: int, metrics: dict) -> None:
        if step <= self.done_step:  # already in the file (--resume)
            return
        row = {"step": step, "time/elapsed": round(time.time() - self.start, 3)}
        numbers = {k: v for k, v in metrics.items() if k != "samples"}
        if world_size() > 1:
            numbers = aggregate([numbers])
        row.update(
            {k: (v.item() if v.numel() == 1 else v.mean().item()) if torch.is_tensor(v) else v for k, v in numbers.items()}
        )
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for sample in metrics.get("samples", []):
            self.samples.write(json.dumps({"step": step, **sample}) + "\n")
        self.samples.flush()
        self.last = row

    def close(self) -> None:
        self.file.close()
        self.samples.close()


class Checkpoint:
    """--save-every and --resume: what a run needs to go on exactly as if it had never stopped, in
    OUTPUT_DIR/checkpoint.pt. That is the weights the optimizer trains (the policy, and PPO's critic), the optimizer's
    state, the step, the random number generators (`rng`, of the prompt order or the pair order; torch's, of sampling and
    minibatch order; CUDA's) and whatever `extra()` returns (a script's own loop state). Frozen models (the reference,
    a reward model) are reloaded as they were. The checkpoint is written every `--save-every` steps and after an
    interrupt (Ctrl-C or SIGTERM: the step in progress finishes, the checkpoint is saved, the run exits with status 0;
    a second Ctrl-C stops at once), to a side file renamed over the old one, so that a save cut short never replaces a
    good checkpoint. With --resume the constructor restores it; `step` is then its step (0 on a fresh run) and `extra`
    what extra() returned."""

    def __init__(self, args, optimizer, rng, extra: Callable[[], dict] = dict):
        import signal
        import threading

        self.path = os.path.join(args.output_dir, "checkpoint.pt")
        self.save_every, self.optimizer, self.rng, self.get_extra = args.save_every, optimizer, rng, extra
        self.step, self.resumed_step, self.extra, self.interrupted = 0, None, {}, False
        if args.resume:
            self.load()
        self.handlers = {}
        if threading.current_thread() is threading.main_thread():
            self.handlers = {s: signal.signal(s, self.interrupt) for s in (signal.SIGINT, signal.SIGTERM)}

    def interrupt(self, signum, frame) -> None:
        if self.interrupted:  # a second Ctrl-C: stop now, without a checkpoint of this step
            raise KeyboardInterrupt
        self.interrupted = True
        print("\ninterrupted: the step in progress finishes, then a checkpoint is saved", file=sys.stderr, flush=True)

    def trained(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def rng_state(self):
        return self.rng.get_state() if isinstance(self.rng, torch.Generator) else self.rng.getstate()

    def save(self, step: int) -> None:
        """Under torchrun every rank calls this (FSDP2 shards are gathered, each rank's torch RNG state is kept) and
        rank 0 writes the file."""
        optimizer = self.optimizer.state_dict()
        cpu = lambda v: local(v).cpu() if torch.is_tensor(v) else v  # noqa: E731 (FSDP2: one gathered tensor at a time)
        optimizer["state"] = {i: {k: cpu(v) for k, v in s.items()} for i, s in optimizer["state"].items()}
        state = {
            "step": step,
            "trained": [local(p.detach()).cpu() for p in self.trained()],
            "optimizer": optimizer,
            "rng": self.rng_state(),
            "torch_rng": self.per_rank(torch.get_rng_state()),
            "cuda_rng": self.per_rank(torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []),
            "extra": self.get_extra(),
        }
        if is_main():
            torch.save(state, self.path + ".partial")
            os.replace(self.path + ".partial", self.path)
        barrier()

    @staticmethod
    def per_rank(value):
        """value itself in one process; under torchrun the list of every rank's value."""
        if world_size() == 1:
            return value
        values = [None] * world_size()
        dist.all_gather_object(values, value)
        return values

    def mine(self, value):
        if world_size() == 1:
            return value
        if not isinstance(value, list) or len(value) != world_size():
            raise SystemExit(f"--resume: {self.path} was saved by another number of processes than this run's")
        return value[rank()]

    @staticmethod
    def shaped_like(saved: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """A saved full tensor laid out like the parameter p: sharded the same way under FSDP2."""
        if not hasattr(p, "device_mesh"):
            return saved
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(saved.to(p.device), p.device_mesh, p.placements)

    def load(self) -> None:
        state = torch.load(
            self.path, map_location="cpu", weights_only=False
        )  # our own file: it holds Python RNG state, not only tensors
        trained = self.trained()
        if [p.shape for p in trained] != [p.shape for p in state["trained"]]:
            raise SystemExit(f"--resume: {self.path} holds other weights than this run's model (another script or model?)")
        with torch.no_grad():
            for p, saved in zip(trained, state["trained"]):
                p.copy_(self.shaped_like(saved, p))
        for i, p in enumerate(trained):  # under FSDP2 the optimizer's state is sharded like its parameter, one at a time
            for k, v in state["optimizer"]["state"].get(i, {}).items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    state["optimizer"]["state"][i][k] = self.shaped_like(v, p)
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.set_state(state["rng"]) if isinstance(self.rng, torch.Generator) else self.rng.setstate(state["rng"])
        torch.set_rng_state(self.mine(state["torch_rng"]))
        if self.mine(state["cuda_rng"]) and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.mine(state["cuda_rng"]))
        self.step = self.resumed_step = state["step"]
        self.extra = state["extra"]
        print(f"resuming after step {self.step} from {self.path}")

    def step_done(self, step: int) -> None:
        """Call once a step is logged: saves every --save-every steps, and after an interrupt saves and exits."""
        if world_size() > 1:  # one rank interrupted: all of them save and stop at this step
            self.interrupted = bool(all_reduce(torch.tensor(int(self.interrupted)), "max"))
        if self.interrupted or (self.save_every and step % self.save_every == 0):
            self.save(step)
        if self.interrupted:
            self.close()
            if is_main():
                print(f"saved the checkpoint of step {step} to {self.path}; continue with --resume", file=sys.stderr)
            raise SystemExit(0)

    def close(self) -> None:
        """Give Ctrl-C and SIGTERM back their previous handlers."""
        import signal

        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        self.handlers = {}


def aggregate(rows: list[dict]) -> dict:
    """Combine the metrics of several micro-batches and optimizer steps. A metric is a tensor of samples (one per
    valid token for a token mean, one per response for a mean over responses, a scalar for a per-step number such as
    the gradient norm); the samples of every row are pooled, then the max of *_max, the min of *_min and the mean of
    the rest is taken. Pooling weights each micro-batch by its tokens (or responses), so that no logged number
    depends on --micro-batch-size.

    Under torchrun the samples of every rank are pooled (a rank may lack a metric that another has), so that every
    rank gets the same numbers, those of one process on the union of the ranks' batches."""
    out = {}
    keys = list(dict.fromkeys(k for row in rows for k in row))
    if world_size() > 1:  # the union of the ranks' metric names, in a common order
        names = [None] * world_size()
        dist.all_gather_object(names, keys)
        keys = list(dict.fromkeys(k for ks in names for k in ks))
    pooled, dtype = {}, torch.float32 if world_size() == 1 else torch.float64  # over ranks: exact for Python floats
    for key in keys:
        pieces = [torch.as_tensor(local(row[key]), dtype=dtype).detach().flatten().cpu() for row in rows if key in row]
        pooled[key] = torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype)
    if world_size() == 1:
        return {k: v.max() if k.endswith("_max") else v.min() if k.endswith("_min") else v.mean() for k, v in pooled.items()}
    values = list(pooled.values())
    if not values:
        return out
    sums = all_reduce(torch.stack([v.sum() for v in values]))
    counts = all_reduce(torch.tensor([float(len(v)) for v in values], dtype=dtype))
    mins = all_reduce(torch.stack([v.min() if len(v) else torch.tensor(math.inf, dtype=dtype) for v in values]), "min")
    maxs = all_reduce(torch.stack([v.max() if len(v) else torch.tensor(-math.inf, dtype=dtype) for v in values]), "max")
    for i, key in enumerate(keys):
        out[key] = maxs[i] if key.endswith("_max") else mins[i] if key.endswith("_min") else sums[i] / counts[i]
    return out


def check_finite(value: torch.Tensor, what: str, step: int) -> None:
    """Stop the run, saying where, instead of training on NaN or inf."""
    if not torch.isfinite(local(value)).all():
        raise SystemExit(f"non-finite {what} at step {step}: stopping (try a lower --learning-rate)")


# ---------------------------------------------------------------------------------------------------------------------
# Argument checks: each names its flag and what is allowed, and runs before any model or data is loaded
# ---------------------------------------------------------------------------------------------------------------------


def check_flag(args, name: str, allowed: str, ok: Callable) -> None:
    """Refuse --NAME unless ok(value) holds (a float must also be finite): one line naming the flag, the value and what
    is allowed. NaN fails every comparison, so `ok` written as the allowed range refuses it too."""
    value = getattr(args, name)
    if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
        raise SystemExit(f"--{name.replace('_', '-')} {value}: {allowed}")


def check_writable_dir(flag: str, path: str) -> None:
    """Create the folder (or find it) and make sure a file can be written there, before any expensive work."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise SystemExit(f"{flag} {path!r}: cannot create or write to this folder ({e.strerror or e})") from None


def check_shared_args(args) -> None:
    """Checks of the shared block of flags (task, model, device) that every script has."""
    if args.task not in TASKS:
        raise SystemExit(f"--task {args.task!r}: unknown task; allowed values are {', '.join(TASKS)}")
    if args.model_name_or_path == "builtin" and args.task not in BUILTIN_TASKS:
        raise SystemExit(
            f"--task {args.task}: the built-in model knows only {', '.join(BUILTIN_TASKS)}; pass --model-name-or-path"
        )
    check_model_path(args.model_name_or_path)
    get_device(args.device)


def check_data_flags(args) -> None:
    """--dataset must name something that can exist, and --chat-template a mode (and 'on', a tokenizer that has one)."""
    if args.dataset and not os.path.exists(args.dataset) and not looks_like_hub_id(args.dataset):
        raise SystemExit(f"--dataset {args.dataset!r}: no such file or folder, and not a hub id")
    if args.chat_template not in ("auto", "on", "none"):
        raise SystemExit(f"--chat-template {args.chat_template!r}: allowed values are auto, on, none")
    path = args.model_name_or_path
    if args.chat_template == "on" and (path == "builtin" or has_chat_template(path) is False):
        raise SystemExit(f"--chat-template on: the tokenizer of {path!r} has no chat template (use auto or none)")


def check_resume_flags(args) -> None:
    """--save-every must be 0 or positive, and --resume needs a checkpoint in --output-dir."""
    check_flag(args, "save_every", "must be 0 (only when interrupted) or positive", lambda v: v >= 0)
    if args.resume and not os.path.isfile(os.path.join(args.output_dir, "checkpoint.pt")):
        raise SystemExit(f"--resume: no checkpoint.pt in --output-dir {args.output_dir!r} to continue from")


def check_folders(args) -> None:
    """The last check: the output folder is created (or found) writable, and so is the cache when a warm-up is due."""
    check_writable_dir("--output-dir", args.output_dir)
    if args.model_name_or_path == "builtin" and not os.path.isdir(builtin_model_dir(args.cache_dir, args.task)):
        check_writable_dir("--cache-dir", cache_root(args.cache_dir))  # the warm-up will be cached there


def check_common_args(args) -> None:
    """Checks of the flags every RL script shares."""
    check_shared_args(args)
    check_distributed_args(args)
    check_divisible(args, "num_prompts")
    for flag in ("temperature", "learning_rate", "max_grad_norm"):
        check_flag(args, flag, "must be positive", lambda v: v > 0)
    check_flag(args, "beta", "must be 0 (no KL penalty) or positive", lambda v: v >= 0)
    for flag in ("num_prompts", "num_minibatches", "num_epochs", "eval_every"):
        check_flag(args, flag, "must be at least 1", lambda v: v >= 1)
    check_flag(args, "max_new_tokens", "must be 0 (the task's) or positive", lambda v: v >= 0)
    check_flag(args, "total_steps", "must be 0 (the script's number for the task) or positive", lambda v: v >= 0)
    check_flag(args, "micro_batch_size", "must be 0 (the whole minibatch) or positive", lambda v: v >= 0)
    check_flag(
        args, "num_eval", f"must be at least 1, and one per process ({world_size()})", lambda v: v >= max(1, world_size())
    )
    check_resume_flags(args)
    check_data_flags(args)
    if args.reward_model and not os.path.isfile(os.path.join(args.reward_model, "config.json")):
        raise SystemExit(f"--reward-model {args.reward_model!r}: not a folder with a config.json (see reward_model.py)")
