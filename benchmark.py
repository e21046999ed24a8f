"""Reference results: every algorithm with its default settings, over several seeds, on each built-in task.

    pip install matplotlib                    # only this script needs it
    python benchmark.py                       # 2 tasks x 7 algorithms x 3 seeds, one after another (hours on a CPU)
    python benchmark.py --tasks addition      # one task: about 70 minutes on a 2-core CPU
    python benchmark.py --quick               # a sanity check of the pipeline (one seed, the first task): 3 minutes

Each run writes runs/benchmark/<task>/<algorithm>__<seed>/metrics.jsonl; complete runs are reused unless --fresh, so
an interrupted benchmark resumes where it stopped. The charts and a markdown table of each task go to docs/<task>/.
Runs are sequential, so that the wall-clock times are comparable.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import tyro

import common

ALGORITHMS = ["grpo", "rloo", "dr_grpo", "dapo", "gspo", "ppo", "dpo"]
TARGET = {"addition": 0.9, "scratchpad": 0.6}  # the accuracy of the "minutes to X%" column


@dataclass
class Args:
    tasks: list[str] = field(default_factory=lambda: list(common.BUILTIN_TASKS))
    """which built-in tasks"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of every algorithm"""
    algorithms: list[str] = field(default_factory=lambda: list(ALGORITHMS))
    """which scripts to run"""
    quick: bool = False
    """a few steps, the first seed and the first task, to check the pipeline (to runs/benchmark-quick and docs/quick)"""
    fresh: bool = False
    """rerun even when a complete metrics.jsonl exists"""
    runs_dir: str = "runs/benchmark"
    """where the runs go"""
    docs_dir: str = "docs"
    """where the charts and the table go"""


def run_all(args: Args, task: str) -> dict:
    """Run (or reuse) every algorithm x seed on `task`; return {algorithm: [rows of each seed's metrics.jsonl]}."""
    results = {}
    start = time.time()  # the built-in warm-up, once, outside every run's clock (instant when cached)
    subprocess.run([sys.executable, "-c", f"import common; common.resolve_model_path('builtin', '', {task!r})"], check=True)
    print(f"{task}: built-in warm-up model ready after {time.time() - start:.0f}s", flush=True)
    for algorithm in args.algorithms:
        results[algorithm] = []
        for seed in args.seeds:
            out = os.path.join(args.runs_dir, task, f"{algorithm}__{seed}")
            path = os.path.join(out, "metrics.jsonl")
            if args.fresh or not complete(path):
                flags = ["--task", task, "--seed", str(seed), "--output-dir", out]
                if args.quick:
                    flags += ["--total-steps", "10", "--eval-every", "5"] + (
                        ["--num-pair-prompts", "300"] if algorithm == "dpo" else []
                    )
                print(f"{task}: {algorithm} seed {seed} ...", flush=True)
                start = time.time()
                env = {**os.environ, "TQDM_DISABLE": "1"}
                done = subprocess.run([sys.executable, f"{algorithm}.py", *flags], env=env, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{task}: {algorithm} seed {seed} failed:\n{done.stderr[-3000:]}")
                print(f"  {time.time() - start:.0f}s: {done.stdout.strip().splitlines()[-1]}", flush=True)
                with open(os.path.join(out, "command.json"), "w") as f:
                    json.dump({"seconds": time.time() - start}, f)  # the whole command: loading, training, evaluation
            with open(path) as f:
                rows = [json.loads(line) for line in f]
            if os.path.isfile(os.path.join(out, "command.json")):
                with open(os.path.join(out, "command.json")) as f:
                    rows[0]["time/command"] = json.load(f)["seconds"]
            results[algorithm].append(rows)
    return results


def complete(path: str) -> bool:
    """A run is complete when it saved its final model, which every script does after its last step."""
    return os.path.isfile(path) and os.path.isfile(os.path.join(os.path.dirname(path), "model", "config.json"))


def series(runs, key, x="time/elapsed"):
    """Per seed, the (x, y) points where `key` was logged."""
    value = lambda r: r.get(x, 0)  # (the step-0 evaluation has generated no responses yet)
    return [[(value(r), r[key]) for r in rows if key in r] for rows in runs]


def summary_table(results: dict, target: float) -> str:
    lines = [
        "| algorithm | start accuracy | end accuracy | minutes (command) | minutes (training) "
        f"| minutes to {target:.0%} | median step (s) | responses generated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    spread = lambda xs: f"{statistics.mean(xs):.3f} ± {statistics.pstdev(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"
    span = lambda xs: f"{statistics.mean(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
    for algorithm, runs in results.items():
        start = [rows[0]["eval/accuracy"] for rows in runs]
        end = [rows[-1]["eval/accuracy"] for rows in runs]
        minutes = [rows[-1]["time/elapsed"] / 60 for rows in runs]
        command = [rows[0]["time/command"] / 60 for rows in runs if "time/command" in rows[0]]
        steps = statistics.median(r["time/step"] for rows in runs for r in rows if "time/step" in r)
        responses = statistics.mean(rows[-1].get("train/responses", 0) for rows in runs)
        to_target = [minutes_to(rows, target) for rows in runs]
        to_target = span(to_target) if None not in to_target else "not reached"
        cells = [
            algorithm,
            spread(start),
            spread(end),
            span(command) if len(command) == len(runs) else "-",
            span(minutes),
            to_target,
            f"{steps:.2f}",
            f"{responses:,.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def minutes_to(rows, accuracy: float):
    """Wall-clock minutes until the first evaluation at or above `accuracy` (None if never)."""
    hits = [r.get("time/elapsed", 0) / 60 for r in rows if r.get("eval/accuracy", -1) >= accuracy]
    return hits[0] if hits else None


def plot(results: dict, key: str, ylabel: str, path: str, x: str = "time/elapsed", xlabel: str = "wall-clock minutes"):
    """Mean over seeds with a min-max band, for every algorithm that logs `key`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    for algorithm, runs in results.items():
        per_seed = [s for s in series(runs, key, x) if s]
        if not per_seed:
            continue
        n = min(len(s) for s in per_seed)  # seeds log at the same steps; align on the shortest
        xs = [statistics.mean(s[i][0] for s in per_seed) for i in range(n)]
        xs = [v / 60 for v in xs] if x == "time/elapsed" else xs
        ys = [[s[i][1] for s in per_seed] for i in range(n)]
        ax.plot(xs, [statistics.mean(y) for y in ys], label=algorithm)
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.2)
        drawn = True
    if drawn:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)


def zero_variance_fraction(results: dict) -> dict:
    """Add rollout/zero_std_frac = all-correct + all-wrong group fractions, where both are logged."""
    for runs in results.values():
        for rows in runs:
            for r in rows:
                if "rollout/all_correct_frac" in r and "rollout/all_wrong_frac" in r:
                    r["rollout/zero_std_frac"] = r["rollout/all_correct_frac"] + r["rollout/all_wrong_frac"]
    return results


if __name__ == "__main__":
    args = tyro.cli(Args)
    unknown = set(args.algorithms) - set(ALGORITHMS)
    if unknown:
        raise SystemExit(f"--algorithms: unknown {sorted(unknown)}; allowed: {', '.join(ALGORITHMS)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("benchmark.py draws its charts with matplotlib: pip install matplotlib") from None
    if args.quick:
        args.tasks, args.seeds, args.runs_dir, args.docs_dir = (
            args.tasks[:1],
            args.seeds[:1],
            args.runs_dir + "-quick",
            os.path.join(args.docs_dir, "quick"),
        )
    if not args.seeds:
        raise SystemExit("--seeds: give at least one seed")
    if not args.tasks or set(args.tasks) - set(common.BUILTIN_TASKS):
        raise SystemExit(f"--tasks {' '.join(args.tasks)}: allowed values are {', '.join(common.BUILTIN_TASKS)}")
    for flag, path in (("--runs-dir", args.runs_dir), ("--docs-dir", args.docs_dir)):  # before an hour of runs
        common.check_writable_dir(flag, path)
    for task in args.tasks:
        results = zero_variance_fraction(run_all(args, task))
        d = os.path.join(args.docs_dir, task)
        os.makedirs(d, exist_ok=True)
        plot(results, "eval/accuracy", "greedy held-out accuracy", f"{d}/accuracy_vs_time.png")
        responses = ("train/responses", "responses generated")
        plot(results, "eval/accuracy", "greedy held-out accuracy", f"{d}/accuracy_vs_responses.png", *responses)
        plot(results, "kl/ref", "KL to the reference (per token)", f"{d}/kl_ref.png")
        plot(results, "rollout/response_length", "sampled response length (tokens)", f"{d}/response_length.png")
        plot(results, "rollout/response_length_correct", "length of correct responses (tokens)", f"{d}/length_correct.png")
        plot(results, "rollout/response_length_wrong", "length of wrong responses (tokens)", f"{d}/length_wrong.png")
        plot(results, "rollout/truncated_frac", "fraction of responses truncated", f"{d}/truncated.png")
        plot(results, "train/clip_frac_high", "clip fraction, positive advantages", f"{d}/clip_frac_high.png")
        plot(results, "train/clip_frac_low", "clip fraction, negative advantages", f"{d}/clip_frac_low.png")
        plot(results, "rollout/zero_std_frac", "fraction of zero-variance groups", f"{d}/zero_variance_groups.png")
        table = summary_table(results, TARGET[task])
        with open(f"{d}/results.md", "w") as f:
            f.write(f"Task {task}; seeds {args.seeds}; mean ± population std (min-max) over seeds.\n\n{table}\n")
        print(f"{task}:\n{table}")
