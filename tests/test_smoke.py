"""Each script end to end for two steps on a briefly warmed-up tiny model: once through its command line in a fresh
process, and for the checks that need several runs, in this process (same code path, without paying for the imports
again)."""

import json
import os
import runpy
import subprocess
import sys

import pytest
import torch

import common
import grpo
import sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--total-steps", "2", "--num-prompts", "4", "--group-size", "4", "--eval-every", "1", "--device", "cpu"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny model after a few warm-up steps (the real warm-up runs far longer; this only has to run)."""
    path = str(tmp_path_factory.mktemp("warm") / "model")
    sft.warm_up(sft.Args(output_dir=path, max_steps=30, target_accuracy=2.0, device="cpu"))
    return path


def run(script, *flags):
    """The script's command line, in a fresh process."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    return subprocess.run([sys.executable, script, *flags], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def run_here(monkeypatch, script, *flags):
    """The script's command line, in this process."""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(sys, "argv", [script, *flags])
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


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
        ("dapo.py", ["rollout/prompts_sampled", "rollout/groups_kept_frac", "rollout/sampling_rounds"]),
        ("ppo.py", ["loss/value", "train/explained_variance", "train/advantage_std", "kl/ref", "rollout/kl_penalty"]),
    ],
)
def test_end_to_end_through_the_command_line(model_dir, tmp_path, script, keys):
    result = run(script, "--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [0, 1, 2] and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in logged)
    for key in ["rollout/reward_mean", "rollout/response_length", "time/step", "train/responses", *keys]:
        assert key in logged[-1], key
    assert os.path.isfile(os.path.join(tmp_path, "model", "config.json"))


def test_dpo_end_to_end_through_the_command_line(model_dir, tmp_path):
    pairs = [
        {"prompt": f"{a:02d}+{b:02d}=", "chosen": str(a + b)[::-1], "rejected": str(a + b + 1)[::-1]}
        for a, b in ((7, 45), (13, 9))
    ]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs * 4))
    flags = ["--dataset", str(tmp_path / "pairs.jsonl"), "--batch-size", "4", "--micro-batch-size", "2", "--total-steps", "2"]
    result = run("dpo.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path), "--eval-every", "1", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [0, 1, 2] and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in logged)
    assert logged[0]["data/pairs"] == 8
    for key in ("loss/dpo", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert key in logged[-1], key
    assert logged[1]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference at the first step
    assert os.path.isfile(os.path.join(tmp_path, "model", "config.json"))


def test_same_seed_same_metrics(model_dir, tmp_path, monkeypatch):
    runs = []
    for name in ("a", "b"):
        run_here(monkeypatch, "grpo.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path / name), *SMALL)
        runs.append([{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows(tmp_path / name)])
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_later_minibatches_are_off_policy(model_dir, tmp_path, monkeypatch):
    """With two minibatches the second one's ratios depart from 1: the old log-probs are the behaviour policy's, not
    the current ones. Random rewards stand in for a competent policy, so that the first update moves the policy."""
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(common.Task, "reward", lambda self, c, a: torch.randint(0, 2, (len(c),), generator=generator).float())
    run_here(monkeypatch, "grpo.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL)
    step = rows(tmp_path)[1]
    assert step["train/ratio_max"] > 1.0001 and step["train/ratio_min"] < 0.9999 and step["kl/old_approx"] > 0


def test_dapo_fills_its_batch_over_several_rounds(model_dir, tmp_path, monkeypatch):
    """Every answer scores 0, so only the overlong penalty separates responses: many groups have equal rewards and are
    dropped, the batch is assembled from several rounds (of different completion widths), and with --mask-truncated
    some minibatches hold no valid token at all."""
    monkeypatch.setattr(common.Task, "reward", lambda self, c, a: torch.zeros(len(c)))
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
