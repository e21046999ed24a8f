"""A partial-credit reward for the built-in addition task, whose answers are the sum's digits in reverse order:

    python grpo.py --reward-funcs examples/partial_credit.py:digits_in_place

eval/accuracy stays the share of exactly right answers (the task's verifier); this reward is logged as
reward/digits_in_place."""


def digits_in_place(completions, answer, **kwargs) -> list[float]:
    """The share of the answer's digits that the completion has in the same place (a longer completion: its extra
    characters count against it), from 0 to 1; exactly right scores 1."""
    return [sum(x == y for x, y in zip(c.strip(), a)) / max(len(a), len(c.strip())) for c, a in zip(completions, answer)]
