"""Reference results: every algorithm with its default settings, over several seeds, on each built-in task.

    pip install matplotlib                           # only this script needs it
    python -m benchmarks.benchmark                   # 2 tasks x 16 algorithms x 3 seeds, one after another (hours on a CPU)
    python -m benchmarks.benchmark --tasks addition  # one task
    python -m benchmarks.benchmark --quick           # a sanity check of the pipeline (one seed, the first task): 3 minutes
    python -m benchmarks.benchmark --tools           # tool use: grpo_tools.py against grpo.py on the multiplication task

Each run writes runs/benchmark/<task>/<algorithm>__<seed>/metrics.jsonl; complete runs are reused unless --fresh, so
an interrupted benchmark resumes where it stopped. The charts and a markdown table of each task go to docs/<task>/.
Runs are sequential, so that the wall-clock times are comparable.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import tyro

import common
import tasks
from plumbing import checks

ALGORITHMS = ["grpo", "rloo", "dr_grpo", "dapo", "gspo", "ppo", "dpo", "cispo", "reinforce_pp", "sapo", "opd", "maxrl"]
ALGORITHMS += ["ipo", "simpo", "orpo", "kto"]
PREFERENCE = {"dpo", "ipo", "simpo", "orpo", "kto"}  # trained on pairs built before training: no sampling, no pass@k
TARGET = {"addition": 0.9, "scratchpad": 0.6}  # the accuracy of the "minutes to X%" column


@dataclass
class Args:
    tasks: list[str] = field(default_factory=lambda: ["addition", "scratchpad"])
    """which built-in tasks"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of every algorithm"""
    algorithms: list[str] = field(default_factory=lambda: list(ALGORITHMS))
    """which scripts to run"""
    eval_every: int = 0
    """evaluate every N steps in every run (0: each script's default, every 5,120 responses on the built-in tasks); a
    finer grid shows when each run first reaches the target accuracy more exactly (use another --runs-dir)"""
    eval_samples: int = 0
    """pass every RL script --eval-samples N: its evaluations also log eval/pass@k from N responses per held-out
    problem, and the table gets a pass@k section (use another --runs-dir: the runs differ only in what they log)"""
    quick: bool = False
    """a few steps, the first seed and the first task, to check the pipeline (to runs/benchmark-quick and docs/quick)"""
    fresh: bool = False
    """rerun even when a complete metrics.jsonl exists"""
    no_run: bool = False
    """run nothing: the tables and charts of the complete runs already there; an algorithm with fewer of --seeds is named
    with its seeds (e.g. "cispo (seed 1)"), one with none is left out"""
    runs_dir: str = "runs/benchmark"
    """where the runs go"""
    docs_dir: str = "docs"
    """where the charts and the table go"""
    rlhf: bool = False
    """instead of the table: the learned-reward pipeline on addition, reward_model.py then ppo.py --reward-model for
    --rlhf-steps steps (one seed), into RUNS_DIR/rlhf, with its chart and summary in DOCS_DIR/rlhf"""
    rlhf_steps: int = 200
    """ppo.py steps against the learned reward model: long enough to see whether the gold accuracy follows the proxy"""
    rlhf_betas: list[float] = field(default_factory=lambda: [0.5, 0.05])
    """one ppo.py run against the reward model per KL coefficient --beta (0.05: ppo.py's default, tuned for the verifier)"""
    tools: bool = False
    """instead of the table: the multiplication task, from its one cached warm-up, with grpo_tools.py, with grpo.py (no
    tools) and with a copy of grpo_tools.py whose one changed line trains on the environment's tokens too, for --seeds
    (into RUNS_DIR/tools, with its table, chart and trajectories in DOCS_DIR/tools)"""
    memory: bool = False
    """instead of the table: the peak memory of one log-prob pass at Qwen2.5's vocabulary (8 responses of 256 tokens),
    without and with a gradient, against its fp32 logits, each in a fresh process (to DOCS_DIR/memory.md)"""


def run_all(args: Args, task: str) -> dict:
    """Run (or reuse) every algorithm x seed on `task`; return {algorithm: [rows of each seed's metrics.jsonl]}."""
    results = {}
    start = time.time()  # the built-in warm-up, once, outside every run's clock (instant when cached)
    warm_up = f"from plumbing import models; models.resolve_model_path('builtin', '', {task!r})"
    subprocess.run([sys.executable, "-c", warm_up], check=True)
    print(f"{task}: built-in warm-up model ready after {time.time() - start:.0f}s", flush=True)
    for algorithm in args.algorithms:
        results[algorithm] = []
        for seed in args.seeds:
            flags = ["--task", task, "--seed", str(seed)] + (["--eval-every", str(args.eval_every)] if args.eval_every else [])
            flags += ["--eval-samples", str(args.eval_samples)] if args.eval_samples and algorithm not in PREFERENCE else []
            if args.quick:
                flags += ["--total-steps", "10", "--eval-every", "5"] + (
                    ["--num-pair-prompts", "300"] if algorithm in PREFERENCE else []
                )
            if algorithm == "opd":  # its teacher: grpo.py's model of the same task and seed, from the same warm-up
                teacher = os.path.join(args.runs_dir, task, f"grpo__{seed}", "model")
                if not complete(os.path.join(os.path.dirname(teacher), "metrics.jsonl")):
                    raise SystemExit(f"opd needs the teacher {teacher}: run grpo first (--algorithms grpo opd)")
                flags += ["--teacher", teacher]
            out = os.path.join(args.runs_dir, task, f"{algorithm}__{seed}")
            if args.no_run and not complete(os.path.join(out, "metrics.jsonl")):
                print(f"{task}: {algorithm} seed {seed}: no complete run in {out}, left out (--no-run)", flush=True)
                continue
            results[algorithm].append(run_once(algorithm, flags, out, args.fresh, f"{task}: {algorithm} seed {seed}"))
        seeds = [s for s in args.seeds if complete(os.path.join(args.runs_dir, task, f"{algorithm}__{s}", "metrics.jsonl"))]
        runs = results.pop(algorithm)
        if runs:
            results[name_with_seeds(algorithm, seeds, args.seeds)] = runs
    return results


def name_with_seeds(algorithm: str, seeds: list[int], asked: list[int]) -> str:
    """The algorithm's name in tables and legends, with its seeds when it has fewer than were asked for."""
    return (
        algorithm if len(seeds) == len(asked) else f"{algorithm} (seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))})"
    )


def run_once(script: str, flags: list[str], out: str, fresh: bool, label: str) -> list[dict]:
    """`python SCRIPT.py FLAGS --output-dir OUT`, unless a complete run is already there (and not `fresh`); return the
    rows of its metrics.jsonl, the first one with time/command (the whole command's seconds) when it was recorded."""
    path = os.path.join(out, "metrics.jsonl")
    if fresh or not complete(path):
        print(f"{label} ...", flush=True)
        start = time.time()
        python_path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))  # a copy elsewhere too
        env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": python_path}
        shutil.rmtree(out, ignore_errors=True)  # a run to replace, or one cut short: the scripts refuse to write over a run
        cmd = [sys.executable, f"{script}.py", *flags, "--output-dir", out]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{label} failed:\n{done.stderr[-3000:]}")
        print(f"  {time.time() - start:.0f}s: {done.stdout.strip().splitlines()[-1]}", flush=True)
        with open(os.path.join(out, "command.json"), "w") as f:
            json.dump({"seconds": time.time() - start}, f)  # the whole command: loading, training, evaluation
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    if os.path.isfile(os.path.join(out, "command.json")):
        with open(os.path.join(out, "command.json")) as f:
            rows[0]["time/command"] = json.load(f)["seconds"]
    return rows


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
        f"| minutes to {target:.0%} | responses to {target:.0%}, each seed | median step (s) | responses generated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
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
        responses_to = " / ".join(
            f"{n:,}" if n is not None else "-" for n in (responses_to_reach(rows, target) for rows in runs)
        )
        cells = [
            algorithm,
            spread(start),
            spread(end),
            span(command) if len(command) == len(runs) else "-",
            span(minutes),
            to_target,
            responses_to,
            f"{steps:.2f}",
            f"{responses:,.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pass_at_k_table(results: dict) -> str:
    """Greedy accuracy beside pass@k (sampled at each script's temperature) at the first and the last evaluation, for
    the algorithms whose runs logged it (--eval-samples); empty when none did."""
    ks = sorted({int(key.split("@")[1]) for runs in results.values() for key in runs[0][-1] if key.startswith("eval/pass@")})
    logged = {algorithm: runs for algorithm, runs in results.items() if all("eval/pass@1" in rows[-1] for rows in runs)}
    if not ks or not logged:
        return ""
    lines = ["| algorithm | evaluation | greedy accuracy | " + " | ".join(f"pass@{k}" for k in ks) + " |"]
    lines.append("| --- | --- | --- |" + " --- |" * len(ks))
    spread = lambda xs: f"{statistics.mean(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"
    for algorithm, runs in logged.items():
        for when, index in (("start", 0), ("end", -1)):
            cells = [spread([rows[index][key] for rows in runs]) for key in ["eval/accuracy"] + [f"eval/pass@{k}" for k in ks]]
            lines.append(f"| {algorithm} | {when} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def minutes_to(rows, accuracy: float):
    """Wall-clock minutes until the first evaluation at or above `accuracy` (None if never)."""
    hits = [r.get("time/elapsed", 0) / 60 for r in rows if r.get("eval/accuracy", -1) >= accuracy]
    return hits[0] if hits else None


def responses_to_reach(rows, accuracy: float):
    """Responses generated before the first evaluation at or above `accuracy` (None if never): on the grid of the
    evaluations, so a run that crosses between two of them is counted at the later one."""
    hits = [r.get("train/responses", 0) for r in rows if r.get("eval/accuracy", -1) >= accuracy]
    return hits[0] if hits else None


# The KL estimator each script logs as kl/ref (per token, in nats): k3 in grpo.py's and sapo.py's loss, k1 of the reward
# penalty in rloo.py and ppo.py, k2 in reinforce_pp.py's loss; the other scripts log it only with --beta > 0 (k3).
KL_ESTIMATOR = {"grpo": "k3", "rloo": "k1", "ppo": "k1", "dr_grpo": "k3", "dapo": "k3", "gspo": "k3", "reinforce_pp": "k2"}


HUES = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
HUES += ["black"]  # matplotlib's tab10, then black: 11 hues, one for each RL script


def line_style(algorithm: str, others: list[str] = ()) -> dict:
    """Each script's own colour in every chart, so that 16 curves stay apart: the RL scripts one hue each (in the order
    of ALGORITHMS), the preference family dashed in the first five; a name with its seeds ("cispo (seed 1)") keeps its
    script's style. A run that is no script of ALGORITHMS (the runs of --tools) takes the hue of its place in `others`."""
    name = algorithm.split(" (")[0]
    rl = [a for a in ALGORITHMS if a not in PREFERENCE]
    family = [a for a in ALGORITHMS if a in PREFERENCE]
    if name in rl:
        index = rl.index(name)
    elif name in family:
        index = family.index(name)
    else:
        index = list(others).index(algorithm) if algorithm in others else len(HUES) - 1
    return {"color": HUES[index % len(HUES)], "linestyle": "--" if name in PREFERENCE else "-"}


def start_accuracy(rows: list[dict]):
    """The held-out accuracy of a run's first evaluation, before any training step (None if it logged none)."""
    return next((r["eval/accuracy"] for r in rows if "eval/accuracy" in r), None)


def start_lines(results: dict) -> list[tuple[float, str, str]]:
    """The dashed reference lines of an accuracy chart, as (accuracy, label, colour): one grey line when every run
    starts alike (the warm-up's accuracy), else one for each distinct start, named with its runs and in the colour of
    the first of them, so that two starts are never averaged into a line that no run started from."""
    starts = {}  # start accuracy: the runs that start there
    for algorithm, runs in results.items():
        for rows in runs:
            start = start_accuracy(rows)
            if start is not None and algorithm not in starts.setdefault(start, []):
                starts[start].append(algorithm)
    if len(starts) == 1:
        (start,) = starts
        return [(start, f"start (warm-up): {start:.1%}", "gray")]
    others = [a for a in results if a.split(" (")[0] not in ALGORITHMS]
    return [(s, f"start of {', '.join(names)}: {s:.1%}", line_style(names[0], others)["color"]) for s, names in starts.items()]


def place_legend(fig, ax, entries: int) -> None:
    """The legend inside the axes for a few curves, beside them (outside the plotted area) for many."""
    if entries <= 8:
        ax.legend(fontsize=8)
    else:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.set_size_inches(9.5, 4.6)


def plot(results: dict, key: str, title: str, ylabel: str, path: str, x: str = "step", window: int = 10, label=None) -> bool:
    """Mean over seeds with a min-max band, for every algorithm that logs `key`, against `x` ("step", or
    "train/responses": responses generated); an algorithm whose seeds start at different accuracies gets one curve per
    seed instead, never their mean. Per-step metrics are smoothed (a trailing mean over `window` logged points; 1 for
    evaluations). Evaluations get each start as a reference line (`start_lines`). Nothing is written when no algorithm
    logs `key`; returns whether the chart was written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    others = [a for a in results if a.split(" (")[0] not in ALGORITHMS]  # runs that are no script of ALGORITHMS: --tools
    for algorithm, runs in results.items():
        per_seed = [s for s in series(runs, key, x) if s]
        if not per_seed:
            continue
        n = min(len(s) for s in per_seed)  # seeds log at the same steps; align on the shortest
        xs = [statistics.mean(s[i][0] for s in per_seed) for i in range(n)]
        smoothed = [smooth([y for _, y in s[:n]], window) for s in per_seed]
        ys = [[s[i] for s in smoothed] for i in range(n)]
        style, name = line_style(algorithm, others), label(algorithm) if label else algorithm
        if len({start_accuracy(rows) for rows in runs}) > 1:  # seeds that start apart (other warm-ups): each seed alone
            for i, s in enumerate(smoothed):
                ax.plot([p[0] for p in per_seed[i][:n]], s, label=f"{name} (each seed)" if i == 0 else None, **style)
        elif n > 2 and len(set(xs[1:])) == 1:  # x stands still after the start (responses generated before training only,
            mean, low, high = statistics.mean(ys[-1]), min(ys[-1]), max(ys[-1])  # the preference family): its end, there
            ax.errorbar(xs[-1:], [mean], [[mean - low], [high - mean]], fmt="o", capsize=3, label=name, color=style["color"])
        else:
            ax.plot(xs, [statistics.mean(y) for y in ys], label=name, **style)
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.15, color=style["color"])
        drawn = True
    if drawn:
        if key == "eval/accuracy":
            for start, start_label, color in start_lines(results):
                ax.axhline(start, color=color, linestyle=":" if color != "gray" else "--", linewidth=1, label=start_label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel({"step": "step (one rollout and its updates; DPO: one optimizer step)"}.get(x, "responses generated"))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        place_legend(fig, ax, len(ax.get_legend_handles_labels()[1]))
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    elif os.path.exists(path):
        os.remove(path)  # a chart of an earlier run that nothing draws now
    plt.close(fig)
    return drawn


def plot_zero_variance(results: dict, title: str, path: str) -> None:
    """Two panels: the fraction of groups whose responses are all correct, and all wrong (smoothed per step); nothing is
    written when no algorithm samples groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, what in zip(axes, ("rollout/all_correct_frac", "rollout/all_wrong_frac"), ("all correct", "all wrong")):
        for algorithm, runs in results.items():
            per_seed = [s for s in series(runs, key, "step") if s]
            if not per_seed:
                continue
            n = min(len(s) for s in per_seed)
            smoothed = [smooth([y for _, y in s[:n]]) for s in per_seed]
            ys = [[s[i] for s in smoothed] for i in range(n)]
            xs = [per_seed[0][i][0] for i in range(n)]
            style = line_style(algorithm)
            ax.plot(xs, [statistics.mean(y) for y in ys], label=algorithm, **style)
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.15, color=style["color"])
        ax.set_title(f"groups whose responses are {what}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of the step's groups")
    entries = len(axes[0].get_legend_handles_labels()[1])
    if entries:  # (the preference family samples no groups: nothing to draw for it alone)
        if entries <= 8:
            axes[0].legend(fontsize=8)
        else:
            axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
            fig.set_size_inches(13, 4.6)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    elif os.path.exists(path):
        os.remove(path)  # a chart of an earlier run that nothing draws now
    plt.close(fig)


def plot_task(results: dict, task: str, d: str) -> None:
    """Every chart of one task into the folder d."""
    n = len(next(iter(results.values())))
    seeds = f"mean of {n} seeds, band: min to max" if n > 1 else "one seed"
    smoothed, evals = f"\n({seeds}; 10-step trailing mean)", f"\n(greedy, on the held-out problems; {seeds})"
    accuracy = ("eval/accuracy", f"{task}: held-out accuracy{evals}", "greedy accuracy (fraction correct)")
    plot(results, *accuracy, f"{d}/accuracy_vs_responses.png", "train/responses", window=1)
    plot(results, *accuracy, f"{d}/accuracy_vs_steps.png", "step", window=1)
    kl = lambda algorithm: f"{algorithm} ({KL_ESTIMATOR.get(algorithm, 'k3')})"
    kl_title, kl_unit = f"{task}: KL to the reference{smoothed}", "nats per token (estimator in the legend)"
    plot(results, "kl/ref", kl_title, kl_unit, f"{d}/kl_ref.png", label=kl)
    for key, what, unit, name in (
        ("rollout/response_length", "length of sampled responses", "tokens (EOS included)", "response_length"),
        ("rollout/response_length_correct", "length of correct sampled responses", "tokens (EOS included)", "length_correct"),
        ("rollout/response_length_wrong", "length of wrong sampled responses", "tokens (EOS included)", "length_wrong"),
        ("rollout/truncated_frac", "responses cut at --max-new-tokens", "fraction of the step's responses", "truncated"),
        ("train/clip_frac_high", "clipped tokens with a positive advantage", "fraction of valid tokens", "clip_frac_high"),
        ("train/clip_frac_low", "clipped tokens with a negative advantage", "fraction of valid tokens", "clip_frac_low"),
        ("kl/teacher", "reverse KL to the teacher (opd.py)", "nats per token (k1)", "kl_teacher"),
    ):
        plot(results, key, f"{task}: {what}{smoothed}", unit, f"{d}/{name}.png")
    title = f"{task}: zero-variance groups, which get no gradient from a group baseline{smoothed}"
    plot_zero_variance(results, title, f"{d}/zero_variance_groups.png")


# The one line that the experiment of docs/tools.md changes in a copy of grpo_tools.py: the loss mask becomes every id of
# the conversation, the environment's too.
MASKED_LINE = "        mask = conversations.by_model  # (B, T)  # TOOLS: the loss mask: only the ids the model sampled\n"
TRAINED_LINE = "        mask = conversations.valid  # (B, T)  # EXPERIMENT: the environment's ids are trained on too\n"
TOOL_RUNS = {  # name in the table: (script, flags)
    "grpo_tools": ("grpo_tools", []),
    "grpo.py (no tools)": ("grpo", ["--task", "multiplication", "--total-steps", "40"]),  # grpo_tools.py's steps
    "grpo_tools, environment's ids trained on": ("grpo_tools_environment_trained", []),
}


def run_tools(args: Args) -> dict:
    """Every run of TOOL_RUNS for every seed on the multiplication task, from the same cached warm-up. The copy of
    grpo_tools.py with TRAINED_LINE is written into RUNS_DIR/tools and run from there. Returns {name: [rows per seed]}."""
    out = os.path.join(args.runs_dir, "tools")
    os.makedirs(out, exist_ok=True)
    with open("grpo_tools.py") as f:
        source = f.read()
    if source.count(MASKED_LINE) != 1:
        raise SystemExit("benchmark.py --tools: grpo_tools.py no longer has MASKED_LINE; update benchmark.py")
    with open(os.path.join(out, "grpo_tools_environment_trained.py"), "w") as f:
        f.write(source.replace(MASKED_LINE, TRAINED_LINE))
    warm_up = "from plumbing import models; models.resolve_model_path('builtin', '', 'multiplication')"
    subprocess.run([sys.executable, "-c", warm_up], check=True)
    results = {}
    for name, (script, flags) in TOOL_RUNS.items():
        path = os.path.join(out, script) if script.endswith("_trained") else script
        results[name] = [
            run_once(
                path,
                [*flags, "--seed", str(seed)],
                os.path.join(out, f"{script}__{seed}"),
                args.fresh,
                f"tools: {name} seed {seed}",
            )
            for seed in args.seeds
        ]
    return results


def tools_summary(results: dict) -> str:
    """The table of every run (summary_table at 90%), then per run the tool metrics of the last evaluation and of the
    first and last training steps, each the mean over seeds."""
    lines = [summary_table(results, 0.9), ""]
    lines += [
        "| run | called a tool (held out, greedy) | accuracy with a call | without a call | log-prob of the tools' answers, "
        "first step -> last (nats per token) | tokens by the model / by the environment (samples, last step) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        evals = [[r for r in rows if "eval/accuracy" in r][-1] for rows in runs]
        firsts = [[r for r in rows if "rollout/gold_accuracy" in r][0] for rows in runs]
        lasts = [[r for r in rows if "rollout/gold_accuracy" in r][-1] for rows in runs]
        cells = [name]
        for key in ("eval/called_tool_frac", "eval/accuracy_with_call", "eval/accuracy_without_call"):
            cells.append(f"{mean_of(evals, key):.3f}" if mean_of(evals, key) is not None else "-")
        probe = "train/environment_logprob"
        cells.append(
            f"{mean_of(firsts, probe):.2f} -> {mean_of(lasts, probe):.2f}" if mean_of(lasts, probe) is not None else "-"
        )
        by_model, by_env = mean_of(lasts, "rollout/tokens_by_model"), mean_of(lasts, "rollout/tokens_by_environment")
        cells.append(f"{by_model:.1f} / {by_env:.1f}" if by_model is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def without_the_tool(results_dir: str) -> list[str]:
    """Each run's final model (seed 1) on the held-out problems with nobody to answer its calls: how often it writes a
    call (one greedy turn, as grpo.py samples), and after the call "a*b" of each problem, the probability it gives "[",
    the first id of the tool's answer, which only the environment ever writes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = list(tasks.make_task("multiplication").eval["prompt"])
    lines = ['| run (seed 1) | writes a call | probability of "[" after its call (mean) |', "| --- | --- | --- |"]
    for name, (script, _) in TOOL_RUNS.items():
        path = os.path.join(results_dir, f"{script}__1", "model")
        tokenizer, model = AutoTokenizer.from_pretrained(path, padding_side="left"), AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            ids, mask = common.tokenize_prompts(tokenizer, prompts, torch.device("cpu"))
            texts = common.decode(tokenizer, *common.generate(model.eval(), tokenizer, ids, mask, 32, 0.0))
            ids, mask = common.tokenize_prompts(tokenizer, [f"{p}<{p[:-1]}>" for p in prompts], torch.device("cpu"))
            logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0)).logits[:, -1]
        bracket = torch.softmax(logits.float(), dim=-1)[:, tokenizer.convert_tokens_to_ids("[")].mean().item()
        lines.append(f"| {name} | {sum(t.startswith('<') for t in texts) / len(texts):.1%} | {bracket:.3f} |")
    return lines


def mean_of(rows: list[dict], key: str):
    """The mean of `key` over the rows that logged it (None if none did)."""
    values = [r[key] for r in rows if key in r]
    return statistics.mean(values) if values else None


def run_rlhf(args: Args) -> tuple[list[dict], dict[float, list[dict]]]:
    """The three stages on addition: the cached warm-up (sft.py), reward_model.py on dpo.py's verifier-labelled pairs,
    then ppo.py with --reward-model, the verifier only logged (the gold measure), once per --rlhf-betas. Returns the
    reward model's rows and {beta: the PPO run's rows}."""
    out = os.path.join(args.runs_dir, "rlhf")
    rm = run_once("reward_model", ["--seed", "1"], f"{out}/reward_model__1", args.fresh, "rlhf: reward_model")
    flags = ["--seed", "1", "--reward-model", f"{out}/reward_model__1/model", "--total-steps", str(args.rlhf_steps)]
    runs = {}
    for beta in args.rlhf_betas:
        label = f"rlhf: ppo against it, beta {beta}"
        runs[beta] = run_once(
            "ppo", [*flags, "--eval-every", "5", "--beta", str(beta)], f"{out}/ppo_beta{beta}__1", args.fresh, label
        )
    return rm, runs


def response_kl(row: dict) -> float:
    """KL to the reference per response (the k1 sum over its tokens, averaged over the batch): kl/ref is the mean over
    the batch's tokens and rollout/response_length their count per response, so their product is exactly that."""
    return row["kl/ref"] * row["rollout/response_length"]


def smooth(values: list[float], window: int = 10) -> list[float]:
    """Trailing moving average (the per-step rollout numbers are means over 256 responses, still noisy)."""
    return [statistics.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot_overoptimisation(runs: dict[float, list[dict]], path: str) -> None:
    """Per PPO run (one row per KL coefficient): the proxy (the learned reward the policy maximises) and the gold
    measure (the verifier's accuracy, on the sampled responses and greedy on the held-out problems) against the KL to
    the reference, and against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(len(runs), 2, figsize=(11, 4.2 * len(runs)), squeeze=False)
    for axes, (beta, ppo_rows) in zip(grid, runs.items()):
        plot_run(axes, ppo_rows)
        axes[1].set_title(f"ppo.py --reward-model ... --beta {beta}", fontsize=10)
    fig.suptitle("PPO against a learned reward model (addition; rollout curves: 10-step moving average)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_run(axes, ppo_rows: list[dict]) -> None:
    steps = [r for r in ppo_rows if "rollout/reward_mean" in r and "kl/ref" in r]
    evals = [r for r in ppo_rows if "eval/accuracy" in r]  # step 0 too: the warm-up, at KL 0
    for ax, x, xlabel in ((axes[0], response_kl, "KL to the reference per response (nats)"), (axes[1], None, "step")):
        xs = [x(r) if x else r["step"] for r in steps]
        proxy = ax.plot(xs, smooth([r["rollout/reward_mean"] for r in steps]), color="tab:red", label="proxy: learned reward")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("learned reward (sampled responses)", color="tab:red")
        gold_ax = ax.twinx()
        gold = gold_ax.plot(
            xs, smooth([r["rollout/gold_accuracy"] for r in steps]), color="tab:blue", label="gold: accuracy of samples"
        )
        xe = [(x(r) if "kl/ref" in r else 0.0) if x else r["step"] for r in evals]
        held = gold_ax.plot(xe, [r["eval/accuracy"] for r in evals], "o--", color="tab:green", label="gold: held-out, greedy")
        gold_ax.set_ylabel("verifier accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(proxy + gold + held, [line.get_label() for line in proxy + gold + held], fontsize=8, loc="center right")


def minutes(rows: list[dict]) -> str:
    return f"{rows[0]['time/command'] / 60:.1f}" if "time/command" in rows[0] else "-"


def rlhf_summary(rm_rows: list[dict], runs: dict[float, list[dict]]) -> str:
    """A few lines of markdown: the reward model's held-out accuracy, and each PPO run's gold accuracy and proxy."""
    rm_evals = [r for r in rm_rows if "eval/pairwise_accuracy" in r]
    lines = [
        f"- reward_model.py: {rm_rows[0]['data/pairs']} training pairs, {rm_rows[0]['data/eval_pairs']} held out; "
        f"held-out pairwise accuracy {rm_evals[0]['eval/pairwise_accuracy']:.3f} -> "
        f"{rm_evals[-1]['eval/pairwise_accuracy']:.3f} (best {max(r['eval/pairwise_accuracy'] for r in rm_evals):.3f}); "
        f"{minutes(rm_rows)} minutes (whole command)"
    ]
    return "\n".join(lines + [ppo_summary(beta, rows) for beta, rows in runs.items()])


def ppo_summary(beta: float, ppo_rows: list[dict]) -> str:
    evals = [r for r in ppo_rows if "eval/accuracy" in r]
    best = max(evals, key=lambda r: r["eval/accuracy"])
    steps = [r for r in ppo_rows if "rollout/reward_mean" in r]
    first, last = steps[:10], steps[-10:]
    mean = lambda rows, key: statistics.mean(r[key] for r in rows)
    return "\n".join(
        [
            f"- ppo.py --reward-model --beta {beta}: gold held-out accuracy {evals[0]['eval/accuracy']:.3f} at the start, "
            f"best {best['eval/accuracy']:.3f} at step {best['step']}, {evals[-1]['eval/accuracy']:.3f} at step "
            f"{evals[-1]['step']}; {minutes(ppo_rows)} minutes (whole command)",
            f"  - proxy (learned reward of the samples, mean of 10 steps): {mean(first, 'rollout/reward_mean'):.3f} at the "
            f"start, {mean(last, 'rollout/reward_mean'):.3f} at the end; gold accuracy of the samples "
            f"{mean(first, 'rollout/gold_accuracy'):.3f} -> {mean(last, 'rollout/gold_accuracy'):.3f}; KL to the reference "
            f"per response {statistics.mean(response_kl(r) for r in last):.3f} nats at the end",
        ]
    )


def memory_probe(whole: bool, grad: bool, vocab: int = 151_936, batch: int = 8, prompt: int = 16, completion: int = 256):
    """In this (fresh) process: the peak resident memory added by one common.completion_logprobs pass, without or with
    its backward, on a one-layer Llama with Qwen2.5's vocabulary (hidden size 64, tied embeddings: the logits dominate as
    they do at real scale), as a dict with the size of the pass's fp32 logits. `whole` forces the model's own forward,
    which holds the whole logits (the path before the chunked output layer, kept for models that transform logits)."""
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=prompt + completion,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    if whole:
        common.LOGIT_TRANSFORMS = ("vocab_size",)  # every config has one: the model's own forward
    ids = torch.randint(vocab, (batch, prompt + completion))
    attention = torch.ones_like(ids)

    def one_pass(n, t):
        with torch.set_grad_enabled(grad):
            logprobs, _ = common.completion_logprobs(model, ids[:n, -t - prompt :], attention[:n, -t - prompt :], t, 1.0)
            if grad:
                logprobs.sum().backward()
        model.zero_grad(set_to_none=False)  # gradient buffers stay allocated: counted before the pass

    one_pass(1, 4)  # libraries loaded and gradient buffers allocated before the measurement
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    before, high_before = rss(), peak()
    one_pass(batch, completion)
    return {
        "extra_peak": peak() - before,
        "blind_below": max(0, high_before - before),  # an extra peak below this would not show in ru_maxrss
        "logits": batch * completion * vocab * 4,
    }


def memory_table() -> str:
    """memory_probe for each path, with and without a gradient, each in its own process; a markdown table."""
    lines = [
        "| log-prob pass (8 x 256 completion tokens, vocabulary 151,936) | peak added (GiB) | fp32 logits (GiB) | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for whole, label in ((True, "whole logits (model forward)"), (False, "chunked output layer (common.py)")):
        for grad in (False, True):
            code = f"from benchmarks import benchmark; import json; print(json.dumps(benchmark.memory_probe({whole}, {grad})))"
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            m = json.loads(done.stdout.strip().splitlines()[-1])
            assert m["extra_peak"] > m["blind_below"], m  # else the high-water mark predates this pass: no measurement
            gib = lambda b: b / 2**30
            cells = [f"{label}, {'with gradient (forward + backward)' if grad else 'no gradient'}"]
            cells += [f"{gib(m['extra_peak']):.2f}", f"{gib(m['logits']):.2f}", f"{m['extra_peak'] / m['logits']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    if args.eval_every < 0:
        raise SystemExit(f"--eval-every {args.eval_every}: must be >= 0 (0: each script's default)")
    if not args.tasks or set(args.tasks) - set(TARGET):  # (multiplication: --tools)
        raise SystemExit(f"--tasks {' '.join(args.tasks)}: allowed values are {', '.join(TARGET)}")
    for flag, path in (("--runs-dir", args.runs_dir), ("--docs-dir", args.docs_dir)):  # before an hour of runs
        checks.writable_dir(flag, path)
    if args.memory:
        table = memory_table()
        with open(os.path.join(args.docs_dir, "memory.md"), "w") as f:
            f.write("# Memory of a log-prob pass\n\n")
            command = "`python -m benchmarks.benchmark --memory`"
            f.write(f"{command} (peak resident memory, CPU, each pass in a fresh process)\n\n{table}\n")
        print(table)
        raise SystemExit(0)
    if args.tools:
        results = run_tools(args)
        os.makedirs(os.path.join(args.docs_dir, "tools"), exist_ok=True)
        seeds = f"mean of {len(args.seeds)} seeds, band: min to max" if len(args.seeds) > 1 else "one seed"
        title = f"multiplication: held-out accuracy\n(greedy conversations, on the held-out problems; {seeds})"
        plot(
            results, "eval/accuracy", title, "greedy accuracy", os.path.join(args.docs_dir, "tools", "accuracy.png"), window=1
        )
        probe = "\n".join(without_the_tool(os.path.join(args.runs_dir, "tools")))
        with open(os.path.join(args.docs_dir, "tools", "results.md"), "w") as f:
            f.write(
                f"`python -m benchmarks.benchmark --tools`: task multiplication; seeds {args.seeds}; mean ± population std "
                f"(min-max) over seeds.\n\n{tools_summary(results)}\n\nWithout the tool (greedy, one turn, the 500 "
                f"held-out problems):\n\n{probe}\n"
            )
        print(tools_summary(results), probe, sep="\n\n")
        raise SystemExit(0)
    if args.rlhf:
        rm_rows, runs = run_rlhf(args)
        os.makedirs(os.path.join(args.docs_dir, "rlhf"), exist_ok=True)
        plot_overoptimisation(runs, os.path.join(args.docs_dir, "rlhf", "overoptimisation.png"))
        with open(os.path.join(args.docs_dir, "rlhf", "results.md"), "w") as f:
            f.write(rlhf_summary(rm_rows, runs) + "\n")
        print(rlhf_summary(rm_rows, runs))
        raise SystemExit(0)
    for task in args.tasks:
        results = run_all(args, task)
        d = os.path.join(args.docs_dir, task)
        os.makedirs(d, exist_ok=True)
        for stale in ("accuracy_vs_time.png",):  # charts against wall-clock time are no longer drawn
            if os.path.exists(f"{d}/{stale}"):
                os.remove(f"{d}/{stale}")
        plot_task(results, task, d)
        table = summary_table(results, TARGET[task])
        if pass_at_k_table(results):
            table += "\n\npass@k: the unbiased estimate from N responses per held-out problem, sampled at temperature 1 "
            table += "(Chen et al. 2021); mean (min-max) over seeds.\n\n" + pass_at_k_table(results)
        with open(f"{d}/results.md", "w") as f:
            f.write(f"Task {task}; seeds {args.seeds}; mean ± population std (min-max) over seeds.\n\n{table}\n")
        print(f"{task}:\n{table}")
