"""The reward a script trains on: the task's verifier (1 for a correct final answer, 0 otherwise) by default, a learned
reward model's score with --reward-model, or with --reward-funcs reward functions of your own, weighted and summed.

A reward function is a Python function called the way TRL calls one, with keyword arguments, one value per completion:

    def partial_credit(prompts, completions, answer, **columns) -> list[float | None]: ...

`prompts` are the prompts as the data gives them (a string, or for conversational data a list of {"role", "content"}
messages), `completions` the completions' text (for conversational data, each a list holding one assistant message),
and every other column of the data set arrives under its own name (`answer`, and any column of a --dataset), one value
per completion. It returns a number, or None where it does not apply (a None counts as 0 in the sum). The reward of a
completion is sum_k w_k f_k(completion) with the weights of --reward-weights (1 each by default); `verifier` and
`reward_model` are the names of the task's verifier and of --reward-model among them. Each function's mean and std over
the completions it applies to are logged as reward/NAME and reward/NAME_std.

The verifier stays the gold measure, whatever the reward: rollout/gold_accuracy, eval/accuracy and pass@k count its
correct answers (common.evaluate), never a reward function's values."""

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import traceback

import torch

import common
import tasks
from plumbing import dist, models

VERIFIER, REWARD_MODEL = "verifier", "reward_model"  # the built-in names of --reward-funcs
LOADED_FILES = {}  # the modules of the FILE.py files loaded so far, by absolute path


def reward_specs(args) -> tuple[str, ...]:
    """--reward-funcs, or by default the one reward there is: --reward-model's score, else the verifier's."""
    return tuple(args.reward_funcs) or ((REWARD_MODEL,) if args.reward_model else (VERIFIER,))


def load_reward_function(spec: str):
    """The function `spec` names: FILE.py:NAME (a path to a Python file) or MODULE:NAME (an importable module). A spec
    that cannot be loaded is refused in one line naming it."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise SystemExit(f"--reward-funcs {spec!r}: give FILE.py:NAME, MODULE:NAME, {VERIFIER} or {REWARD_MODEL}")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise SystemExit(f"--reward-funcs {spec!r}: no such file {where!r}")
            path = os.path.abspath(where)
            if path not in LOADED_FILES:  # a file runs once, whatever number of its functions is named
                module_spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
                LOADED_FILES[path] = module
            module = LOADED_FILES[path]
        else:
            module = importlib.import_module(where)
    except SystemExit:
        raise
    except Exception as e:  # a user's file: whatever it raises while it is imported
        raise SystemExit(f"--reward-funcs {spec!r}: importing {where} raised {type(e).__name__}: {e}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise SystemExit(f"--reward-funcs {spec!r}: {where} has no function {name}")
    return function


def arguments_taken(function, spec: str, available: list[str]) -> list[str] | None:
    """The keyword arguments of `available` that `function` takes (None: all of them, it has **kwargs). A parameter it
    needs and the data has not is refused in one line, before the first step."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return None
    needed = [p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing := [name for name in needed if name not in available]:
        raise SystemExit(
            f"--reward-funcs {spec!r}: needs {', '.join(missing)}, which the data has not (it gets {', '.join(available)})"
        )
    return [name for name in available if name in {p.name for p in parameters}]


class RewardFunctions:
    """The reward functions of a run (reward_specs), their weights, and --reward-model's model when one is named."""

    def __init__(self, args, task: tasks.Task, tokenizer, device: torch.device):
        self.specs = reward_specs(args)
        self.names = [spec.rpartition(":")[2] for spec in self.specs]
        self.weights = torch.tensor(args.reward_weights or [1.0] * len(self.specs), device=device)  # (F,)
        self.group_size, self.task, self.device, self.logged = args.group_size, task, device, bool(args.reward_funcs)
        self.conversational = not isinstance(task.train[0].get("raw_prompt", task.train[0]["prompt"]), str)
        available = ["prompts", "completions", *(c for c in task.train.column_names if c not in ("prompt", "raw_prompt"))]
        if len(set(available)) < len(available):  # a column called prompts or completions would replace an argument
            raise SystemExit("--dataset: a column is called prompts or completions, the names of two arguments: rename it")
        self.functions, self.arguments = {}, {}
        for spec, name in zip(self.specs, self.names):
            if spec not in (VERIFIER, REWARD_MODEL):
                self.functions[name] = load_reward_function(spec)
                self.arguments[name] = arguments_taken(self.functions[name], spec, available)
        self.reward_model, self.reward_tokenizer = None, None
        if args.reward_model:
            self.reward_model, self.reward_tokenizer = models.load_reward_model(args.reward_model, device)
            # the policy's own tokens are scored as they are; another tokenizer's model reads the conversation re-rendered
            self.same_tokenizer = self.reward_tokenizer.get_vocab() == tokenizer.get_vocab()
            if not self.same_tokenizer and self.conversational and not self.reward_tokenizer.chat_template:
                raise SystemExit(
                    f"--reward-model {args.reward_model!r}: its tokenizer is not the policy's and has no chat template, "
                    "so it cannot read this data's conversations"
                )

    def __call__(self, batch: dict, completions: list[str], gold, input_ids, attention_mask):
        """The rewards (B,) of B = len(batch) x group_size completions (each prompt's group contiguous, as sampled), and
        every function's scores (B, F), NaN where it returned None. `gold`: the verifier's (B,); input_ids and
        attention_mask (B, L): the policy's prompt and completion tokens, which a reward model of the same tokenizer reads."""
        columns = {name: [v for v in values for _ in range(self.group_size)] for name, values in batch.items()}
        prompts = columns.pop("raw_prompt", None) or columns["prompt"]
        columns.pop("prompt")
        scores = []
        for spec, name in zip(self.specs, self.names):
            if spec == VERIFIER:
                values = gold.float()
            elif spec == REWARD_MODEL:
                values = self.reward_model_scores(prompts, completions, input_ids, attention_mask)
                if not dist.true_on_every_rank(torch.isfinite(values).all()):
                    raise SystemExit("--reward-model: a non-finite score (the reward model diverged, or reads what it cannot)")
            else:
                values = self.call(spec, name, prompts, completions, columns)
            scores.append(values.to(self.device))
        scores = torch.stack(scores, dim=1)  # (B, F)
        rewards = (scores.nan_to_num(0.0) * self.weights).sum(dim=1)  # (B,) a None (NaN here) counts as 0
        return rewards, scores

    def call(self, spec: str, name: str, prompts: list, completions: list[str], columns: dict) -> torch.Tensor:
        """One user function's values (B,), NaN for None. What it raises or returns amiss is refused in one line that
        names it and the first bad value (under torchrun: on every process, when any has one)."""
        texts = [[{"role": "assistant", "content": c}] for c in completions] if self.conversational else completions
        given = {"prompts": prompts, "completions": texts, **columns}
        if self.arguments[name] is not None:  # a function without **kwargs gets the arguments it names
            given = {k: v for k, v in given.items() if k in self.arguments[name]}
        scores, error = None, None
        try:  # (the checks too: a value such as 10**400 raises in them, and no process may stop alone)
            values = self.functions[name](**given)
            error = bad_values(values, len(completions))
            scores = None if error else torch.tensor([math.nan if v is None else float(v) for v in values])
        except Exception as e:  # a user's function: whatever it raises
            frame = traceback.extract_tb(e.__traceback__)[-1]
            error = f"raised {type(e).__name__}: {e} (at {os.path.basename(frame.filename)}:{frame.lineno})"
        if not dist.true_on_every_rank(error is None):
            raise SystemExit(f"--reward-funcs {spec!r}: {error or 'failed in another process'}")
        return scores

    def reward_model_scores(self, prompts: list, completions: list[str], input_ids, attention_mask) -> torch.Tensor:
        """--reward-model's score of each completion (B,). A model of the policy's tokenizer reads the policy's own tokens;
        one of another tokenizer reads the same conversation written anew (the prompt as the policy saw it, the
        completion's text as the assistant's turn) with its own chat template, or without one the prompt's text and
        the completion's, as TRL and OpenRLHF do."""
        if self.same_tokenizer:
            return common.sequence_rewards(self.reward_model, input_ids, attention_mask)
        if self.reward_tokenizer.chat_template:
            instruction = self.task.instruction if self.task.chat else ""
            conversations = [
                tasks.prompt_messages(p, instruction) + [{"role": "assistant", "content": c}]
                for p, c in zip(prompts, completions)
            ]
            texts = [self.render(turns) for turns in conversations]
            encoded = self.reward_tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        else:
            encoded = self.reward_tokenizer([p + c for p, c in zip(prompts, completions)], padding=True, return_tensors="pt")
        ids, mask = encoded.input_ids.to(self.device), encoded.attention_mask.to(self.device)
        with torch.no_grad():
            return common.sequence_rewards(self.reward_model, ids, mask)

    def render(self, conversation: list[dict]) -> str:
        """The conversation in the reward model's chat template (one that refuses a system role: its first user turn)."""
        from jinja2.exceptions import TemplateError

        try:
            return self.reward_tokenizer.apply_chat_template(conversation, tokenize=False)
        except TemplateError:
            return self.reward_tokenizer.apply_chat_template(tasks.without_system(conversation), tokenize=False)

    def metrics(self, scores: torch.Tensor) -> dict:
        """With --reward-funcs: reward/NAME and reward/NAME_std, each function's mean and (population) std over the
        completions it applies to (not None), over every process; a function that applied to none is not logged."""
        if not self.logged:
            return {}
        out = {}
        for name, values in zip(self.names, scores.T.double()):
            values = values[~values.isnan()]
            count, total, squares = dist.all_reduce(
                torch.stack([torch.tensor(float(len(values))), values.sum().cpu(), values.square().sum().cpu()])
            )
            if count > 0:
                mean = total / count
                out[f"reward/{name}"], out[f"reward/{name}_std"] = mean, (squares / count - mean**2).clamp(min=0).sqrt()
        return out


def bad_values(values, count: int) -> str | None:
    """What is wrong with what a reward function returned for `count` completions, or None: one number or None each."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not hasattr(values, "__len__") or isinstance(values, (str, dict)):
        return f"returned {str(values)[:60]!r}, not a list of {count} numbers (or None)"
    if len(values) != count:
        return f"returned {len(values)} values for {count} completions"
    for i, v in enumerate(values):
        if v is not None and not is_finite_number(v):
            return f"returned {v!r:.40} for completion {i}: a reward is a finite number, or None where it does not apply"
    return None


def is_finite_number(value) -> bool:
    try:
        return isinstance(value, numbers.Real) and math.isfinite(float(value))
    except OverflowError:  # an integer past the largest float
        return False
