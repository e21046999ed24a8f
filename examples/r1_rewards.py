"""Reward functions in TRL's form for an R1-style run: a format reward and a correctness reward, weighted.

    python examples/make_chat_sums.py chat_sums.jsonl
    python grpo.py --model-name-or-path ~/.cache/tiny-rlhf/SmolLM2-135M-Instruct --task sums \
        --dataset chat_sums.jsonl --answer-column solution \
        --reward-funcs examples/r1_rewards.py:format_reward examples/r1_rewards.py:accuracy_reward --reward-weights 0.5 1

Each gets the completions (for conversational data, each a list holding the assistant's message) and every column of
the data as a keyword argument, and returns one float per completion (or None where it does not apply)."""

import re

ONE_EQUATION = re.compile(r"[^\n=]*=\s*-?\d+\.?\s*")  # the format: one line, "... = <number>" and nothing after it
NUMBER = re.compile(r"-?\d+")


def text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def format_reward(completions, **kwargs) -> list[float]:
    """1 when the whole reply is one line that ends with "= <number>" (whatever the number), else 0."""
    return [float(ONE_EQUATION.fullmatch(text(c)) is not None) for c in completions]


def accuracy_reward(completions, solution, **kwargs) -> list[float]:
    """1 when the last number of the reply is the data's `solution`, else 0, whatever the format."""
    last_numbers = [NUMBER.findall(text(c))[-1:] for c in completions]
    return [float(n == [s]) for n, s in zip(last_numbers, solution)]
