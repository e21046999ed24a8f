"""An interrupted run, resumed, logs what an uninterrupted run logs and ends with the same weights."""

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from test_smoke import SMALL, rows, run_here

import tasks
from plumbing import run_state


def by_text(self, completions, answers):
    """A verifier that depends only on the completion's text (right when the sum of its character codes is even): the
    same answers get the same scores in every run, and different answers often differ, as DAPO's groups need."""
    return torch.tensor([float(sum(map(ord, c)) % 2 == 0) for c in completions])


def interrupt_after(step):
    """MetricsLogger.log that sends this process SIGINT (Ctrl-C) once it has logged `step`."""
    log = run_state.MetricsLogger.log

    def log_then_interrupt(self, logged_step, metrics):
        log(self, logged_step, metrics)
        if logged_step == step:
            os.kill(os.getpid(), signal.SIGINT)

    return log_then_interrupt


@pytest.mark.parametrize("script", ["grpo.py", "dapo.py", "ppo.py", "dpo.py", "reward_model.py"])
def test_interrupted_then_resumed_equals_uninterrupted(model_dir, tmp_path, monkeypatch, script):
    """Three steps in one go, against Ctrl-C during step 2 (saved after it; the checkpoint every 5 steps would not
    have come) and --resume: every logged metric but time/*, the samples and the final weights agree. grpo.py stands for
    its siblings (the same lines), dapo.py keeps a count of its own, ppo.py trains a critic too, dpo.py and
    reward_model.py walk pairs."""
    monkeypatch.setattr(tasks.Task, "reward", by_text)
    flags = ["--model-name-or-path", model_dir, "--save-every", "5", "--max-new-tokens", "4"]
    if script in ("dpo.py", "reward_model.py"):
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text("\n".join(json.dumps({"prompt": f"{a:02d}+11=", "chosen": "1", "rejected": "22"}) for a in range(6)))
        flags += ["--dataset", str(pairs), "--batch-size", "4", "--total-steps", "3", "--eval-every", "2", "--device", "cpu"]
        flags += ["--num-eval-pairs", "2"] if script == "reward_model.py" else []
    else:
        flags += [*SMALL, "--total-steps", "3", "--eval-every", "2", "--num-prompts", "2", "--group-size", "4"]
    run_here(monkeypatch, script, *flags, "--output-dir", str(tmp_path / "whole"))

    monkeypatch.setattr(run_state.MetricsLogger, "log", interrupt_after(2))
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        run_here(monkeypatch, script, *flags, "--output-dir", str(tmp_path / "parts"))
    assert stopped.value.code == 0 and signal.getsignal(signal.SIGINT) is handler  # Ctrl-C is given back
    assert [r["step"] for r in rows(tmp_path / "parts")] == [0, 1, 2]
    monkeypatch.undo()
    monkeypatch.setattr(tasks.Task, "reward", by_text)
    run_here(monkeypatch, script, *flags, "--output-dir", str(tmp_path / "parts"), "--resume")

    untimed = lambda run: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows(tmp_path / run)]  # noqa: E731
    assert untimed("parts") == untimed("whole") and [r["step"] for r in rows(tmp_path / "parts")] == [0, 1, 2, 3]
    samples = lambda run: (tmp_path / run / "samples.jsonl").read_text()  # noqa: E731
    assert samples("parts") == samples("whole")
    whole, parts = (load_file(tmp_path / run / "model" / "model.safetensors") for run in ("whole", "parts"))
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
    elapsed = [r["time/elapsed"] for r in rows(tmp_path / "parts")]
    assert elapsed == sorted(elapsed)  # the clock goes on from the interrupted run's


def test_resume_needs_a_checkpoint(tmp_path):
    import grpo

    with pytest.raises(SystemExit, match="--resume: no checkpoint.pt in --output-dir"):
        grpo.check_args(grpo.Args(resume=True, output_dir=str(tmp_path)))
    with pytest.raises(SystemExit, match="--save-every -1: must be 0"):
        grpo.check_args(grpo.Args(save_every=-1, output_dir=str(tmp_path)))
