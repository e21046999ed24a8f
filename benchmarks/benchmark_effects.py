"""What each diff does, on a real model: every RL script on SmolLM2-135M-Instruct (prepare_smollm2.py), offline, on the
CPU, and the headline effect of each algorithm against GRPO over seeds.

    pip install matplotlib                                           # the chart
    python -m benchmarks.benchmark_effects --jobs 2                  # every part, two one-thread runs at a time
    python -m benchmarks.benchmark_effects --parts scripts --jobs 2  # one part only: the page shows every run found so far

Every run shares one setting, EFFECT: the sums task ("What is 61 + 48?") with its system message "Solve the problem step
by step. ...", a budget of 64 new tokens (room for the model to explain, so that the length of a response can move), 4
prompts x 8 responses per step, a learning rate of 1e-5, no KL term (beta 0: the siblings differ in their losses, not in
a reference model), 16 steps, the 200 held-out problems answered greedily at steps 0, 8 and 16. The parts:
1. scripts: every RL script once (seed 1) with EFFECT and the few flags its algorithm needs (SCRIPT_FLAGS); grpo_tools.py
   learns its own real-model task, measured by `python -m benchmarks.benchmark_real_model --tools` (docs/real-model/tools.md);
2. headline: seeds 1-3 of GRPO and of each algorithm compared with it (HEADLINE);
3. pass-at-k: 8 answers sampled per held-out problem by the untrained model and the final GRPO, MaxRL and RLOO models:
   pass@k for k = 1, 2, 4, 8 (MaxRL's claim), and how GRPO's and RLOO's advantages weigh problems by how many of 8
   answers are right (the std normalisation's bias toward easy and hard problems);
4. preference: pairs of answers to sums problems by GRPO's seed-1 model, SmolLM2 after 16 steps of grpo.py (a
   problem's likeliest right answer against its likeliest wrong one, preference_pairs.sample_verifier_pairs, built once
   and kept beside the records), then the preference family and reward_model.py from the untrained model on them with
   PREFERENCE, some pairs held out by prompt.
--only limits the runs to some scripts (run the benchmark in parts: `--parts headline --only grpo dr_grpo`).
Each run is its own process, with --jobs processes at a time and cpu_count // jobs threads each. A complete run leaves
its record in DOCS_DIR/effects-runs/SCRIPT-seedN.json (its command, metrics rows, minutes, peak memory, the CPU and the
threads it had, and its code: a hash of the script and the modules it may run, the commit, transformers' version),
kept in git beside the page: a run with a record is not run again, on this checkout or another (so the benchmark
resumes and can be run in parts, across sessions), and a record or run folder made by another command or by other
code (made before records kept it, or the script or a module changed since) is refused until --fresh runs it again;
so is a final model for pass@k that is not its record's run, and preference pairs answered by another run of GRPO.
The page, DOCS_DIR/effects.md, and its chart, DOCS_DIR/effects.png, are written from every record found.
"""

import glob
import hashlib
import importlib.metadata
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import tyro

from benchmarks import prepare_smollm2
from benchmarks.benchmark_real_model import cpu_name, gib, run_measured, with_values

EFFECT = ["--task", "sums", "--max-new-tokens", "64", "--num-prompts", "4", "--group-size", "8", "--learning-rate", "1e-5"]
EFFECT += ["--beta", "0", "--total-steps", "16", "--eval-every", "8"]
# the flags a script needs beyond EFFECT, as (values replaced in EFFECT, flags added), and why
SCRIPT_FLAGS = {
    "grpo": ({}, []),
    "rloo": ({}, []),
    "dr_grpo": ({}, []),
    "dapo": ({}, []),  # its own defaults: clip-higher, dynamic sampling, an overlong buffer of half the budget
    "gspo": ({}, []),  # its own defaults: 4 minibatches, the sequence-level clip range
    # one response per prompt and a critic, its shape; lambda 1 (with 0.95 the score at the last of 64 tokens reaches the
    # first at 0.95^63 = 4%: VC-PPO, Yuan et al. 2025), the siblings' 2 updates per rollout, the critic at 10x the actor's
    # rate (verl's and OpenRLHF's ratio). With ppo.py's own 2 epochs x 4 minibatches, lambda 0.95 and the critic at 1e-5
    # it does not learn here (7.0% -> 7.5%, 92% of its responses cut at the budget): docs/effects.md#ppo-on-the-real-model
    "ppo": (
        {"--num-prompts": "32", "--group-size": "1"},
        ["--lam", "1.0", "--num-epochs", "1", "--num-minibatches", "2", "--critic-learning-rate", "1e-4"],
    ),
    "cispo": ({}, []),
    "reinforce_pp": ({}, []),
    "sapo": ({}, []),
    "maxrl": ({}, []),
    "opd": ({"--num-prompts": "32", "--group-size": "1"}, ["--teacher", "RUNS_DIR/grpo-seed1/model"]),  # a teacher
    "grpo_engine": ({}, []),  # its defaults: the built-in engine in bf16, token-level TIS
}
# the preference family: GRPO's seed-1 model answers PAIR_PROMPTS training problems of sums, PAIR_SAMPLES times each at
# temperature 1; its likeliest right answer against its likeliest wrong one where a problem has both (both ended, none cut
# at the budget). Not the untrained model's answers: right 7% of the time, they made 45 pairs of 512 problems x 8 (26
# minutes, one thread), too few to train on and hold out
PAIR_PROMPTS, PAIR_SAMPLES = 512, 8
PREFERENCE = ["--task", "sums", "--max-new-tokens", "64", "--num-eval", "64", "--batch-size", "16", "--total-steps", "40"]
PREFERENCE += ["--eval-every", "20"]  # each script's own learning rate and beta (tuned on addition: docs/results.md)
PREFERENCE_SCRIPTS = ("dpo", "ipo", "simpo", "orpo", "kto", "reward_model")
# the algorithm compared with GRPO in each headline effect, and the paper that claims it
HEADLINE = {
    "dr_grpo": "Dr. GRPO (Liu et al. 2025): no length or std normalisation, so wrong answers stop growing longer",
    "dapo": "DAPO (Yu et al. 2025, §3.1): clip-higher keeps the policy's entropy from collapsing",
    "maxrl": "MaxRL (Tajwar, Zeng et al. 2026): ascends log pass@k, a higher pass@k at a matched pass@1",
    "gspo": "GSPO (Zheng et al. 2025): a sequence-level ratio, clipped far more often than token ratios",
    "cispo": "CISPO (MiniMax 2025): clips the weight, not the update, so tokens past the clip keep their gradient",
    "rloo": "RLOO (Ahmadian et al. 2024): a leave-one-out baseline without std normalisation, unbiased",
}


@dataclass
class Args:
    model_dir: str = ""
    """the model folder (default: prepare_smollm2.py's, prepared now if missing)"""
    runs_dir: str = "runs/effects"
    """where the runs go"""
    docs_dir: str = "docs/real-model"
    """where effects.md and effects.png go"""
    parts: list[str] = field(default_factory=lambda: ["scripts", "headline", "pass-at-k", "preference"])
    """which parts to run (the page is written from every run found)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """the headline part's seeds to run (the page shows every seed recorded)"""
    only: list[str] = field(default_factory=list)
    """run only these scripts (default: all of SCRIPT_FLAGS and PREFERENCE_SCRIPTS)"""
    jobs: int = 1
    """runs at a time, each with cpu_count // jobs threads"""
    fresh: bool = False
    """rerun even when a complete run exists"""


def run_dir(args: Args, script: str, seed: int) -> str:
    return f"{args.runs_dir}/{script}-seed{seed}"


def record_path(args: Args, script: str, seed: int) -> str:
    return os.path.join(args.docs_dir, "effects-runs", f"{script}-seed{seed}.json")


def recorded_seeds(args: Args) -> list[int]:
    """Every seed some record was kept for: the page shows them all, whichever seeds this invocation runs."""
    records = os.path.join(args.docs_dir, "effects-runs")
    names = os.listdir(records) if os.path.isdir(records) else []
    return sorted({int(n[:-5].rsplit("-seed", 1)[1]) for n in names if n.endswith(".json") and "-seed" in n})


def script_flags(script: str, seed: int) -> list[str]:
    """The command line of SCRIPT with EFFECT (or PREFERENCE) at SEED, the model folder excluded; RUNS_DIR stands for
    --runs-dir and DOCS_DIR for --docs-dir."""
    if script in PREFERENCE_SCRIPTS:  # kto.py learns from each pair's two answers as separate, labelled examples
        pairs = "DOCS_DIR/effects-runs/sums-" + ("examples" if script == "kto" else "pairs") + ".jsonl"
        # kto.py holds out rows, two per pair: 128 rows are the same 64 prompts as its siblings' 64 pairs (one split)
        preference = with_values(PREFERENCE, {"--num-eval": "128"}) if script == "kto" else PREFERENCE
        return [*preference, "--dataset", pairs, "--seed", str(seed)]
    changes, extra = SCRIPT_FLAGS[script]
    return [*with_values(EFFECT, changes), *extra, "--seed", str(seed)]


def load_run(args: Args, script: str, seed: int) -> dict | None:
    """The record of SCRIPT at SEED, or None when it has not run yet."""
    path = record_path(args, script, seed)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def save_run(args: Args, script: str, seed: int, record: dict) -> None:
    os.makedirs(os.path.dirname(record_path(args, script, seed)), exist_ok=True)
    with open(record_path(args, script, seed), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


MODULES = ["common.py", "tasks.py", "reward_funcs.py", "engines.py", "tools.py", "preference_pairs.py"]  # a script may run


def code_version(script: str) -> dict:
    """What a record needs beyond its command to be reproducible: a hash of the script and of every module of the
    project it may run (MODULES and plumbing/), the commit they were at when known, and transformers' version."""
    digest = hashlib.sha256()
    for path in [f"{script}.py", *MODULES, *sorted(glob.glob("plumbing/*.py"))]:
        with open(path, "rb") as f:
            digest.update(path.encode() + b"\0" + f.read())
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = git.stdout.strip() if git.returncode == 0 else None
    return {"code_sha256": digest.hexdigest(), "commit": commit, "transformers": importlib.metadata.version("transformers")}


def made_by_other_code(made: dict | None, script: str) -> str | None:
    """Why a record or run folder (its `code`, None when it kept none) was not made by this checkout's code, or None."""
    if made is None:
        return "made before records kept their code version"
    if made["code_sha256"] != code_version(script)["code_sha256"]:
        return f"{script}.py or the modules it runs changed since it was made (at commit {made['commit']})"
    return None


def needs_running(args: Args, script: str, seed: int) -> bool:
    """Whether SCRIPT at SEED must run: --fresh, or no record yet; a record of another command, or made by other code
    than this checkout's (the script or a module it runs changed since), is refused."""
    record = load_run(args, script, seed)
    if record and not args.fresh:
        if record["command"] != [f"{script}.py", *script_flags(script, seed)]:
            raise SystemExit(f"{record_path(args, script, seed)} holds a run of another command; remove it or pass --fresh")
        if why := made_by_other_code(record.get("code"), script):
            raise SystemExit(f"{record_path(args, script, seed)}: {why}; --fresh runs it again")
    return args.fresh or record is None


def run_once(args: Args, script: str, seed: int) -> None:
    """SCRIPT at SEED with EFFECT (run_measured, with the thread count of --jobs) unless its record exists; saves the
    record. A run folder that holds another command's run is refused."""
    if not needs_running(args, script, seed):
        return
    command = [f"{script}.py", *script_flags(script, seed)]
    out = run_dir(args, script, seed)
    path = os.path.join(out, "flags.json")
    if os.path.isfile(path) and not args.fresh:
        with open(path) as f:
            if json.load(f) != command:
                raise SystemExit(f"{out} holds a run of another command; remove it or pass --fresh")
    code, code_path = code_version(script), os.path.join(out, "code.json")
    if os.path.isfile(os.path.join(out, "measured.json")) and not args.fresh:  # a complete run, about to be reused
        made = json.load(open(code_path)) if os.path.isfile(code_path) else None
        if why := made_by_other_code(made, script):
            raise SystemExit(f"{out}: {why}; remove it or pass --fresh")
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    paths = lambda flag: flag.replace("RUNS_DIR", args.runs_dir).replace("DOCS_DIR", args.docs_dir)
    flags = ["--model-name-or-path", args.model_dir, *map(paths, command[1:])]
    run = run_measured(command[0], flags, out, args.fresh, env={"OMP_NUM_THREADS": str(threads)})
    with open(path, "w") as f:
        json.dump(command, f)
    with open(code_path, "w") as f:
        json.dump(code, f)
    machine = {
        "cpu": cpu_name(),
        "torch": importlib.metadata.version("torch"),
        "threads": threads,
        "runs_at_a_time": args.jobs,
    }
    measured = {"seconds": run["seconds"], "peak_bytes": run["peak_bytes"], "rows": run["rows"]}
    save_run(args, script, seed, {"command": command, "code": code, **machine, **measured})


def run_all(args: Args, runs: list[tuple[str, int]]) -> None:
    """Every (script, seed) of RUNS, --jobs at a time, in order; opd.py's waits for its teacher, GRPO's seed-1 model."""
    with ThreadPoolExecutor(args.jobs) as pool:
        done = {}
        for script, seed in runs:
            teacher = done.get(("grpo", 1)) if script == "opd" else None
            done[script, seed] = pool.submit(lambda c=(script, seed), t=teacher: (t and t.result(), run_once(args, *c)))
        for future in done.values():
            future.result()  # a failed run stops the benchmark, with its log's path


def correct_counts(model_dir: str, threads: int) -> list[int]:
    """How many of 8 answers are right for each held-out problem, sampled at temperature 1 with 64 new tokens and the
    chat template applied as in training (common.sampled_correct_counts)."""
    import torch

    import common
    import tasks
    from plumbing import models

    torch.set_num_threads(threads)
    model, tokenizer = models.load_model_and_tokenizer(model_dir, "", torch.device("cpu"), "sums")
    task = tasks.apply_chat_template(tasks.make_task("sums"), tokenizer, "auto", "")
    return common.sampled_correct_counts(model, tokenizer, task, task.eval, 64, 8, 1.0, 512).int().tolist()


def sample_final_model(args: Args, script: str, seed: int) -> None:
    """correct_counts of a run's final model and its pass@k for k = 1, 2, 4, 8 (the unbiased estimator,
    common.pass_at_k_samples), saved to its record: measured once, while the run's model folder is there."""
    record = load_run(args, script, seed)
    if args.fresh or "correct_counts" not in record:
        model_dir = os.path.join(run_dir(args, script, seed), "model")
        if not os.path.isdir(model_dir):
            raise SystemExit(f"pass@k of {script}.py seed {seed} needs {model_dir}, not here; run it again with --fresh")
        code_path = os.path.join(run_dir(args, script, seed), "code.json")
        if not os.path.isfile(code_path) or json.load(open(code_path)) != record.get("code"):
            raise SystemExit(f"pass@k of {script}.py seed {seed}: {model_dir} is not the model of its record; --fresh")
        import torch

        import common

        record["correct_counts"] = correct_counts(model_dir, max(1, (os.cpu_count() or 1) // args.jobs))
        passes = common.pass_at_k_samples(torch.tensor(record["correct_counts"]), 8)
        record["pass_at_k"] = {k: v.float().mean().item() for k, v in passes.items()}
        save_run(args, script, seed, record)


def sample_untrained_model(args: Args) -> list[int]:
    """correct_counts of the untrained model, kept in DOCS_DIR/effects-runs/untrained.json."""
    path = os.path.join(args.docs_dir, "effects-runs", "untrained.json")
    if args.fresh or not os.path.isfile(path):
        counts = correct_counts(args.model_dir, max(1, (os.cpu_count() or 1) // args.jobs))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"model": "SmolLM2-135M-Instruct, untrained", "cpu": cpu_name(), "correct_counts": counts}, f)
    with open(path) as f:
        return json.load(f)["correct_counts"]


# problems by how many of 8 sampled answers are right; all right or all wrong carry no advantage in either script
DIFFICULTY = {"hard (1-2 of 8 right)": (1, 2), "middle (3-5)": (3, 5), "easy (6-7)": (6, 7)}


def update_weight_shares(counts: list[int], compute_advantages) -> dict:
    """The share of an update's total |advantage| that goes to the problems of each DIFFICULTY band, were each problem a
    group of 8 answers with COUNTS of them right, weighed by COMPUTE_ADVANTAGES (grpo.py's or rloo.py's own)."""
    import torch

    counts = [int(c) for c in counts]  # (the verifier's scores are floats)
    rewards = torch.tensor([[1.0] * c + [0.0] * (8 - c) for c in counts]).view(-1)  # (P * 8,) each group contiguous
    weight = compute_advantages(rewards, 8).abs().view(-1, 8).sum(dim=1)  # (P,) a problem's total |A|
    band = lambda low, high: torch.tensor([low <= c <= high for c in counts])
    return {name: (weight[band(*bounds)].sum() / weight.sum()).item() for name, bounds in DIFFICULTY.items()}


def pair_files(pairs: dict, plain: dict) -> tuple[list[dict], list[dict]]:
    """The rows of sums-pairs.jsonl (dpo.py and its siblings, reward_model.py) and sums-examples.jsonl (kto.py) from
    sample_verifier_pairs's PAIRS, whose prompts are rendered with the chat template: each gets back its plain prompt
    and answer from PLAIN (rendered prompt -> (prompt, answer)), so that each script renders it again as in training
    (a rendered prompt is refused); each answer keeps the end id it was sampled with."""
    rows, examples = [], []
    keys = ("prompt", "chosen", "rejected", "chosen_end", "rejected_end")
    for prompt, chosen, rejected, chosen_end, rejected_end in zip(*(pairs[k] for k in keys)):
        question, answer = plain[prompt]
        rows.append({"prompt": question, "answer": answer, "chosen": chosen, "rejected": rejected})
        rows[-1].update({"chosen_end": chosen_end, "rejected_end": rejected_end})
        for completion, end, label in ((chosen, chosen_end, True), (rejected, rejected_end, False)):
            examples.append({"prompt": question, "answer": answer, "completion": completion, "completion_end": end})
            examples[-1]["label"] = label
    return rows, examples


def build_pairs(args: Args) -> dict:
    """PAIR_PROMPTS problems answered PAIR_SAMPLES times by GRPO's seed-1 model (preference_pairs.sample_verifier_pairs,
    seeded), written to DOCS_DIR/effects-runs/sums-pairs.jsonl and sums-examples.jsonl with how they were built in
    sums-pairs.json (kept, so built once on any checkout); returns that."""
    folder = os.path.join(args.docs_dir, "effects-runs")
    path = os.path.join(folder, "sums-pairs.json")
    answerer = (load_run(args, "grpo", 1) or {}).get("code")  # the record of the run whose model answers
    if os.path.isfile(path) and not args.fresh and json.load(open(path)).get("answered_by") != answerer:
        raise SystemExit(f"{path}: built from another run of grpo.py seed 1 than its record's; --fresh builds them again")
    if args.fresh or not os.path.isfile(path):
        answering = os.path.join(run_dir(args, "grpo", 1), "model")
        if not os.path.isdir(answering):
            raise SystemExit(f"--parts preference: the pairs' answers come from {answering}, not here: run grpo seed 1 first")
        import time
        from types import SimpleNamespace

        import torch

        import preference_pairs
        import tasks
        from plumbing import models

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.jobs))  # as a run: cpu_count // jobs threads
        start = time.time()
        model, tokenizer = models.load_model_and_tokenizer(answering, "", torch.device("cpu"), "sums")
        plain = tasks.make_task("sums")
        task = tasks.apply_chat_template(plain, tokenizer, "auto", "")
        plain_of = dict(zip(task.train["prompt"], zip(plain.train["prompt"], plain.train["answer"])))
        settings = SimpleNamespace(num_pair_prompts=PAIR_PROMPTS, group_size=PAIR_SAMPLES, max_new_tokens=64)
        torch.manual_seed(0)
        pairs, skipped = preference_pairs.sample_verifier_pairs(model, tokenizer, task, settings, torch.device("cpu"))
        rows, examples = pair_files(pairs[:], plain_of)
        os.makedirs(folder, exist_ok=True)
        for name, lines in (("sums-pairs.jsonl", rows), ("sums-examples.jsonl", examples)):
            with open(os.path.join(folder, name), "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        built = {"prompts": PAIR_PROMPTS, "samples": PAIR_SAMPLES, "pairs": len(rows), "skipped": skipped}
        built.update({"seconds": time.time() - start, "cpu": cpu_name(), "threads": torch.get_num_threads()})
        built["answered_by"] = answerer
        with open(path, "w") as f:
            json.dump(built, f, indent=1)
    with open(path) as f:
        built = json.load(f)
    if "chosen_tokens" not in built:  # (a file built before the lengths were kept)
        built.update(pair_lengths(args.model_dir, os.path.join(folder, "sums-pairs.jsonl")))
        with open(path, "w") as f:
            json.dump(built, f, indent=1)
    return built


def pair_lengths(model_dir: str, pairs_path: str) -> dict:
    """The mean length of the chosen and of the rejected answers in the model's tokens, and in how many pairs each is the
    longer: what a preference loss could learn about length from these pairs."""
    from plumbing import models

    tokenizer = models.load_tokenizer(model_dir, "", "sums")
    with open(pairs_path) as f:
        rows = [json.loads(line) for line in f]
    length = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    chosen, rejected = [length(r["chosen"]) for r in rows], [length(r["rejected"]) for r in rows]
    return {
        "chosen_tokens": sum(chosen) / len(rows),
        "rejected_tokens": sum(rejected) / len(rows),
        "chosen_longer": sum(c > r for c, r in zip(chosen, rejected)),
        "rejected_longer": sum(r > c for c, r in zip(chosen, rejected)),
    }


def mean_over(rows: list[dict], key: str, steps: range) -> float:
    """The mean of KEY over the rows of STEPS that log it (nan when none does)."""
    values = [r[key] for r in rows if r["step"] in steps and key in r]
    return sum(values) / len(values) if values else float("nan")


FIRST, LAST = range(1, 3), range(15, 17)  # the first two and the last two steps of a 16-step run


def script_row(script: str, flags: list[str], run: dict) -> str:
    evals = [r for r in run["rows"] if "eval/accuracy" in r]
    accuracy = " -> ".join(f"{r['eval/accuracy']:.1%}" for r in evals)
    length = f"{evals[0]['eval/response_length']:.1f} -> {evals[-1]['eval/response_length']:.1f}"
    pair = lambda key, fmt: f"{mean_over(run['rows'], key, FIRST):{fmt}} -> {mean_over(run['rows'], key, LAST):{fmt}}"
    gain = 100 * (evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"])
    return (
        f"| `{script}.py` | `{' '.join(flags)}` | {accuracy} | {gain:+.1f} | {length} | {pair('train/entropy', '.2f')} | "
        f"{pair('rollout/truncated_frac', '.0%')} | {run['seconds'] / 60:.1f} | {gib(run['peak_bytes'])} |"
    )


def measured_on(args: Args) -> list[str]:
    """One line per machine and setting the records were measured with, and how many runs each."""
    scripts = (*SCRIPT_FLAGS, *PREFERENCE_SCRIPTS)
    records = [r for r in (load_run(args, s, seed) for s in scripts for seed in recorded_seeds(args)) if r]
    settings = [(r["cpu"], r["torch"], r["runs_at_a_time"], r["threads"]) for r in records]
    plural = lambda n, noun: f"{n} {noun}{'s' if n > 1 else ''}"
    lines = []
    for setting in sorted(set(settings)):
        cpu, torch, jobs, threads = setting
        minutes = sum(r["seconds"] for r, other in zip(records, settings) if other == setting) / 60
        lines.append(
            f"- {cpu}, torch {torch}, {plural(jobs, 'run')} at a time with {plural(threads, 'thread')} each: "
            f"{plural(settings.count(setting), 'run')}, {minutes:.0f} minutes in all, about {minutes / jobs:.0f} of wall clock"
        )
    return lines or ["- no run yet"]


def scripts_section(args: Args) -> list[str]:
    base = " ".join(EFFECT)
    lines = [
        f"Each script with `--model-name-or-path MODEL_DIR {base} --seed 1` and the flags of its row beyond those; the "
        "entropy (nats per sampled token, `train/entropy`) and the share of rollouts cut at the budget are the means of "
        "steps 1-2 and of steps 15-16.",
        "",
        "| script | command beyond the model | held-out accuracy, steps 0, 8, 16 | points | greedy length (tokens) | "
        "entropy | cut at the budget | minutes | peak memory (GiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for script in SCRIPT_FLAGS:
        flags = script_flags(script, 1)
        run = load_run(args, script, 1)
        shown = flags[len(EFFECT) :] if flags[: len(EFFECT)] == EFFECT else flags
        lines.append(script_row(script, shown, run) if run else f"| `{script}.py` | `{' '.join(shown)}` | not run yet |")
    lines += [
        "",
        "`grpo_tools.py` learns its own task on this model (products, the calculator called in the chat format, after a "
        "supervised warm-up): `python -m benchmarks.benchmark_real_model --tools` measures it, in [tools.md](tools.md).",
    ]
    return lines


def at_evaluations(evals: list[dict], key: str, fmt: str) -> str:
    """KEY at each evaluation, "a -> b -> c", or "-" where the script does not log it."""
    return " -> ".join(f"{r[key]:{fmt}}" for r in evals) if key in evals[0] else "-"


def preference_section(args: Args) -> list[str]:
    path = os.path.join(args.docs_dir, "effects-runs", "sums-pairs.json")
    if not os.path.isfile(path):
        return ["Not run yet: `python -m benchmarks.benchmark_effects --parts preference`."]
    with open(path) as f:
        built = json.load(f)
    lines = [
        f"The pairs: GRPO's seed-1 model (SmolLM2-135M-Instruct after 16 steps of `grpo.py` above) answered "
        f"{built['prompts']} training problems of sums {built['samples']} times each at temperature 1 (64 new tokens, the "
        "chat template and the task's system message, as in RL); the untrained model is right too rarely (45 pairs from "
        "512 problems x 8). Where a problem "
        "had a right and a wrong answer, both ended, its most frequent right answer is chosen and its most frequent wrong "
        f"one rejected: {built['pairs']} pairs ({built['skipped']} problems had no such pair), built in "
        f"{built['seconds'] / 60:.1f} minutes with {built['threads']} thread(s) on {built['cpu']}. The chosen answers are "
        f"{built['chosen_tokens']:.1f} tokens long on average, the rejected {built['rejected_tokens']:.1f} (the rejected "
        f"is the longer in {built['rejected_longer']} pairs, the chosen in {built['chosen_longer']}). They are "
        "[effects-runs/sums-pairs.jsonl](effects-runs/sums-pairs.jsonl); kto.py reads each pair as a desirable and an "
        "undesirable example (sums-examples.jsonl).",
        "",
        f"Each script from the untrained model, `--model-name-or-path MODEL_DIR {' '.join(PREFERENCE)} --dataset PAIRS "
        "--seed 1`, with its own learning rate and beta: 64 pairs are held out by prompt; the preference accuracy is the "
        "implicit reward's on them (reward_model.py: its score's; kto.py: each held-out example on its side of the "
        "reference point z0), the task accuracy and the length are those of the policy's greedy answers to their 64 "
        "prompts.",
        "",
        "| script | held-out preference accuracy, steps 0, 20, 40 | task accuracy | greedy length (tokens) | minutes | "
        "peak memory (GiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for script in PREFERENCE_SCRIPTS:
        run = load_run(args, script, 1)
        if not run:
            lines.append(f"| `{script}.py` | not run yet |")
            continue
        key = "eval/pairwise_accuracy" if script == "reward_model" else "eval/rewards_accuracies"
        evals = [r for r in run["rows"] if key in r]
        cells = [at_evaluations(evals, name, fmt) for name, fmt in ((key, ".1%"), ("eval/accuracy", ".1%"))]
        cells += [at_evaluations(evals, "eval/response_length", ".1f"), f"{run['seconds'] / 60:.1f}", gib(run["peak_bytes"])]
        lines.append(f"| `{script}.py` | {' | '.join(cells)} |")
    return lines


def spread(values: list[float], fmt: str) -> str:
    """mean (min-max) over seeds, or the one value."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{sum(values) / len(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


# what each headline comparison shows: (label, metric of a run) pairs
def final_accuracy(run: dict) -> float:
    return [r["eval/accuracy"] for r in run["rows"] if "eval/accuracy" in r][-1]


def past_clip_share(run: dict) -> float:
    """The share of tokens whose ratio lies past the clip range on the advantage's side (above 1 + eps with A > 0,
    below 1 - eps with A < 0), over the 16 steps: GRPO's min() gives them no gradient, CISPO's clipped weight keeps it
    (gspo.py logs its sequence ratio on each token, so there it is the share of tokens in clipped sequences)."""
    keys = ("train/clip_frac_high", "train/clip_frac_low")
    return sum(mean_over(run["rows"], key, range(1, 17)) for key in keys)


METRICS = {
    "dr_grpo": [
        ("held-out accuracy at step 16", final_accuracy, ".1%"),
        (
            "greedy length at step 16",
            lambda r: [x["eval/response_length"] for x in r["rows"] if "eval/accuracy" in x][-1],
            ".1f",
        ),
        (
            "right responses' length, steps 13-16",
            lambda r: mean_over(r["rows"], "rollout/response_length_correct", range(13, 17)),
            ".1f",
        ),
        (
            "wrong responses' length, steps 13-16",
            lambda r: mean_over(r["rows"], "rollout/response_length_wrong", range(13, 17)),
            ".1f",
        ),
        ("cut at the budget, steps 13-16", lambda r: mean_over(r["rows"], "rollout/truncated_frac", range(13, 17)), ".0%"),
    ],
    "dapo": [
        ("held-out accuracy at step 16", final_accuracy, ".1%"),
        ("entropy, steps 1-4", lambda r: mean_over(r["rows"], "train/entropy", range(1, 5)), ".3f"),
        ("entropy, steps 13-16", lambda r: mean_over(r["rows"], "train/entropy", range(13, 17)), ".3f"),
    ],
    "gspo": [
        ("held-out accuracy at step 16", final_accuracy, ".1%"),
        ("tokens past the clip on the advantage's side, steps 1-16", past_clip_share, ".2%"),
        ("ratio min, steps 1-16", lambda r: min(x.get("train/ratio_min", 1.0) for x in r["rows"]), ".3f"),
        ("ratio max, steps 1-16", lambda r: max(x.get("train/ratio_max", 1.0) for x in r["rows"]), ".3f"),
    ],
    "cispo": [
        ("held-out accuracy at step 16", final_accuracy, ".1%"),
        ("tokens past the clip on the advantage's side, steps 1-16", past_clip_share, ".2%"),
    ],
    "maxrl": [("held-out accuracy at step 16", final_accuracy, ".1%")],
    "rloo": [("held-out accuracy at step 16", final_accuracy, ".1%")],  # and the update's weight by difficulty, below
}


def difficulty_rows(args: Args, runs: dict) -> list[str]:
    """The share of the update each script's advantages give to hard, middle and easy problems: on the untrained model's
    answers (the same counts, each script's weights), on each script's own final model's answers, and both weightings on
    the same answers, those of every final model of either script."""
    import grpo
    import rloo

    weigh = {"grpo": grpo.compute_advantages, "rloo": rloo.compute_advantages}
    untrained = os.path.join(args.docs_dir, "effects-runs", "untrained.json")
    lines = []
    if os.path.isfile(untrained):
        with open(untrained) as f:
            counts = json.load(f)["correct_counts"]
        shares = {s: update_weight_shares(counts, weigh[s]) for s in weigh}
        for band in DIFFICULTY:
            lines.append(
                f"| weight on {band} problems, the untrained model's answers | {shares['grpo'][band]:.1%} | "
                f"{shares['rloo'][band]:.1%} |"
            )
    for band in DIFFICULTY:
        cells = [
            spread(
                [update_weight_shares(r["correct_counts"], weigh[s])[band] for r in runs[s] if r and "correct_counts" in r],
                ".1%",
            )
            for s in weigh
        ]
        lines.append(f"| weight on {band} problems, its own model's answers at step 16 | {cells[0]} | {cells[1]} |")
    # the bias itself: both weightings on the same answers, those of every final model found (GRPO's and RLOO's)
    answers = [r["correct_counts"] for s in weigh for r in runs[s] if r and "correct_counts" in r]
    for band in DIFFICULTY:
        cells = [spread([update_weight_shares(counts, weigh[s])[band] for counts in answers], ".1%") for s in weigh]
        lines.append(f"| weight on {band} problems, the same answers (every final model's) | {cells[0]} | {cells[1]} |")
    return lines


def headline_section(args: Args) -> list[str]:
    lines = []
    for other, claim in HEADLINE.items():
        runs = {s: [load_run(args, s, seed) for seed in recorded_seeds(args)] for s in ("grpo", other)}
        seeds = {s: [seed for seed, r in zip(recorded_seeds(args), runs[s]) if r] for s in runs}
        lines += [f"### {other}.py against grpo.py", "", f"The claim: {claim}.", ""]
        lines += [
            f"Seeds found: grpo.py {seeds['grpo'] or 'none'}, {other}.py {seeds[other] or 'none'}; each cell is the mean "
            "(min-max) over them.",
            "",
        ]
        lines += ["| measure | `grpo.py` | `" + other + ".py` |", "| --- | --- | --- |"]
        for label, metric, fmt in METRICS[other]:
            cells = [spread([metric(r) for r in runs[s] if r], fmt) for s in ("grpo", other)]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
        if other == "maxrl":
            found = {s: [r["pass_at_k"] for r in runs[s] if r and "pass_at_k" in r] for s in ("grpo", "maxrl")}
            for k in (1, 2, 4, 8):
                cells = [spread([p[f"eval/pass@{k}"] for p in found[s]], ".1%") for s in ("grpo", "maxrl")]
                lines.append(f"| pass@{k} at step 16 (8 samples, temperature 1) | {cells[0]} | {cells[1]} |")
        if other == "rloo":
            lines += difficulty_rows(args, runs)
        lines.append("")
    return lines


def plot_effects(args: Args, path: str) -> None:
    """One panel per headline effect, each the quantity its section of the page discusses: the per-step curve of GRPO
    and of the other algorithm (the mean over the seeds found, their range shaded), pass@k of the final models, and
    for RLOO each estimator's weight on hard, middle and easy problems (bars: the mean, the seeds' range as whiskers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import grpo
    import rloo

    panels = [
        ("dr_grpo", "rollout/response_length_wrong", "wrong responses' length (tokens)"),
        ("dapo", "train/entropy", "entropy (nats per token)"),
        ("maxrl", "pass@k", "pass@k at step 16"),
        ("gspo", "past the clip", "share of tokens past the clip (log)"),
        ("cispo", "past the clip", "share of tokens past the clip (log)"),
        ("rloo", "weights", "share of |advantage|, own final answers"),
    ]
    weigh = {"grpo": grpo.compute_advantages, "rloo": rloo.compute_advantages}
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.4))
    for ax, (other, key, label) in zip(axes.flat, panels):
        for i, (script, color) in enumerate((("grpo", "tab:blue"), (other, "tab:orange"))):
            runs = [r for r in (load_run(args, script, seed) for seed in recorded_seeds(args)) if r]
            if key == "weights":  # the estimator's weight per difficulty band on its own final model's answers
                shares = [update_weight_shares(r["correct_counts"], weigh[script]) for r in runs if "correct_counts" in r]
                if not shares:
                    continue
                values = [[s[band] for s in shares] for band in DIFFICULTY]
                mean = [sum(v) / len(v) for v in values]
                spread = [[m - min(v) for m, v in zip(mean, values)], [max(v) - m for m, v in zip(mean, values)]]
                xs = [j + (i - 0.5) * 0.38 for j in range(len(DIFFICULTY))]
                ax.bar(xs, mean, 0.38, yerr=spread, color=color, capsize=3, label=f"{script}.py ({len(shares)} seeds)")
                ax.set_xticks(range(len(DIFFICULTY)), [band.split(" (")[0] for band in DIFFICULTY], fontsize=8)
                continue
            if key == "pass@k":  # pass@1..8 of the final models, where pass_at_k measured them
                found = [r["pass_at_k"] for r in runs if "pass_at_k" in r]
                curves = [{int(k.split("@")[1]): v for k, v in p.items() if "pass@" in k} for p in found]
            elif key == "past the clip":  # both sides, as the page's table counts them (past_clip_share)
                high, low = "train/clip_frac_high", "train/clip_frac_low"
                curves = [{x["step"]: x[high] + x[low] for x in r["rows"] if high in x} for r in runs]
            else:
                curves = [{x["step"]: x[key] for x in r["rows"] if key in x} for r in runs]
            xs = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not xs:
                continue
            values = [[c[x] for c in curves] for x in xs]
            mean = [sum(v) / len(v) for v in values]
            ax.plot(xs, mean, color=color, marker=".", label=f"{script}.py ({len(curves)} seeds)")
            ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.2, lw=0)
        ax.set_title(f"{other}.py vs grpo.py", fontsize=9)
        ax.set_ylabel(label, fontsize=8)
        ax.set_xlabel({"pass@k": "k", "weights": "problems (right answers of 8)"}.get(key, "step"), fontsize=8)
        if key == "past the clip":  # GRPO's shares sit two orders of magnitude below GSPO's: a linear axis hides them
            ax.set_yscale("symlog", linthresh=1e-4)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle(
        "SmolLM2-135M-Instruct, sums, 64 new tokens, 32 responses a step: the mean over seeds, their range shaded",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    args = tyro.cli(Args)
    for part in args.parts:
        if part not in ("scripts", "headline", "pass-at-k", "preference"):
            raise SystemExit(f"--parts: {part!r} is not one of scripts, headline, pass-at-k, preference")
    for script in args.only:
        if script not in (*SCRIPT_FLAGS, *PREFERENCE_SCRIPTS):
            raise SystemExit(f"--only: {script!r} is not one of {', '.join((*SCRIPT_FLAGS, *PREFERENCE_SCRIPTS))}")
    if args.jobs < 1:
        raise SystemExit("--jobs must be at least 1")
    args.model_dir = args.model_dir or prepare_smollm2.prepare()
    os.makedirs(args.runs_dir, exist_ok=True)
    os.makedirs(args.docs_dir, exist_ok=True)
    scripts = [s for s in (*SCRIPT_FLAGS, *PREFERENCE_SCRIPTS) if not args.only or s in args.only]
    runs = [(s, 1) for s in scripts if s in SCRIPT_FLAGS] if "scripts" in args.parts else []
    if "headline" in args.parts:
        runs += [(s, seed) for seed in args.seeds for s in ("grpo", *HEADLINE) if s in scripts and (s, seed) not in runs]
    teacher = os.path.join(run_dir(args, "grpo", 1), "model")
    if ("opd", 1) in runs and needs_running(args, "opd", 1) and not os.path.isdir(teacher):
        if ("grpo", 1) not in runs or not needs_running(args, "grpo", 1):
            raise SystemExit(f"opd.py's teacher, GRPO's seed-1 model {teacher}, is not here: add `--only grpo` (with --fresh)")
    if "preference" in args.parts and any(s in PREFERENCE_SCRIPTS for s in scripts):
        build_pairs(args)  # before any run
        runs += [(s, 1) for s in scripts if s in PREFERENCE_SCRIPTS]
    run_all(args, runs)
    if "pass-at-k" in args.parts:
        sample_untrained_model(args)
        for script, seed in [(s, seed) for s in ("grpo", "maxrl", "rloo") if s in scripts for seed in args.seeds]:
            if load_run(args, script, seed):
                sample_final_model(args, script, seed)
    lines = [
        "`python -m benchmarks.benchmark_effects`: SmolLM2-135M-Instruct, offline, on the CPU. Where each run was measured:",
        "",
        *measured_on(args),
        "",
        "## Every RL script",
        "",
        *scripts_section(args),
        "",
        "## Headline effects against GRPO",
        "",
        *headline_section(args),
        "## The preference family",
        "",
        *preference_section(args),
    ]
    with open(os.path.join(args.docs_dir, "effects.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_effects(args, os.path.join(args.docs_dir, "effects.png"))
    print("\n".join(lines))
