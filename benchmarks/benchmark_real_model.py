"""A real pretrained chat model on this machine: SmolLM2-135M-Instruct (prepare_smollm2.py), offline, on the CPU.

    pip install matplotlib                             # the chart
    python -m benchmarks.benchmark_real_model          # about two and a half hours on a 2-core CPU, alone
    python -m benchmarks.benchmark_real_model --tools  # only tool use (chat format: warm-up then RL; inline): ~half an hour

Seven measurements, each script in its own process, one after another, written to docs/real-model/results.md with the
learning curves (docs/real-model/accuracy.png):
1. learning: grpo.py on the sums task with the command of docs/real-model.md: the whole command's minutes and peak
   resident memory, the held-out accuracy at every evaluation, and what the model answered before and after;
2. the same with a LoRA adapter (--lora-rank 16) at 10, 20 and 30 times the learning rate;
3. cispo, reinforce_pp, sapo and opd with the learning command;
4. every script for 2 steps with a small batch and its defaults for a pretrained model: seconds per step, peak memory;
5. grpo.py for 2 steps with one memory or speed flag changed at a time, LoRA's among them;
6. the memory formula of memory_plan.py against measured peaks, full and LoRA;
7. one GRPO step taken apart in a fresh process: generation, the no-grad log-prob passes and the update, each timed,
   the peak memory after each, and generation's time by operator (torch.profiler).
Complete runs under --runs-dir are reused unless --fresh, so an interrupted benchmark resumes where it stopped.
"""

import importlib.metadata
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

from benchmarks import prepare_smollm2

LEARN = ["--task", "sums", "--num-prompts", "4", "--group-size", "8", "--learning-rate", "1e-5", "--beta", "0"]
LEARN += ["--total-steps", "16", "--eval-every", "4"]  # the command of docs/real-model.md
TWO_STEPS = ["--task", "sums", "--total-steps", "2", "--eval-every", "100", "--save-every", "100"]  # evaluated twice
FLAG_VARIANTS = {
    "defaults (4 prompts x 8, 24 new tokens, beta 0.04, 2 minibatches)": [],
    "--beta 0 (no reference model)": ["--beta", "0"],
    "--micro-batch-size 4": ["--micro-batch-size", "4"],
    "--gradient-checkpointing": ["--gradient-checkpointing"],
    "--micro-batch-size 4 --gradient-checkpointing --beta 0": ["--micro-batch-size", "4", "--gradient-checkpointing"]
    + ["--beta", "0"],
    "--max-new-tokens 48": ["--max-new-tokens", "48"],
    "--lora-rank 16 (the reference: the base, adapter off)": ["--lora-rank", "16"],
    "--lora-rank 16 --micro-batch-size 4 --gradient-checkpointing": ["--lora-rank", "16", "--micro-batch-size", "4"]
    + ["--gradient-checkpointing"],
}


def with_values(flags: list[str], changes: dict[str, str]) -> list[str]:
    """FLAGS with the value after each flag named in CHANGES replaced."""
    return [changes.get(flags[i - 1], v) if i else v for i, v in enumerate(flags)]


# The learning command with a LoRA adapter of rank 16 instead of every weight, at three learning rates around ten times
# the full run's (the ratio "LoRA Without Regret", Schulman et al. 2025, found best across models and tasks); the best
# of them, 2e-4, is the command of docs/fitting-a-gpu.md
LORA_RATES = {rate: with_values(LEARN, {"--learning-rate": rate}) + ["--lora-rank", "16"] for rate in ("1e-4", "2e-4", "3e-4")}
LORA_LEARN = LORA_RATES["2e-4"]


@dataclass
class Args:
    model_dir: str = ""
    """the model folder (default: prepare_smollm2.py's, prepared now if missing)"""
    runs_dir: str = "runs/real-model"
    """where the runs go"""
    docs_dir: str = "docs/real-model"
    """where the chart and the tables go"""
    fresh: bool = False
    """rerun even when a complete run exists"""
    tools: bool = False
    """only tool use on the products task, into DOCS_DIR/tools.md: the untrained model's calls, the chat format's
    warm-up (sft_tools.py with TOOLS_WARM_UP) then grpo_tools.py (TOOLS_CHAT_LEARN), and grpo_tools.py in the inline
    format (TOOLS_LEARN): the held-out accuracy at every evaluation, the tool metrics, whole conversations"""


# grpo_tools.py on the products task ("What is 347 * 86?"), the calculator called inline ("347 * 86 =" completed in the
# reply): SmolLM2-135M-Instruct never writes a <calc> tag (docs/tools.md), but it writes arithmetic followed by "="
TOOLS_LEARN = ["--task", "products", "--tool-format", "inline", "--num-prompts", "4", "--group-size", "8", "--beta", "0"]
TOOLS_LEARN += ["--learning-rate", "1e-4", "--max-turns", "4", "--total-steps", "4", "--eval-every", "2"]
# the chat format (<calc>...</calc>, answered in a tool message), which the model never writes untrained: the supervised
# warm-up on demonstrations (sft_tools.py), then grpo_tools.py from the warmed-up model
TOOLS_WARM_UP = ["--tool-share", "0.5", "--num-steps", "20", "--batch-size", "8"]
TOOLS_CHAT_LEARN = ["--task", "products", "--tool-format", "chat", "--num-prompts", "4", "--group-size", "8", "--beta", "0"]
TOOLS_CHAT_LEARN += ["--learning-rate", "1e-5", "--total-steps", "10", "--eval-every", "5"]


def run_measured(script: str, flags: list[str], out: str, fresh: bool, env: dict | None = None) -> dict:
    """`python SCRIPT.py FLAGS --output-dir OUT` with the hub offline, unless OUT holds a complete run; returns the
    rows of its metrics.jsonl and, in measured.json, the whole command's seconds and its peak resident memory (the
    process's own high-water mark, from wait4)."""
    if fresh or not os.path.isfile(os.path.join(out, "measured.json")):
        shutil.rmtree(out, ignore_errors=True)  # a run to replace, or one cut short: the scripts refuse to write over a run
        os.makedirs(out, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", **(env or {})}
        print(f"{script} {' '.join(flags)} ...", flush=True)
        start = time.time()
        with open(os.path.join(out, "log.txt"), "w") as log:
            process = subprocess.Popen([sys.executable, script, *flags, "--output-dir", out], env=env, stdout=log, stderr=log)
            _, status, usage = os.wait4(process.pid, 0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"{script} failed; see {out}/log.txt")
        measured = {"seconds": time.time() - start, "peak_bytes": usage.ru_maxrss * 1024}  # kilobytes on Linux
        with open(os.path.join(out, "measured.json"), "w") as f:
            json.dump(measured, f)
    with open(os.path.join(out, "measured.json")) as f:
        measured = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        measured["rows"] = [json.loads(line) for line in f]
    return measured


def cpu_name() -> str:
    """The CPU's model name and widest vector unit as Linux reports them (/proc/cpuinfo), or the platform's processor
    string elsewhere: the figures of this benchmark move with both."""
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        info = {key.strip(): value.strip() for key, value in info.items()}
        flags = info.get("flags", "").split()
        vectors = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        return f"{info.get('model name', 'an unnamed CPU')} ({vectors})"
    return platform.processor() or "an unnamed CPU"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def step_seconds(rows: list[dict], key: str = "time/step") -> str:
    values = [r[key] for r in rows if key in r]
    return f"{sum(values) / len(values):.1f}" if values else "-"


def learning(args: Args) -> list[str]:
    run = run_measured("grpo.py", ["--model-name-or-path", args.model_dir, *LEARN], f"{args.runs_dir}/learn", args.fresh)
    with open(f"{args.runs_dir}/learn/samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    lines = [
        f"`python grpo.py --model-name-or-path MODEL_DIR {' '.join(LEARN)}`: {run['seconds'] / 60:.1f} minutes for the "
        f"whole command, peak resident memory {gib(run['peak_bytes'])} GiB, {step_seconds(run['rows'])} s per step "
        f"(rollout {step_seconds(run['rows'], 'time/rollout')} s) on average, each evaluation "
        f"{eval_seconds(run['rows']):.0f} s.",
        "",
        "| step | minutes | held-out accuracy | greedy response length (tokens) |",
        "| --- | --- | --- | --- |",
    ]
    for r in run["rows"]:
        if "eval/accuracy" in r:
            length = r.get("eval/response_length", float("nan"))
            lines.append(f"| {r['step']} | {r['time/elapsed'] / 60:.1f} | {r['eval/accuracy']:.1%} | {length:.1f} |")
    first, last = samples[0]["step"], samples[-1]["step"]
    lines += ["", "What the model answered (the first held-out prompts, greedy):", ""]
    lines += ["| prompt | answer | at the start | at the end |", "| --- | --- | --- | --- |"]
    before = [s for s in samples if s["step"] == first]
    after = [s for s in samples if s["step"] == last]
    for b, a in zip(before, after):
        question = b["prompt"].split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        cell = lambda s: s["completion"].replace("\n", " ").replace("|", "\\|")
        lines.append(f"| {question} | {b['answer']} | {cell(b)} | {cell(a)} |")
    return lines


def lora_learning(args: Args) -> list[str]:
    """The learning command with --lora-rank 16 at three rates beside the full run: accuracy, time, memory, trained
    parameters."""
    full = run_measured("grpo.py", ["--model-name-or-path", args.model_dir, *LEARN], f"{args.runs_dir}/learn", args.fresh)
    out = lambda rate: f"{args.runs_dir}/learn-lora-{rate}"
    sweep = {
        rate: run_measured("grpo.py", ["--model-name-or-path", args.model_dir, *flags], out(rate), args.fresh)
        for rate, flags in LORA_RATES.items()
    }
    with open(f"{out('2e-4')}/log.txt") as f:
        trained = next(line.strip().split(": ", 1)[1] for line in f if line.startswith("--lora-rank"))
    run = sweep["2e-4"]
    lines = [
        f"`python grpo.py --model-name-or-path MODEL_DIR {' '.join(LORA_LEARN)}` ({trained}): {run['seconds'] / 60:.1f} "
        f"minutes for the whole command, peak resident memory {gib(run['peak_bytes'])} GiB (every weight: "
        f"{full['seconds'] / 60:.1f} minutes, {gib(full['peak_bytes'])} GiB), {step_seconds(run['rows'])} s per step "
        f"(rollout {step_seconds(run['rows'], 'time/rollout')} s), each evaluation {eval_seconds(run['rows']):.0f} s.",
        "",
        "Held-out accuracy:",
        "",
        "| step | " + " | ".join(f"LoRA, lr {rate}" for rate in LORA_RATES) + " | every weight, lr 1e-5 |",
        "| --- " * (len(LORA_RATES) + 2) + "|",
    ]
    by_step = lambda r: {step: accuracy for step, _, accuracy in evaluations(r["rows"])}
    columns = [by_step(r) for r in [*sweep.values(), full]]
    for step in sorted(by_step(full)):
        lines.append(f"| {step} | " + " | ".join(f"{c[step]:.1%}" if step in c else "-" for c in columns) + " |")
    lines += [
        "",
        "| run | minutes for the whole command | s per step (rollout) | each evaluation (s) | peak resident memory (GiB) |",
    ]
    lines.append("| --- | --- | --- | --- | --- |")
    for label, r in [*((f"LoRA, lr {rate}", r) for rate, r in sweep.items()), ("every weight, lr 1e-5", full)]:
        step = f"{step_seconds(r['rows'])} ({step_seconds(r['rows'], 'time/rollout')})"
        lines.append(
            f"| {label} | {r['seconds'] / 60:.1f} | {step} | {eval_seconds(r['rows']):.0f} | {gib(r['peak_bytes'])} |"
        )
    return lines


def other_scripts_learning(args: Args) -> list[str]:
    """CISPO, REINFORCE++, SAPO and OPD with the learning command: cispo, reinforce_pp and sapo exactly as grpo.py's;
    opd with one response to each of 32 prompts (its default shape: no group needed) and the learning run's GRPO model
    as teacher."""
    full = run_measured("grpo.py", ["--model-name-or-path", args.model_dir, *LEARN], f"{args.runs_dir}/learn", args.fresh)
    opd = with_values(LEARN, {"--num-prompts": "32", "--group-size": "1"}) + ["--teacher", f"{args.runs_dir}/learn/model"]
    steps = ", ".join(str(step) for step, _, _ in evaluations(full["rows"]))
    lines = [f"| script | flags beyond the model | held-out accuracy at steps {steps} | minutes | peak memory (GiB) |"]
    lines.append("| --- | --- | --- | --- | --- |")
    curves = {}  # the chart: every learning run of this page, the LoRA sweep's too
    for script, flags in {"grpo": LEARN, "cispo": LEARN, "reinforce_pp": LEARN, "sapo": LEARN, "opd": opd}.items():
        out = f"{args.runs_dir}/learn" if script == "grpo" else f"{args.runs_dir}/learn-{script}"
        run = run_measured(f"{script}.py", ["--model-name-or-path", args.model_dir, *flags], out, args.fresh)
        curve = " -> ".join(f"{accuracy:.1%}" for _, _, accuracy in evaluations(run["rows"]))
        shown = " ".join(flags)
        lines.append(f"| `{script}.py` | `{shown}` | {curve} | {run['seconds'] / 60:.1f} | {gib(run['peak_bytes'])} |")
        curves[f"{script}.py" + (", 32 prompts x 1" if script == "opd" else "")] = evaluations(run["rows"])
    for rate, flags in LORA_RATES.items():  # lora_learning's runs, already run (again, with --fresh) above
        run = run_measured(
            "grpo.py", ["--model-name-or-path", args.model_dir, *flags], f"{args.runs_dir}/learn-lora-{rate}", False
        )
        curves[f"grpo.py, LoRA rank 16, lr {rate}"] = evaluations(run["rows"])
    plot_learning(
        {k: [(step, accuracy) for step, _, accuracy in v] for k, v in curves.items()}, f"{args.docs_dir}/accuracy.png"
    )
    return lines


def call_format_probe(model_dir: str, num: int = 64, max_new_tokens: int = 48) -> list[str]:
    """What the untrained model writes for `num` products questions at temperature 1 under each system message: how
    often a <calc> tag (the chat format's call), how often "a * b =" with the question's numbers (the inline format's
    call) and how often the right product."""
    import random
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import common
    import tasks
    import tools

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng, task_format = random.Random(0), tasks.INSTRUCTIONS["products"]
    problems = [(rng.randrange(100, 1000), rng.randrange(10, 100)) for _ in range(num)]
    systems = {
        "the task's instruction, then the chat format's (`tools.ChatFormat.INSTRUCTION`)": tools.ChatFormat.INSTRUCTION,
        "the task's instruction, then the inline format's (`tools.InlineFormat.INSTRUCTION`)": tools.InlineFormat.INSTRUCTION,
        "none (the template's default)": None,
    }
    lines = [
        '| system message | wrote a `<calc>` tag | wrote "a * b =" with the question\'s numbers | stated the product |',
        "| --- | --- | --- | --- |",
    ]
    torch.manual_seed(0)
    for name, call_format in systems.items():
        system = [{"role": "system", "content": f"{task_format} {call_format}"}] if call_format else []
        questions = [system + [{"role": "user", "content": f"What is {a} * {b}?"}] for a, b in problems]
        prompts = [tokenizer.apply_chat_template(q, tokenize=False, add_generation_prompt=True) for q in questions]
        ids, mask = common.tokenize_prompts(tokenizer, prompts, torch.device("cpu"))
        texts = common.decode(tokenizer, *common.generate(model, tokenizer, ids, mask, max_new_tokens, 1.0))
        tags = sum("<calc>" in t for t in texts)
        inline = sum(bool(re.search(rf"{a}\s*[*x×]\s*{b}\s*=", t)) for t, (a, b) in zip(texts, problems))
        right = sum(str(a * b) in t for t, (a, b) in zip(texts, problems))
        lines.append(f"| {name} | {tags} / {num} | {inline} / {num} | {right} / {num} |")
    return lines


def show_turns(sample: dict) -> str:
    """A conversation's turns as a table cell: `model:` sampled, `tool:` written by the calculator."""
    return " ".join(f"{who}: `{text}`" for turn in sample["turns"] for who, text in turn.items()).replace("\n", " ")


def question(sample: dict) -> str:
    return sample["prompt"].split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]


def evaluation_table(rows: list[dict]) -> list[str]:
    """Every evaluation of a grpo_tools.py run: held-out greedy accuracy and call rate, accuracy with and without a call,
    the model's tokens; and, from the step's own rollout, the call rate and accuracy sampled at temperature 1."""
    lines = [
        "| step | minutes | held-out accuracy | called the calculator | accuracy with a call / without | tokens by model "
        "| sampled: called / accuracy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_step = {r["step"]: r for r in rows}
    for r in rows:
        if "eval/accuracy" in r:
            split = " / ".join(
                f"{r[k]:.1%}" if k in r else "-" for k in ("eval/accuracy_with_call", "eval/accuracy_without_call")
            )
            rollout = by_step.get(max(r["step"], 1), {})  # at step 0, the first step's rollout: the same weights
            sampled = " / ".join(
                f"{rollout[k]:.1%}" if k in rollout else "-" for k in ("rollout/called_tool_frac", "rollout/gold_accuracy")
            )
            lines.append(
                f"| {r['step']} | {r['time/elapsed'] / 60:.1f} | {r['eval/accuracy']:.1%} | {r['eval/called_tool_frac']:.1%} "
                f"| {split} | {r['eval/tokens_by_model']:.1f} | {sampled} |"
            )
    return lines


def tools_learning(args: Args) -> list[str]:
    """grpo_tools.py with TOOLS_LEARN: the whole command's minutes and peak memory, every evaluation with its tool
    metrics, and the first held-out conversations before and after, every turn with its writer."""
    run = run_measured(
        "grpo_tools.py", ["--model-name-or-path", args.model_dir, *TOOLS_LEARN], f"{args.runs_dir}/tools", args.fresh
    )
    with open(f"{args.runs_dir}/tools/samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    lines = [
        f"`python grpo_tools.py --model-name-or-path MODEL_DIR {' '.join(TOOLS_LEARN)}`: {run['seconds'] / 60:.1f} minutes "
        f"for the whole command, peak resident memory {gib(run['peak_bytes'])} GiB, {step_seconds(run['rows'])} s per "
        f"step (rollout {step_seconds(run['rows'], 'time/rollout')} s) on average.",
        "",
        *evaluation_table(run["rows"]),
    ]
    first, last = samples[0]["step"], samples[-1]["step"]
    lines += ["", "The first held-out conversations, greedy (`model:` sampled, `tool:` written by the calculator):", ""]
    lines += ["| question | answer | at the start | at the end |", "| --- | --- | --- | --- |"]
    for b, a in zip([s for s in samples if s["step"] == first], [s for s in samples if s["step"] == last]):
        before, after = (show_turns(s).replace("|", "\\|") for s in (b, a))  # a table cell: | escaped
        lines.append(f"| {question(b)} | {b['answer']} | {before} | {after} |")
    return lines


def untrained_chat_evaluation(model_dir: str, out: str, fresh: bool) -> dict:
    """The untrained model in the chat format, as grpo_tools.py would evaluate it at step 0 (its prompts, system message
    and evaluation), and 32 conversations sampled at temperature 1 on training prompts, as its first rollout would;
    saved to OUT/untrained.json."""
    path = os.path.join(out, "untrained.json")
    if fresh or not os.path.isfile(path):
        import torch

        import common
        import grpo_tools
        import tasks
        import tools
        from plumbing import models

        flags = grpo_tools.Args(model_name_or_path=model_dir, task="products", tool_format="chat")
        flags.max_new_tokens = 64  # the products task's budget
        policy, tokenizer = models.load_model_and_tokenizer(model_dir, "", torch.device("cpu"), "products")
        tool_format, task = tools.format_and_prompts(
            flags, tasks.make_task("products"), tokenizer, common.eos_token_ids(policy, tokenizer)
        )
        metrics = grpo_tools.evaluate(policy, tokenizer, tool_format, task, flags)
        torch.manual_seed(0)
        batch = task.train[:32]  # the first 32 training prompts
        prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, batch["prompt"], torch.device("cpu"))
        sampled = grpo_tools.rollout(policy, tokenizer, tool_format, prompt_ids, prompt_mask, flags, 1.0)
        result = {k: float(v) for k, v in metrics.items() if k != "samples"}
        result["rollout/called_tool_frac"] = (sampled.tool_calls > 0).float().mean().item()
        result["rollout/gold_accuracy"] = task.verify(sampled.final_turns, batch["answer"]).mean().item()
        result["samples"] = metrics["samples"]
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f)
    with open(path) as f:
        return json.load(f)


def chat_tools_learning(args: Args) -> list[str]:
    """The chat format on SmolLM2: the untrained model, sft_tools.py's warm-up on demonstrations (TOOLS_WARM_UP), then
    grpo_tools.py from it (TOOLS_CHAT_LEARN): the held-out accuracy and call rate of each, the two commands' minutes and
    peak memory, and the first held-out conversations of each, every turn with its writer."""
    untrained = untrained_chat_evaluation(args.model_dir, f"{args.runs_dir}/tools-chat", args.fresh)
    warm_up = run_measured(
        "sft_tools.py", ["--model-name-or-path", args.model_dir, *TOOLS_WARM_UP], f"{args.runs_dir}/tools-warm-up", args.fresh
    )
    warm_model = f"{args.runs_dir}/tools-warm-up/model"
    learn = run_measured(
        "grpo_tools.py", ["--model-name-or-path", warm_model, *TOOLS_CHAT_LEARN], f"{args.runs_dir}/tools-chat", args.fresh
    )
    with open(f"{args.runs_dir}/tools-chat/samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    minutes = (warm_up["seconds"] + learn["seconds"]) / 60
    split = " / ".join(
        f"{untrained[k]:.1%}" if k in untrained else "-" for k in ("eval/accuracy_with_call", "eval/accuracy_without_call")
    )
    lines = [
        f"1. `python sft_tools.py --model-name-or-path MODEL_DIR {' '.join(TOOLS_WARM_UP)}`: {warm_up['seconds'] / 60:.1f} "
        f"minutes for the whole command, peak resident memory {gib(warm_up['peak_bytes'])} GiB; last loss "
        f"{warm_up['rows'][-1]['sft/loss']:.3f}.",
        f"2. `python grpo_tools.py --model-name-or-path {warm_model} {' '.join(TOOLS_CHAT_LEARN)}`: "
        f"{learn['seconds'] / 60:.1f} minutes for the whole command, peak resident memory {gib(learn['peak_bytes'])} GiB, "
        f"{step_seconds(learn['rows'])} s per step (rollout {step_seconds(learn['rows'], 'time/rollout')} s) on average.",
        "",
        f"The pipeline, both commands: {minutes:.1f} minutes. Step 0 of grpo_tools.py is the warmed-up model; the row "
        "`untrained` is SmolLM2-135M-Instruct itself, evaluated in the same chat format (`untrained_chat_evaluation`).",
        "",
        *evaluation_table(learn["rows"]),
    ]
    untrained_row = (
        f"| untrained | - | {untrained['eval/accuracy']:.1%} | {untrained['eval/called_tool_frac']:.1%} | {split} | "
        f"{untrained['eval/tokens_by_model']:.1f} | {untrained['rollout/called_tool_frac']:.1%} / "
        f"{untrained['rollout/gold_accuracy']:.1%} |"
    )
    lines.insert(lines.index("| --- | --- | --- | --- | --- | --- | --- |") + 1, untrained_row)
    first, last = samples[0]["step"], samples[-1]["step"]
    lines += ["", "The first held-out conversations, greedy (`model:` sampled, `tool:` written by the environment):", ""]
    lines += ["| question | answer | untrained | after the warm-up | after RL |", "| --- | --- | --- | --- | --- |"]
    at = lambda step: [s for s in samples if s["step"] == step]
    for u, w, r in zip(untrained["samples"], at(first), at(last)):
        cells = (show_turns(s).replace("|", "\\|") for s in (u, w, r))  # a table cell: | escaped
        lines.append(f"| {question(w)} | {w['answer']} | {' | '.join(cells)} |")
    return lines


def evaluations(rows: list[dict]) -> list[tuple[int, float, float]]:
    return [(r["step"], r["time/elapsed"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def eval_seconds(rows: list[dict]) -> float:
    """The mean time of an evaluation after a step: the step's wall-clock time not counted in time/step."""
    gaps = [b["time/elapsed"] - a["time/elapsed"] - b["time/step"] for a, b in zip(rows, rows[1:]) if "eval/accuracy" in b]
    return sum(gaps) / max(1, len(gaps))


def plot_learning(curves: dict[str, list[tuple[int, float]]], path: str) -> None:
    """Held-out accuracy against the step (every step samples the same 32 responses), one line per run; steps, not
    minutes, so that runs timed alone and runs timed side by side compare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, points in curves.items():
        dashed = "LoRA" in label
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", linestyle="--" if dashed else "-", label=label)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title("SmolLM2-135M-Instruct on the sums task, 32 responses per step (CPU)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (greedy, 200 problems)")
    ax.set_xticks(sorted({p[0] for points in curves.values() for p in points}))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def every_script(args: Args) -> list[str]:
    pairs = os.path.join(args.runs_dir, "pairs.jsonl")
    write_pairs(pairs)
    lines = ["| script | flags beyond the model and `" + " ".join(TWO_STEPS) + "` | seconds per step | whole command (s) "]
    lines[0] += "| peak resident memory (GiB) |"
    lines.append("| --- | --- | --- | --- | --- |")
    group = ["--num-prompts", "4", "--group-size", "8", "--num-eval", "16"]  # 16 held out: the two evaluations take seconds
    per_script = {s: group for s in ("grpo", "rloo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce_pp", "sapo")}
    per_script["opd"] = [*group, "--teacher", f"{args.runs_dir}/learn/model"]  # the teacher: the learning run's model
    per_script["ppo"] = ["--num-prompts", "32", "--num-eval", "16"]
    per_script["dpo"] = per_script["reward_model"] = ["--dataset", pairs, "--num-eval", "64", "--batch-size", "32"]
    for script, flags in per_script.items():
        run = run_measured(
            f"{script}.py",
            ["--model-name-or-path", args.model_dir, *TWO_STEPS, *flags],
            f"{args.runs_dir}/{script}",
            args.fresh,
        )
        shown = " ".join(flags).replace(pairs, "pairs.jsonl")  # the pairs written above; the teacher's path in full
        lines.append(
            f"| `{script}.py` | `{shown}` | {step_seconds(run['rows'])} | {run['seconds']:.0f} | {gib(run['peak_bytes'])} |"
        )
    return lines


def write_pairs(path: str) -> None:
    """400 preference pairs on sums prompts, written as a user writes them: plain questions, which dpo.py and
    reward_model.py render with the model's chat template and the sums task's instruction as the system message. The
    correct one-line sum is chosen over one off by 1 or 10; the answer column lets dpo.py answer the held-out prompts."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(400):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            wrong = a + b + rng.choice([-10, -1, 1, 10])
            row = {
                "prompt": f"What is {a} + {b}?",
                "chosen": f"{a} + {b} = {a + b}",
                "rejected": f"{a} + {b} = {wrong}",
                "answer": str(a + b),
            }
            f.write(json.dumps(row) + "\n")


def flag_variants(args: Args) -> list[str]:
    """grpo.py for 2 steps per variant, on the sums prompts from a file with 2 held out, so that the evaluations (which
    the flags do not change) take no time."""
    lines = ["| grpo.py, 2 steps | seconds per step | rollout (s) | peak resident memory (GiB) |", "| --- | --- | --- | --- |"]
    sums = os.path.join(args.runs_dir, "sums.jsonl")
    with open(sums, "w") as f:
        f.writelines(
            json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n" for a in range(10, 30) for b in (17, 58)
        )
    group = ["--num-prompts", "4", "--group-size", "8", "--dataset", sums, "--num-eval", "2"]
    for i, (label, flags) in enumerate(FLAG_VARIANTS.items()):
        run = run_measured(
            "grpo.py",
            ["--model-name-or-path", args.model_dir, *TWO_STEPS, *group, *flags],
            f"{args.runs_dir}/flags{i}",
            args.fresh,
        )
        rollout = step_seconds(run["rows"], "time/rollout")
        lines.append(f"| {label} | {step_seconds(run['rows'])} | {rollout} | {gib(run['peak_bytes'])} |")
    return lines


def formula_check(args: Args) -> list[str]:
    """memory_plan.py's terms (CPU: fp32 throughout) for the 2-step grpo.py runs of flag_variants, every weight against
    --lora-rank 16, beside their measured peaks. A micro-batch is a minibatch of 16 responses of the sums prompt (with
    the chat template) and 24 new tokens."""
    from transformers import AutoConfig, AutoTokenizer

    import tasks
    from benchmarks import memory_plan

    config, tokenizer = AutoConfig.from_pretrained(args.model_dir), AutoTokenizer.from_pretrained(args.model_dir)
    task = tasks.apply_chat_template(tasks.make_task("gsm8k", f"{args.runs_dir}/sums.jsonl", 2), tokenizer, "auto", "")
    prompt = len(tokenizer(task.train["prompt"][0], add_special_tokens=False).input_ids)
    tokens = 16 * (prompt + 24)
    model = memory_plan.build_on_meta(config)
    params, adapter = memory_plan.parameter_count(model), memory_plan.adapter_parameter_count(model, 16)
    full_label, lora_label = next(iter(FLAG_VARIANTS)), "--lora-rank 16 (the reference: the base, adapter off)"
    peaks, fixed = {}, {}  # as the runs of flag_variants measured them, and again with glibc's mmap threshold fixed
    group = ["--num-prompts", "4", "--group-size", "8", "--dataset", f"{args.runs_dir}/sums.jsonl", "--num-eval", "2"]
    for i, label in enumerate(FLAG_VARIANTS):
        if label in (full_label, lora_label):
            with open(f"{args.runs_dir}/flags{i}/measured.json") as f:
                peaks[label] = json.load(f)["peak_bytes"]
            flags = ["--model-name-or-path", args.model_dir, *TWO_STEPS, *group, *FLAG_VARIANTS[label]]
            out, env = f"{args.runs_dir}/flags{i}-mmap", {"MALLOC_MMAP_THRESHOLD_": "131072"}
            fixed[label] = run_measured("grpo.py", flags, out, args.fresh, env)["peak_bytes"]
    logits = memory_plan.logits_bytes()
    full = {"weights": 4 * params, "reference": 4 * params, "gradients": 4 * params, "AdamW state": 8 * params}
    lora = {"weights": 4 * params + 4 * adapter, "reference": 0, "gradients": 4 * adapter, "AdamW state": 8 * adapter}
    full["activations"] = tokens * memory_plan.activation_bytes_per_token(config, 0, on_gpu=False)
    lora["activations"] = tokens * memory_plan.activation_bytes_per_token(config, 16, on_gpu=False)
    lines = [
        f"P = {params:,} parameters, a = {adapter:,} in the adapter (rank 16, every linear layer but the output layer), "
        f"micro-batch n = 16 x ({prompt} + 24) = {tokens:,} tokens, fp32 on the CPU.",
        "",
        "| term | every weight | LoRA rank 16 |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {k} | {gib(full[k])} | {gib(lora[k])} |" for k in full]
    lines += [f"| logits (one chunk) | {gib(logits)} | {gib(logits)} |"]
    imports = "import torch, transformers, datasets, tyro, tqdm, common, tasks, grpo; from plumbing import models"
    process = subprocess.Popen([sys.executable, "-c", imports])
    baseline = os.wait4(process.pid, 0)[2].ru_maxrss * 1024  # the process before any model: Python and the libraries
    lines += [f"| the process before any model (Python, torch, transformers) | {gib(baseline)} | {gib(baseline)} |"]
    predicted = {label: sum(terms.values()) + logits + baseline for label, terms in ((full_label, full), (lora_label, lora))}
    lines += [f"| sum of the terms | {gib(predicted[full_label])} | {gib(predicted[lora_label])} |"]
    lines += [f"| measured peak of the process | {gib(peaks[full_label])} | {gib(peaks[lora_label])} |"]
    lines += [f"| measured peak, `MALLOC_MMAP_THRESHOLD_=131072` | {gib(fixed[full_label])} | {gib(fixed[lora_label])} |"]
    measured, measured_fixed = gib(peaks[full_label] - peaks[lora_label]), gib(fixed[full_label] - fixed[lora_label])
    saved = gib(predicted[full_label] - predicted[lora_label])
    lines += [
        "",
        f"Saved by the adapter: {saved} GiB by the formula; measured {measured}, with the threshold fixed {measured_fixed}.",
    ]
    return lines


def step_probe(model_dir: str) -> dict:
    """In this (fresh) process, one GRPO step of grpo.py's update on `model_dir` (4 prompts x 8 responses of up to 24
    tokens, a reference model, two minibatches) taken apart: each phase timed, the process's peak resident memory after
    each, the sizes of the weights and the optimizer's state, and generation's self time by operator."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import common
    import tasks
    from plumbing import models

    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result, cpu = {"phases": []}, torch.device("cpu")

    def phase(name, fn):
        start = time.time()
        value = fn()
        result["phases"].append({"phase": name, "seconds": time.time() - start, "peak_after": peak()})
        return value

    torch.manual_seed(1)
    policy, tokenizer = phase("load the policy", lambda: models.load_model_and_tokenizer(model_dir, "", cpu, "sums"))
    ref_policy = phase("load the reference", lambda: models.load_model_and_tokenizer(model_dir, "", cpu, "sums")[0])
    task = tasks.apply_chat_template(tasks.make_task("sums"), tokenizer, "auto")
    prompts = [p for p in task.train[:4]["prompt"] for _ in range(8)]
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, cpu)
    with torch.no_grad():
        completion_ids, mask, _ = phase(
            "generate 32 responses", lambda: common.generate(policy, tokenizer, prompt_ids, prompt_mask, 24, 1.0)
        )
    input_ids, attention = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask.long()], 1)
    T = completion_ids.shape[1]
    phase("old log-probs (no grad)", lambda: common.logprobs_no_grad(policy, input_ids, attention, T, 1.0, 16))
    phase("reference log-probs (no grad)", lambda: common.logprobs_no_grad(ref_policy, input_ids, attention, T, 1.0, 16))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
    advantages = torch.randn(len(input_ids))

    def update():  # two minibatches of 16, one optimizer step each, as grpo.py's two minibatches
        for idx in torch.arange(len(input_ids)).split(16):
            optimizer.zero_grad()
            logprobs, _ = common.completion_logprobs(policy, input_ids[idx], attention[idx], T, 1.0)
            (-(logprobs * advantages[idx, None] * mask[idx]).sum() / mask[idx].sum()).backward()
            optimizer.step()

    phase("update (2 minibatches of 16: forward, backward, AdamW)", update)
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    result["weights_bytes"] = weights
    result["adam_bytes"] = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())
    result["tokens"] = T
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.time()
        common.generate(policy, tokenizer, prompt_ids, prompt_mask, 24, 1.0)
        result["profiled_generate_seconds"] = time.time() - start
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    result["generate_ops"] = [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in ops[:10]]
    return result


def step_split(model_dir: str) -> list[str]:
    code = f"from benchmarks import benchmark_real_model as b; import json; print(json.dumps(b.step_probe({model_dir!r})))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    if done.returncode:
        raise SystemExit(f"the step probe failed:\n{done.stderr[-3000:]}")
    m = json.loads(done.stdout.strip().splitlines()[-1])
    lines = ["| phase | seconds | peak resident memory after it (GiB) |", "| --- | --- | --- |"]
    lines += [f"| {p['phase']} | {p['seconds']:.1f} | {gib(p['peak_after'])} |" for p in m["phases"]]
    lines += ["", f"Weights {gib(m['weights_bytes'])} GiB (fp32), AdamW's two moments {gib(m['adam_bytes'])} GiB; "]
    lines[-1] += f"{m['tokens']} new tokens per response. Generation (profiled again: {m['profiled_generate_seconds']:.1f} s)"
    lines[-1] += " by operator, self time:"
    lines += ["", "| operator | share of generation's self time | calls |", "| --- | --- | --- |"]
    lines += [f"| `{o['op']}` | {o['share']:.1%} | {o['calls']} |" for o in m["generate_ops"]]
    return lines


def threads_used() -> str:
    """The runs' thread count as the page states it (they inherit this process's, which OMP_NUM_THREADS sets)."""
    import torch

    threads = torch.get_num_threads()
    return f"one run at a time, {threads} thread{'s' if threads > 1 else ''} each"


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.model_dir = args.model_dir or prepare_smollm2.prepare()
    os.makedirs(args.docs_dir, exist_ok=True)
    os.makedirs(args.runs_dir, exist_ok=True)
    if args.tools:
        lines = [
            f"`python -m benchmarks.benchmark_real_model --tools`: SmolLM2-135M-Instruct, CPU, {threads_used()}.",
            "",
            f"Measured on: {cpu_name()}, {os.cpu_count()} cores, torch {importlib.metadata.version('torch')}.",
            "",
            "## Calls before training",
            "",
        ]
        lines += ["Sampled at temperature 1, 64 questions, 48 new tokens, seed 0:", "", *call_format_probe(args.model_dir), ""]
        lines += ["## The chat format: a warm-up on demonstrations, then RL", "", *chat_tools_learning(args), ""]
        lines += ["## Learning to call the calculator inline", "", *tools_learning(args)]
        with open(os.path.join(args.docs_dir, "tools.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
        raise SystemExit(0)
    sections = [
        "`python -m benchmarks.benchmark_real_model`: SmolLM2-135M-Instruct, CPU, each run alone in its own process.",
        "",
        f"Measured on: {cpu_name()}, {os.cpu_count()} cores, torch {importlib.metadata.version('torch')}.",
        "",
        "## Learning",
        "",
        *learning(args),
        "",
        "## Learning with a LoRA adapter",
        "",
        *lora_learning(args),
        "",
        "## CISPO, REINFORCE++, SAPO and on-policy distillation learning",
        "",
        *other_scripts_learning(args),
        "",
        "## Every script, 2 steps",
        "",
        *every_script(args),
        "",
        "## One flag at a time",
        "",
        *flag_variants(args),
        "",
        "## The memory formula against the measured peaks",
        "",
        *formula_check(args),
        "",
        "## One step taken apart",
        "",
        *step_split(args.model_dir),
    ]
    with open(os.path.join(args.docs_dir, "results.md"), "w") as f:
        f.write("\n".join(sections) + "\n")
    print("\n".join(sections))
