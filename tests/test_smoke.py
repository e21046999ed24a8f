"""Each script end to end through its command line, for two steps, on a briefly warmed-up tiny model."""

import json
import os
import subprocess
import sys

import pytest

import grpo
import sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny model after a few warm-up steps (the real warm-up runs far longer; this only has to run)."""
    path = str(tmp_path_factory.mktemp("warm") / "model")
    sft.warm_up(sft.Args(output_dir=path, max_steps=30, target_accuracy=2.0, device="cpu"))
    return path


def run(script, *flags):
    env = {**os.environ, "TQDM_DISABLE": "1"}
    return subprocess.run([sys.executable, script, *flags], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def rows(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


SMALL = ["--total-steps", "2", "--num-prompts", "4", "--eval-every", "1", "--device", "cpu"]


def test_grpo_end_to_end_and_deterministic(model_dir, tmp_path):
    runs = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        result = run("grpo.py", "--model-name-or-path", model_dir, "--group-size", "4", "--output-dir", out, *SMALL)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(rows(out))
    first = runs[0]
    assert [r["step"] for r in first] == [0, 1, 2]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in first)
    for key in ("rollout/reward_mean", "loss/policy", "kl/ref", "train/clip_frac_low", "train/entropy", "time/step"):
        assert key in first[1], key
    assert os.path.isfile(os.path.join(tmp_path, "a", "model", "config.json"))
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]  # noqa: E731
    assert strip(runs[0]) == strip(runs[1])  # same seed, same machine: identical metrics


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
    assert result.returncode != 0 and "--group-size 1: GRPO needs at least 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_non_finite_values_stop_the_run_with_a_message(model_dir, tmp_path):
    flags = ["--model-name-or-path", model_dir, "--temperature", "1e-45", "--output-dir", str(tmp_path), *SMALL]
    result = run("grpo.py", *flags)  # logits / 1e-45 overflow: sampling probabilities are NaN
    assert result.returncode != 0
    assert "non-finite logits while sampling" in result.stderr and "Traceback" not in result.stderr
