"""Tasks: prompts with reference answers, a verifier that scores a completion 1 (correct) or 0, the built-in tasks
(two-digit addition, three-digit addition worked on a scratchpad) and GSM8K, a user's own prompts (--dataset: text or
conversations, with every column kept), and the chat template that turns a prompt into what a chat model reads.

The verifier is what eval/accuracy and pass@k count; a reward of your own (partial credit, a format) is a reward
function (reward_funcs.py), not a change to the verifier. Your own task is a function that returns a Task, registered in
TASKS (see docs/your-model-and-data.md)."""

import dataclasses
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from plumbing.hub import offline_unless_hub_reachable


@dataclass
class Task:
    """A task: training and held-out prompts with their reference answers, and a verifier (`extract_answer`, then
    `reward`) that scores a completion 1 when the final answer it states is the reference answer, else 0."""

    name: str
    train: "datasets.Dataset"  # noqa: F821  columns: prompt, answer (the built-in tasks' solution: what the warm-up imitates)
    eval: "datasets.Dataset"  # noqa: F821  fixed held-out split, never trained on
    extract_answer: Callable[[str], str | None]  # completion text -> the final answer it states (or None)
    max_new_tokens: int = 256  # the generation budget a script uses unless --max-new-tokens says otherwise
    instruction: str = ""  # the answer format, told to a chat model as its system message (default: INSTRUCTIONS[name])
    chat: bool = False  # whether the prompts were rendered with a chat template (apply_chat_template)

    def verify(self, completions: list[str], answers: list[str]) -> torch.Tensor:
        """1.0 for a correct final answer, 0.0 otherwise: what eval/accuracy, pass@k and rollout/gold_accuracy count. A
        truncated completion is scored like any other."""
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
    """The unordered pair {a, b} of a built-in prompt "aa+bb=" (or "a*b="): a problem and its commuted twin share it."""
    a, b = re.split(r"[+*]", row["prompt"].rstrip("="))
    return tuple(sorted((int(a), int(b))))


def addition_answer(completion: str) -> str | None:
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
    return Task(name="addition", train=train, eval=held_out, extract_answer=addition_answer, max_new_tokens=8)


def scratchpad_solution(a: int, b: int, digits: int = 3) -> str:
    """The worked solution of a + b, one column at a time from the least significant digit, the carry written out,
    then the sum after a lone "=": 482 + 396 gives "2+6=8 8+9=17 4+3+1=8 =878"."""
    columns, carry = [], 0
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        columns.append(f"{x}+{y}{'+1' if carry else ''}={x + y + carry}")
        carry = (x + y + carry) // 10
    return " ".join(columns) + f" ={a + b}"


def scratchpad_answer(completion: str) -> str | None:
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
    return Task("scratchpad", train, held_out, scratchpad_answer, max_new_tokens=64)


def multiplication_answer(completion: str) -> str | None:
    """The model's final answer: what it wrote after the last tool result "[...]" (all of it when it called no tool)."""
    return completion.rsplit("]", 1)[-1].strip() or None


def make_multiplication_task(num_eval: int = 500, tool_share: float = 0.25, num_problems: int = 20000) -> Task:
    """The built-in tool task: "347*86=", a three-digit times a two-digit number, answered by the product's digits, then
    EOS. A 1M-parameter model cannot multiply such numbers, but it can call the calculator (grpo_tools.py) in the
    compact format of tools.CompactFormat and copy its answer: "<347*86>" (the call, written by the model), "[29842]"
    (written by the environment), "29842" (the model again). The warm-up imitates `solution`, which uses the tool for a
    `tool_share` of the training problems (drawn at random) and states the product outright for the others: the
    starting policy sometimes calls the tool and often guesses, and RL has something to discover. The held-out split is
    split by the unordered pair of operands; `num_problems` distinct problems are drawn (fixed seed) from the 81,000."""
    import datasets

    rng = random.Random(2468)
    problems = list(dict.fromkeys((rng.randrange(100, 1000), rng.randrange(10, 100)) for _ in range(2 * num_problems)))
    problems = problems[:num_problems]
    solutions = [f"<{a}*{b}>[{a * b}]{a * b}" if rng.random() < tool_share else str(a * b) for a, b in problems]
    dataset = datasets.Dataset.from_dict(
        {"prompt": [f"{a}*{b}=" for a, b in problems], "answer": [str(a * b) for a, b in problems], "solution": solutions}
    )
    train, held_out = split_by_key(dataset, num_eval, addition_operands, seed=1234)
    return Task("multiplication", train, held_out, multiplication_answer, max_new_tokens=32)


def make_products_task(num_eval: int = 100) -> Task:
    """The tool task for a chat model: "What is 347 * 86?", a three-digit times a two-digit number, rewarded when the
    last number of what the verifier reads (the model's final turn, or with grpo_tools.py's inline format its whole
    reply) is the product (the gsm8k verifier), with 64 tokens for the whole conversation after the prompt (the model's
    turns and the tool's answers); 100 problems held out (a chat model's evaluation is slow on a CPU)."""
    import datasets

    rng = random.Random(1357)
    problems = list(dict.fromkeys((rng.randrange(100, 1000), rng.randrange(10, 100)) for _ in range(20000)))
    prompts, answers = [f"What is {a} * {b}?" for a, b in problems], [str(a * b) for a, b in problems]
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})
    operands = lambda row: tuple(sorted(int(n) for n in re.findall(r"\d+", row["prompt"])))
    train, held_out = split_by_key(dataset, num_eval, operands, seed=1234)
    return Task("products", train, held_out, gsm8k_answer, max_new_tokens=64)


def gsm8k_answer(completion: str) -> str | None:
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

    return Task("gsm8k", convert("train"), convert("test").select(range(num_eval)), gsm8k_answer)


def make_sums_task(num_eval: int = 200) -> Task:
    """Two-digit addition asked in words, for a pretrained chat model (the built-in model reads digits only): "What is
    61 + 48?", rewarded when the last number of the reply is the sum (the gsm8k verifier), with a 24-token budget. A
    small chat model told to solve it step by step explains at length and runs out of tokens before its answer; RL
    teaches it to answer within the budget. The held-out split is split by the unordered pair of operands, so that
    "48 + 61" is not trained on when "61 + 48" is held out."""
    import datasets

    problems = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    prompts, answers = [f"What is {a} + {b}?" for a, b in problems], [str(a + b) for a, b in problems]
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})
    operands = lambda row: tuple(sorted(int(n) for n in re.findall(r"\d+", row["prompt"])))
    train, held_out = split_by_key(dataset, num_eval, operands, seed=1234)
    return Task("sums", train, held_out, gsm8k_answer, max_new_tokens=24)


TASKS: dict[str, Callable[[], Task]] = {
    "addition": make_addition_task,
    "scratchpad": make_scratchpad_task,
    "gsm8k": make_gsm8k_task,
    "sums": make_sums_task,
    "multiplication": make_multiplication_task,
    "products": make_products_task,
}
BUILTIN_TASKS = ("addition", "scratchpad", "multiplication")  # the tasks the built-in model can be warmed up on


# Each task's verifier and generation budget, for a user's data scored like the task (--dataset), and the system
# message a chat model gets: the answer format, which is all the verifier reads.
VERIFIERS = {"addition": (addition_answer, 8), "scratchpad": (scratchpad_answer, 64), "gsm8k": (gsm8k_answer, 256)}
VERIFIERS |= {"multiplication": (multiplication_answer, 32)}  # (its prompts are the built-in model's)
INSTRUCTIONS = {
    "addition": "Add the two numbers. Reply with the digits of the sum in reverse order, ones digit first, and nothing else.",
    "scratchpad": "Add the two numbers column by column from the ones digit, like 2+6=8 8+9=17 4+3+1=8, then = and the sum.",
    "gsm8k": "Solve the problem step by step. End your reply with the final answer as a plain number.",
    "sums": "Solve the problem step by step. End your reply with the final answer as a plain number.",
    "products": "Answer with the final result as a plain number.",
}


def check_task_flag(args) -> None:
    """--task names a task of TASKS, and with the built-in model (--model-name-or-path builtin) one it was warmed up on:
    refused in one line before anything expensive."""
    if args.task not in TASKS:
        raise SystemExit(f"--task {args.task!r}: unknown task; allowed values are {', '.join(TASKS)}")
    if args.model_name_or_path == "builtin" and args.task not in BUILTIN_TASKS:
        raise SystemExit(
            f"--task {args.task}: the built-in model knows only {', '.join(BUILTIN_TASKS)}; pass --model-name-or-path"
        )


def make_task(name: str, dataset: str = "", num_eval: int = 500, prompt_column="prompt", answer_column="answer") -> Task:
    """The task called `name` (checked by check_task_flag before anything expensive). With `dataset` (--dataset), a
    user's rows replace its data and are scored by its verifier: the prompt from `prompt_column` (--prompt-column), a
    string or a conversation (a list of {"role", "content"} messages, rendered later by apply_chat_template), the
    reference answer from `answer_column` (--answer-column), and every other column kept as it is, for reward functions
    (reward_funcs.py). `num_eval` rows (at most half) are held out for evaluation, split by prompt, so that no prompt is both
    trained on and evaluated."""
    if not dataset:
        return TASKS[name]()
    import datasets

    hint = (
        "; name yours with --prompt-column and --answer-column (eval/accuracy and pass@k count --task's verifier's "
        "correct answers, so rows without a reference answer cannot be evaluated, whatever --reward-funcs)"
    )
    data = load_user_dataset(dataset, "--dataset", (prompt_column, answer_column), hint)
    columns = {column: data[column] for column in data.column_names}  # every column, for reward functions
    columns["prompt"] = [checked_prompt(p, f"--dataset {dataset!r}: row {i}") for i, p in enumerate(data[prompt_column])]
    columns["answer"] = [str(a).strip() for a in data[answer_column]]
    if missing := [i for i, a in enumerate(data[answer_column]) if a is None or not str(a).strip()]:
        raise SystemExit(f"--dataset {dataset!r}: row {missing[0]} has no reference answer in column {answer_column!r}")
    rows = datasets.Dataset.from_dict(columns)
    if len({json.dumps(p) for p in rows["prompt"]}) < 2:
        raise SystemExit(f"--dataset {dataset!r}: needs at least two distinct prompts (one to train on, one held out)")
    train, held_out = split_by_key(rows, min(num_eval, len(rows) // 2), lambda row: json.dumps(row["prompt"]), seed=1234)
    return Task(name, train, held_out, *verifier(name))


def checked_prompt(prompt, where: str):
    """A prompt as a user's data may give it: a string, or a conversation, a list of {"role", "content"} messages (the
    form of the hub's chat data sets) whose last one is not the assistant's. Anything else is refused in one line."""
    if isinstance(prompt, str):
        return prompt
    roles = ("system", "user", "assistant", "tool")
    is_message = lambda m: isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str)
    if not isinstance(prompt, list) or not prompt or not all(is_message(m) for m in prompt):
        raise SystemExit(
            f"{where}: the prompt must be a string or a list of {{'role', 'content'}} messages, roles {', '.join(roles)} "
            f"(got {str(prompt)[:80]!r})"
        )
    if prompt[-1]["role"] == "assistant":
        raise SystemExit(f"{where}: the conversation ends with the assistant's message; a prompt ends where the model answers")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]  # (the data's other message fields dropped)


def verifier(name: str) -> tuple[Callable[[str], str | None], int]:
    """The answer reader and the generation budget of the task `name`, for a user's data scored like it: those of
    VERIFIERS, or for a task of your own, its own."""
    if name in VERIFIERS:
        return VERIFIERS[name]
    own = TASKS[name]()
    return own.extract_answer, own.max_new_tokens


def load_user_dataset(path: str, flag: str, columns: tuple[str, ...], hint: str = ""):
    """A data set a user names with `flag`: a .json, .jsonl, .csv or .parquet file, a folder saved with `save_to_disk`,
    or a hub id, with `columns`. Anything else is refused in one line naming the flag, before any model is loaded."""
    import datasets

    builders = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    extension = os.path.splitext(path)[1].lower()
    if os.path.isfile(path) and extension not in builders:
        raise SystemExit(
            f"{flag} {path!r}: cannot read {extension or 'this'} files; give .json, .jsonl, .csv, .parquet or a folder"
        )
    empty = f"{flag} {path!r}: has no rows; it needs rows with {', '.join(columns)}"
    try:
        if os.path.isdir(path):
            ds = datasets.load_from_disk(path)
            ds = ds["train"] if isinstance(ds, datasets.DatasetDict) and "train" in ds else ds
        elif os.path.isfile(path):
            ds = datasets.load_dataset(builders[extension], data_files=path, split="train")
        else:
            with offline_unless_hub_reachable():
                ds = datasets.load_dataset(path, split="train")
    except StopIteration:  # the json reader on an empty file
        raise SystemExit(empty) from None
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as e:  # unreadable, or a hub id out of reach
        if "corresponds to no data" in str(e):  # datasets on a file of blank lines, or a header alone
            raise SystemExit(empty) from None
        raise SystemExit(f"{flag} {path!r}: cannot be loaded ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(ds, datasets.Dataset):
        raise SystemExit(f"{flag} {path!r}: holds several splits and none is called train")
    if len(ds) == 0:
        raise SystemExit(empty)
    missing = set(columns) - set(ds.column_names)
    if missing:
        raise SystemExit(
            f"{flag} {path!r}: missing column(s) {', '.join(sorted(missing))} (it has {', '.join(ds.column_names)}){hint}"
        )
    return ds


def apply_chat_template(
    task: Task, tokenizer, mode: str, instruction: str = "", tools: list | None = None, also_tell: str = ""
) -> Task:
    """--chat-template: with 'auto' (when the tokenizer has a chat template) or 'on', every prompt is rendered as a
    conversation (prompt_messages): the answer format as the system message, the prompt as the user turn (or a --dataset's
    own conversation), then the generation prompt; with 'none' (or 'auto' and no template, as for base models) the
    prompts stay plain text, behind the tokenizer's BOS if its own encoding starts with one (the model was trained so;
    prompts are tokenized without special tokens, since a chat template writes them itself). The prompt as the data gave
    it is kept in the column raw_prompt, for reward functions (reward_funcs.py). A template that refuses a system role gets
    the instruction at the head of the first user turn instead. `tools` (Python functions, grpo_tools.py) are passed on
    to a template that describes tools to the model itself; `also_tell` (how to call a tool) ends every system message,
    a conversation's own included. A prompt that already holds the tokenizer's special tokens
    was rendered by its author: rendering it again is refused in one line, and so is a conversation with no template."""
    conversational = not isinstance(task.train[0]["prompt"], str)
    if mode == "none" or (mode == "auto" and not tokenizer.chat_template):
        if conversational:
            raise SystemExit(
                "--dataset: its prompts are conversations (lists of messages), which need a chat template; this "
                f"tokenizer has {'one, but --chat-template is none' if tokenizer.chat_template else 'none'}"
            )
        bos = tokenizer.bos_token if tokenizer("x").input_ids[:1] == [tokenizer.bos_token_id] else None
        if bos is None:  # (the built-in tokenizer has no BOS)
            return task
        with_bos = lambda ds: ds.map(lambda row: {"raw_prompt": row["prompt"], "prompt": bos + row["prompt"]})
        return dataclasses.replace(task, train=with_bos(task.train), eval=with_bos(task.eval))
    if not tokenizer.chat_template:
        raise SystemExit("--chat-template on: the model's tokenizer has no chat template (use auto or none)")
    special = [t for t in tokenizer.all_special_tokens if len(t) > 1]  # (a one-character one, e.g. "<", is text too)
    for prompt in [*task.train["prompt"], *task.eval["prompt"]]:  # a --dataset's prompt may come rendered by its author
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        if any(token in text for token in special):
            raise SystemExit(
                f"--dataset: a prompt already holds the tokenizer's special tokens ({text[:60]!r}): it was rendered with "
                "a chat template; pass --chat-template none to use it as given"
            )
    from jinja2.exceptions import TemplateError

    instruction = instruction or task.instruction or INSTRUCTIONS.get(task.name, "")  # --instruction, else the task's

    def render(prompt) -> str:
        turns = prompt_messages(prompt, instruction, also_tell)
        try:
            return tokenizer.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=True)
        except TemplateError:  # e.g. no system role: the instruction opens the first user turn
            return tokenizer.apply_chat_template(
                without_system(turns), tools=tools, tokenize=False, add_generation_prompt=True
            )

    rendered = lambda ds: ds.map(lambda row: {"raw_prompt": row["prompt"], "prompt": render(row["prompt"])})
    return dataclasses.replace(task, train=rendered(task.train), eval=rendered(task.eval), chat=True, instruction=instruction)


def prompt_messages(prompt, instruction: str, also_tell: str = "") -> list[dict]:
    """The conversation a chat model reads for `prompt`: a string becomes the user turn behind `instruction` as the
    system message (when there is one); a conversation keeps its own system message, or gets `instruction` as one.
    `also_tell` ends the system message either way."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    own = messages[0]["role"] == "system"
    system = f"{messages[0]['content'] if own else instruction} {also_tell}".strip()
    return ([{"role": "system", "content": system}] if system else []) + messages[own:]


def without_system(messages: list[dict]) -> list[dict]:
    """For a template that refuses a system role: the system message opens the first user turn instead."""
    if messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    first_user = next(i for i, m in enumerate(rest) if m["role"] == "user")
    rest[first_user]["content"] = f"{system}\n\n{rest[first_user]['content']}".strip()
    return rest
