"""Each script end to end for two steps on a briefly warmed-up tiny model: once through its command line in a fresh
process, and for the checks that need several runs, in this process (same code path, without paying for the imports
again)."""

import json
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import common
import grpo
import sft
import tasks
from plumbing import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 64 addition problems as a data file, 4 of them held out: a test run's evaluations cost little (the built-in task
# evaluates 500). A test that gives --dataset after SMALL trains on its own file instead.
PROBLEMS = os.path.join(tempfile.mkdtemp(prefix="tiny-rlhf-tests-"), "addition.jsonl")
with open(PROBLEMS, "w") as f:
    f.writelines(json.dumps({"prompt": f"{a:02d}+{a % 9 + 11}=", "answer": a + a % 9 + 11}) + "\n" for a in range(64))
SMALL = ["--total-steps", "2", "--num-prompts", "4", "--group-size", "4", "--eval-every", "1", "--device", "cpu"]
SMALL += ["--dataset", PROBLEMS, "--num-eval", "4"]


PARTIAL_CREDIT = """
def partial_credit(prompts, completions, answer, **columns):
    # the share of the answer's characters that the completion has in the same place
    return [sum(x == y for x, y in zip(c.strip(), a)) / len(a) for c, a in zip(completions, answer)]


def exact(completions, answer, **columns):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""


def run(script, *flags):
    """The script's command line, in a fresh process."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    return subprocess.run([sys.executable, script, *flags], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def run_here(monkeypatch, script, *flags):
    """The script's command line, in this process."""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(sys, "argv", [script, *flags])
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


def coin_flip_rewards(monkeypatch, p=0.3, seed=0):
    """Replace the verifier by seeded coin flips that are correct with probability p: the briefly warmed-up test model
    answers nothing right, and DAPO's dynamic sampling needs groups whose answers are neither all right nor all wrong."""
    generator = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(tasks.Task, "verify", lambda self, c, a: (torch.rand(len(c), generator=generator) < p).float())


def rows(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(
    "script, keys",
    [
        ("grpo.py", ["loss/policy", "kl/ref", "loss/kl", "train/clip_frac_low", "train/entropy", "rollout/truncated_frac"]),
        ("rloo.py", ["kl/ref", "train/clip_frac_high"]),
        ("dr_grpo.py", ["train/ratio_max"]),
        ("gspo.py", ["train/clip_frac_low"]),
        ("ppo.py", ["loss/value", "train/explained_variance", "train/advantage_std", "kl/ref", "rollout/kl_penalty"]),
        ("cispo.py", ["train/clip_frac_high", "train/clip_frac_high_negative"]),
        ("reinforce_pp.py", ["kl/ref", "loss/kl"]),
        ("sapo.py", ["train/gate_weight", "kl/ref"]),
        ("maxrl.py", ["kl/ref", "eval/pass@1", "eval/pass@2"]),  # with --eval-samples 2
        ("opd.py", ["kl/teacher", "rollout/gold_accuracy"]),
        ("grpo_engine.py", ["rollout/logprob_gap_max", "kl/engine", "train/is_log_ratio_min", "rollout/staleness", "kl/ref"]),
    ],
)
def test_end_to_end_through_the_command_line(monkeypatch, model_dir, teacher_dir, tmp_path, script, keys):
    flags = ["--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL]
    flags += ["--teacher", teacher_dir] if script == "opd.py" else []
    flags += ["--gradient-checkpointing"] if script == "rloo.py" else []  # the same run, layers recomputed
    flags += ["--eval-samples", "2"] if script == "maxrl.py" else []  # pass@1 and pass@2 beside the greedy accuracy
    # a reward function file of the user's own, as they write it: partial credit (MaxRL's estimator needs 0 or 1)
    (tmp_path / "my_rewards.py").write_text(PARTIAL_CREDIT)
    flags += ["--reward-funcs", f"{tmp_path / 'my_rewards.py'}:{'exact' if script == 'maxrl.py' else 'partial_credit'}"]
    # through the command line, in this process (a fresh interpreter costs seconds of imports); a copy of grpo.py runs in
    # a fresh interpreter, exactly as a user runs it, in test_the_docs_own_task_runs_from_the_command_line
    run_here(monkeypatch, script, *flags)
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [0, 1, 2] and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in logged)
    for key in ["rollout/reward_mean", "rollout/response_length", "time/step", "train/responses", *keys]:
        assert key in logged[-1], key
    assert os.path.isfile(os.path.join(tmp_path, "model", "config.json"))
    with open(os.path.join(tmp_path, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4 + [2] * 4  # four answers at each evaluation
    assert set(samples[0]) == {"step", "prompt", "completion", "answer", "reward"}
    # the reward trained on is the function's (weight 1), and eval/accuracy the share of exactly right answers among the
    # 4 held-out problems (all of them in samples.jsonl): k / 4 in float32, exact
    name = "exact" if script == "maxrl.py" else "partial_credit"
    assert (
        logged[1][f"reward/{name}"] == pytest.approx(logged[1]["rollout/reward_mean"], rel=1e-6)
        and f"reward/{name}_std" in logged[1]
    )
    for r in logged:
        exact = [s["completion"].strip() == s["answer"] for s in samples if s["step"] == r["step"]]
        assert r["eval/accuracy"] == sum(exact) / 4


def test_warm_up_check_is_greedy_decoding_accuracy(model_dir):
    """sft.greedy_accuracy (one teacher-forced pass) against common.evaluate (token-by-token greedy decoding): problems
    whose answer is set to the model's own greedy output count as correct, those whose answer is altered do not."""
    import datasets

    model, tokenizer = models.load_model_and_tokenizer(model_dir, "", torch.device("cpu"))
    task = tasks.make_task("addition")
    prompts = task.train[:300]["prompt"]
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, torch.device("cpu"))
    ids, mask, truncated = common.generate(model, tokenizer, prompt_ids, prompt_mask, 8, temperature=0.0)
    texts = common.decode(tokenizer, ids, mask, truncated)
    rows = [(p, t) for p, t, cut in zip(prompts, texts, truncated.tolist()) if not cut and t and " " not in t]
    assert len(rows) >= 20, "the test model should end some answers"
    answers = [t if i % 3 else t + "7" for i, (_, t) in enumerate(rows)]  # every third answer made wrong
    data = datasets.Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": answers, "solution": answers})
    expected = sum(1 for i in range(len(rows)) if i % 3) / len(rows)
    # fractions k / n: float32 rounds each once, by < u = 6e-8 relative
    assert sft.greedy_accuracy(model, tokenizer, data) == pytest.approx(expected, rel=1e-6)
    assert common.evaluate(model, tokenizer, tasks.Task("check", data, data, tasks.addition_answer), 8)[
        "eval/accuracy"
    ] == pytest.approx(expected, rel=1e-6)


def test_dpo_end_to_end_through_the_command_line(monkeypatch, model_dir, tmp_path):
    pairs = [
        {
            "prompt": f"{a:02d}+{b:02d}=",
            "chosen": str(a + b)[::-1],
            "rejected": str(a + b + 1)[::-1],
            "answer": str(a + b)[::-1],
        }
        for a, b in ((7, 45), (13, 9), (20, 31), (8, 8), (41, 17), (66, 3))
    ]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs + pairs[:2]))
    flags = ["--dataset", str(tmp_path / "pairs.jsonl"), "--batch-size", "4", "--micro-batch-size", "2", "--total-steps", "2"]
    flags += ["--num-eval", "2"]  # held-out pairs, by prompt: the implicit reward is evaluated on them, their answers too
    run_here(
        monkeypatch, "dpo.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path), "--eval-every", "1", *flags
    )
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [0, 1, 2] and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in logged)
    # the policy is the reference, and both score the held-out pairs in the same chunks: 0 to the bit
    assert logged[0]["data/pairs"] == 6 and logged[0]["eval/rewards_margins"] == 0.0
    assert {"eval/rewards_accuracies", "eval/rewards_chosen", "eval/rewards_rejected", "eval/loss_dpo"} <= set(logged[2])
    for key in ("loss/dpo", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert key in logged[-1], key
    # The policy is the reference at the first step, and its micro-batches have the reference pass's shape (2 pairs,
    # padded to the data's widest), so each row's sums run in the same order: 0 to the bit; 1e-6 is slack for the last
    # bits. (One update later the margins are 1e-3.)
    assert logged[1]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert os.path.isfile(os.path.join(tmp_path, "model", "config.json"))


def test_same_seed_same_metrics(model_dir, tmp_path, monkeypatch):
    runs = []
    for name in ("a", "b"):
        run_here(monkeypatch, "grpo.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path / name), *SMALL)
        runs.append([{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows(tmp_path / name)])
    assert runs[0] == runs[1] and len(runs[0]) == 3  # exactly: the same seed, shapes and kernels, in one process


def test_later_minibatches_are_off_policy(model_dir, tmp_path, monkeypatch):
    """With two minibatches the second one's ratios depart from 1: the old log-probs are the behaviour policy's, not
    the current ones. Random rewards stand in for a competent policy, so that the first update moves the policy."""
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(tasks.Task, "verify", lambda self, c, a: torch.randint(0, 2, (len(c),), generator=generator).float())
    run_here(monkeypatch, "grpo.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL)
    step = rows(tmp_path)[1]
    # Without an update the ratios are exactly 1 (the old log-probs come from passes of the update's shape); the first
    # update moves them by 2e-3 or more here, far beyond 1e-4.
    assert step["train/ratio_max"] > 1.0001 and step["train/ratio_min"] < 0.9999 and step["kl/old_approx"] > 0


def test_dapo_end_to_end(model_dir, tmp_path, monkeypatch):
    """DAPO needs groups with mixed scores, which the briefly warmed-up model never produces: it runs in this process,
    with coin-flip rewards, through the same command line."""
    coin_flip_rewards(monkeypatch)
    run_here(monkeypatch, "dapo.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL)
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [0, 1, 2] and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in logged)
    for key in ("rollout/prompts_sampled", "rollout/groups_kept_frac", "rollout/sampling_rounds", "train/clip_frac_high"):
        assert key in logged[-1], key
    assert os.path.isfile(os.path.join(tmp_path, "model", "config.json"))


def test_dapo_fills_its_batch_over_several_rounds(model_dir, tmp_path, monkeypatch):
    """Answers are right with probability 0.2, so many groups of 4 are all wrong and dropped: the batch is assembled
    from several rounds (of different completion widths), and with --mask-truncated some minibatches hold no valid
    token at all."""
    coin_flip_rewards(monkeypatch, p=0.2)
    flags = ["--model-name-or-path", model_dir, "--mask-truncated", "--micro-batch-size", "4", "--temperature", "0.7"]
    run_here(monkeypatch, "dapo.py", *flags, "--output-dir", str(tmp_path), *SMALL)
    logged = rows(tmp_path)
    assert max(r["rollout/sampling_rounds"] for r in logged[1:]) >= 2
    assert all(r["rollout/groups_kept_frac"] < 1 for r in logged[1:])


def test_non_finite_values_stop_the_run_with_a_message(model_dir, tmp_path, monkeypatch):
    flags = ["--model-name-or-path", model_dir, "--temperature", "1e-45", "--output-dir", str(tmp_path), *SMALL]
    with pytest.raises(SystemExit, match="non-finite logits while sampling"):  # logits / 1e-45 overflow
        run_here(monkeypatch, "grpo.py", *flags)


def test_dapo_dynamic_sampling_stops_at_its_cap(model_dir, tmp_path, monkeypatch):
    """Near-greedy sampling makes every group's responses identical: no group has signal, so the run must stop."""
    flags = ["--model-name-or-path", model_dir, "--temperature", "0.001", "--max-sampling-rounds", "2"]
    with pytest.raises(SystemExit, match="step 1: dynamic sampling kept only 0 of 4 groups .*--max-sampling-rounds"):
        run_here(monkeypatch, "dapo.py", *flags, "--output-dir", str(tmp_path), *SMALL)


def test_dapo_filters_groups_on_accuracy_not_on_the_overlong_penalty(model_dir, tmp_path, monkeypatch):
    """Every answer is correct, so every group is all correct: DAPO's eq. 11 keeps none of them, even where the overlong
    penalty (max_new_tokens 4, buffer 3: any answer of 2 tokens or more loses some reward) makes the rewards differ."""
    lengths = []  # characters of each scored answer, in the order scored

    def all_correct(self, completions, answers):
        lengths.extend(len(c) for c in completions)
        return torch.ones(len(completions))

    monkeypatch.setattr(tasks.Task, "verify", all_correct)
    flags = ["--max-new-tokens", "4", "--overlong-buffer", "3", "--max-sampling-rounds", "2", "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="step 1: dynamic sampling kept only 0 of 4 groups"):
        run_here(monkeypatch, "dapo.py", "--model-name-or-path", model_dir, *flags, *SMALL)
    sampled = torch.tensor(lengths[-32:]).view(-1, 4)  # the two rounds of step 1, groups of 4 (after the evaluation)
    assert (sampled.min(dim=1).values < sampled.max(dim=1).values).any()  # some group's penalties did differ


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "dr_grpo.py", "gspo.py", "dapo.py", "ppo.py", "cispo.py"])
def test_logged_metrics_do_not_depend_on_the_micro_batch_size(model_dir, tmp_path, monkeypatch, script):
    """The first step, whole minibatches against micro-batches of 3 responses (of different token counts): the same
    rollout, the same update up to float rounding, so every logged training metric agrees. PPO also early-stops on the
    minibatch's KL, here with a threshold between the second minibatch's token-weighted KL and its last micro-batch's
    (read off a first run), so that a check of the last micro-batch alone would decide differently with micro-batches."""
    flags = ["--model-name-or-path", model_dir, *SMALL, "--total-steps", "1", "--num-prompts", "6", "--num-minibatches", "2"]
    flags += ["--dataset", ""]  # the built-in task's prompts, on which PPO's threshold below separates the two checks
    if script == "ppo.py":
        calls, pool_metrics = [], common.pool_metrics
        monkeypatch.setattr(common, "pool_metrics", lambda rows, **kw: calls.append(rows) or pool_metrics(rows, **kw))
        coin_flip_rewards(monkeypatch, p=0.5)
        # --target-kl 1e9: checked, never hit
        probe = ["--micro-batch-size", "3", "--target-kl", "1e9", "--output-dir", str(tmp_path / "probe")]
        run_here(monkeypatch, script, *flags, *probe)
        monkeypatch.setattr(common, "pool_metrics", pool_metrics)
        second = calls[1]  # the 4 micro-batch rows of the second minibatch (the first is on-policy: KL 0)
        whole, last = pool_metrics(second)["kl/old_approx"].item(), second[-1]["kl/old_approx"].mean().item()
        assert len(second) == 4 and abs(whole - last) > 0.05 * whole > 0
        flags += ["--target-kl", str((whole + last) / 2)]
    logged = []
    for micro in ("0", "3"):
        coin_flip_rewards(monkeypatch, p=0.5)  # the same rewards in both runs
        out = str(tmp_path / micro)
        run_here(monkeypatch, script, *flags, "--micro-batch-size", micro, "--output-dir", out)
        logged.append({k: v for k, v in rows(out)[1].items() if k.split("/")[0] in ("train", "loss", "kl")})
    assert logged[0].keys() == logged[1].keys() and "kl/old_approx" in logged[0]
    assert logged[0].get("train/early_stopped", 1.0) == 1.0  # PPO did stop early
    # The two runs pass 12 and 3 rows at a time, where the CPU's kernels may order the float32 sums differently. The
    # bound used for single passes (FORWARD_ATOL in test_common.py) would swamp these metrics; rounding errors add up
    # like a random walk instead, sqrt(K) u per sum of K terms: 4 layers * sqrt(384) u = 5e-6 of a log-prob's size 3,
    # 1.4e-5 (an AVX-512 machine shows 1.8e-5). Ratios, their means and the gradient norm move by a few times that,
    # relative (rel=1e-4); a token mean of r A, which nearly cancels to 0, by |A| < 2.5 times that, absolute (abs=1e-4).
    # A micro-batch mean weighted wrongly moves a metric by several percent. (kl/old_approx, ~1e-7 after one update, is
    # compared only loosely.)
    for key, value in logged[0].items():
        assert logged[1][key] == pytest.approx(value, rel=1e-4, abs=1e-4), key


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"group_size": 1}, "--group-size"),
        ({"clip_eps": 0.0}, "--clip-eps"),
        ({"temperature": -1.0}, "--temperature"),
        ({"num_minibatches": 3}, "--num-minibatches"),
        ({"micro_batch_size": 7}, "--micro-batch-size"),
        ({"model_name_or_path": "/no/such/model"}, "--model-name-or-path"),
        ({"task": "chess"}, "--task"),
    ],
)
def test_grpo_rejects_bad_input_naming_the_flag(overrides, message):
    with pytest.raises(SystemExit, match=message):
        grpo.check_args(grpo.Args(**overrides))


def test_bad_input_fails_fast_through_the_command_line():
    result = run("grpo.py", "--group-size", "1")  # fails before the (possibly uncached) built-in model is loaded
    assert result.returncode != 0 and "--group-size 1: needs at least 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_docs_own_task_runs_from_the_command_line(model_dir, tmp_path):
    """The task of docs/your-model-and-data.md, pasted after the imports of a copy of grpo.py as the page says, runs from
    the command line with the script's default number of steps (nothing in the script knows the task's name); Ctrl-C
    after its first step saves a checkpoint and exits with status 0."""
    with open(os.path.join(ROOT, "docs", "your-model-and-data.md")) as f:
        example = re.search(r"```python\n(import tasks\n.*?)```", f.read(), re.DOTALL).group(1)
    with open(os.path.join(ROOT, "grpo.py")) as f:
        script = f.read()
    after_imports = script.index("\n\n\n", script.index("from plumbing import"))
    (tmp_path / "my_grpo.py").write_text(script[:after_imports] + "\n\n\n" + example + script[after_imports:])
    flags = ["--task", "product", "--model-name-or-path", model_dir, "--num-prompts", "4", "--group-size", "4"]
    flags += ["--max-new-tokens", "6", "--device", "cpu", "--output-dir", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": ROOT, "TQDM_DISABLE": "1"}
    command = [sys.executable, str(tmp_path / "my_grpo.py"), *flags]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # the evaluation at step 0, and step 1
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.time() < deadline, "no step logged in time"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "saved the checkpoint of step" in err, err[-3000:]
    logged = rows(tmp_path / "run")
    assert logged[0]["step"] == 0 and logged[-1]["step"] >= 1 and "rollout/reward_mean" in logged[-1]
    with open(tmp_path / "run" / "samples.jsonl") as f:
        first = json.loads(f.readline())
    a, b = first["prompt"].rstrip("=").split("*")  # a held-out problem of the product task: "12*34=" answered "408"
    assert len(a) == len(b) == 2 and first["answer"] == str(int(a) * int(b))
