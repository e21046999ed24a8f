"""Reward functions of a user's own, measured: an R1-style run of SmolLM2-135M-Instruct on conversational data (a format
reward and a correctness reward, weighted; examples/r1_rewards.py) and the built-in model trained on partial credit
(examples/partial_credit.py), each over seeds. Runs what is missing, one after another, keeps each run's metrics in
docs/real-model/reward-funcs-runs/, and prints the tables of docs/your-model-and-data.md and draws its chart.

    python -m benchmarks.prepare_smollm2 && python -m benchmarks.benchmark_reward_funcs --seeds 1 2 3
"""

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

from benchmarks import prepare_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
RECORDS = os.path.join(ROOT, "docs", "real-model", "reward-funcs-runs")
CHART = os.path.join(ROOT, "docs", "real-model", "reward-funcs.png")
CHAT_DATA = "chat_sums.jsonl"  # written by examples/make_chat_sums.py into --runs-dir
R1_FLAGS = [
    "--task", "sums", "--dataset", CHAT_DATA, "--answer-column", "solution",
    "--reward-funcs", "examples/r1_rewards.py:format_reward", "examples/r1_rewards.py:accuracy_reward",
    "--reward-weights", "0.5", "1", "--num-prompts", "4", "--group-size", "8", "--learning-rate", "1e-5", "--beta", "0",
    "--total-steps", "16", "--eval-every", "8", "--num-eval", "200",
]  # fmt: skip
PARTIAL_FLAGS = ["--reward-funcs", "examples/partial_credit.py:digits_in_place"]


@dataclass
class Args:
    seeds: tuple[int, ...] = (1, 2, 3)
    """the seeds to run (those with a record already are not run again)"""
    runs_dir: str = "runs/reward-funcs"
    """where the runs write their output"""
    parts: tuple[str, ...] = ("r1", "partial")
    """r1 (SmolLM2, several minutes a step on two cores) and partial (the built-in model)"""


def command(part: str, seed: int, runs_dir: str) -> list[str]:
    """The grpo.py command of one run (the page shows it)."""
    model = ["--model-name-or-path", prepare_smollm2.model_dir()] if part == "r1" else []
    flags = [f.replace(CHAT_DATA, os.path.join(runs_dir, CHAT_DATA)) for f in R1_FLAGS] if part == "r1" else PARTIAL_FLAGS
    output = ["--seed", str(seed), "--output-dir", os.path.join(runs_dir, f"{part}-seed{seed}")]
    return [sys.executable, "grpo.py", *model, *flags, *output]


def record_path(part: str, seed: int) -> str:
    return os.path.join(RECORDS, f"{part}-seed{seed}.jsonl")


def run_missing(args: Args) -> None:
    """Each run without a record, one after another; its metrics.jsonl becomes the record, with the whole command's
    minutes as a last line."""
    os.makedirs(RECORDS, exist_ok=True)
    if "r1" in args.parts:
        os.makedirs(args.runs_dir, exist_ok=True)
        subprocess.run(
            [sys.executable, "examples/make_chat_sums.py", os.path.join(args.runs_dir, CHAT_DATA)], cwd=ROOT, check=True
        )
    for part in args.parts:
        for seed in args.seeds:
            if os.path.isfile(record_path(part, seed)):
                continue
            start = time.time()
            shutil.rmtree(os.path.join(args.runs_dir, f"{part}-seed{seed}"), ignore_errors=True)  # one cut short, if any
            subprocess.run(command(part, seed, args.runs_dir), cwd=ROOT, check=True)
            save_record(part, seed, os.path.join(args.runs_dir, f"{part}-seed{seed}"), (time.time() - start) / 60)


def save_record(part: str, seed: int, output_dir: str, minutes: float) -> None:
    shutil.copy(os.path.join(output_dir, "metrics.jsonl"), record_path(part, seed))
    with open(record_path(part, seed), "a") as f:
        f.write(json.dumps({"command_minutes": round(minutes, 1)}) + "\n")


def load(part: str, seed: int) -> tuple[list[dict], float]:
    with open(record_path(part, seed)) as f:
        lines = [json.loads(line) for line in f]
    return lines[:-1], lines[-1]["command_minutes"]


def mean_over(rows: list[dict], key: str, steps: range) -> float:
    values = [r[key] for r in rows if r["step"] in steps and key in r]
    return sum(values) / len(values)


def first_to_last(rows: list[dict], key: str, first: range, last: range) -> str:
    return f"{mean_over(rows, key, first):.3f} -> {mean_over(rows, key, last):.3f}"


def evaluations(rows: list[dict]) -> str:
    return " -> ".join(f"{100 * r['eval/accuracy']:.1f}%" for r in rows if "eval/accuracy" in r)


def r1_table(seeds) -> list[str]:
    lines = [
        "| seed | format reward, steps 1-4 -> 13-16 | accuracy reward, steps 1-4 -> 13-16 "
        "| held-out accuracy at steps 0, 8, 16 | greedy length at 16 (tokens) | minutes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for seed in seeds:
        rows, minutes = load("r1", seed)
        steps = (range(1, 5), range(13, 17))
        length = rows[-1]["eval/response_length"]
        lines.append(
            f"| {seed} | {first_to_last(rows, 'reward/format_reward', *steps)} "
            f"| {first_to_last(rows, 'reward/accuracy_reward', *steps)} | {evaluations(rows)} "
            f"| {length:.1f} | {minutes:.1f} |"
        )
    return lines


def partial_table(seeds) -> list[str]:
    lines = [
        "| seed | partial credit, steps 1-10 -> 191-200 | exact answers in the rollouts, steps 1-10 -> 191-200 "
        "| held-out accuracy (exact) at steps 0, 100, 200 | minutes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for seed in seeds:
        rows, minutes = load("partial", seed)
        steps = (range(1, 11), range(191, 201))
        held_out = " -> ".join(f"{100 * r['eval/accuracy']:.1f}%" for r in rows if r["step"] in (0, 100, 200))
        lines.append(
            f"| {seed} | {first_to_last(rows, 'reward/digits_in_place', *steps)} "
            f"| {first_to_last(rows, 'rollout/gold_accuracy', *steps)} | {held_out} | {minutes:.1f} |"
        )
    return lines


def plot(seeds) -> None:
    """Per step, each seed: the two rewards of the R1-style run (their means over the step's 32 responses) and its
    held-out accuracy at the evaluations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [("reward/format_reward", "format reward (rollouts)"), ("reward/accuracy_reward", "accuracy reward (rollouts)")]
    panels.append(("eval/accuracy", "held-out accuracy (greedy, 200 problems)"))
    for axis, (key, title) in zip(axes, panels):
        for seed in seeds:
            rows, _ = load("r1", seed)
            points = [(r["step"], r[key]) for r in rows if key in r]
            axis.plot(*zip(*points), marker="o" if key.startswith("eval") else None, label=f"seed {seed}")
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step")
        axis.set_ylim(0, 1)
    axes[0].legend()
    figure.suptitle("grpo.py on SmolLM2-135M-Instruct: 0.5 x format + 1 x accuracy (examples/r1_rewards.py)", fontsize=11)
    figure.tight_layout()
    figure.savefig(CHART, dpi=100)


if __name__ == "__main__":
    args = tyro.cli(Args)
    run_missing(args)
    seeds = [s for s in args.seeds if os.path.isfile(record_path("r1", s))]
    if seeds:
        print("\n".join(r1_table(seeds)))
        plot(seeds)
    seeds = [s for s in args.seeds if os.path.isfile(record_path("partial", s))]
    if seeds:
        print("\n".join(partial_table(seeds)))
