"""An interrupted run, resumed, logs what an uninterrupted run logs and ends with the same weights."""

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from test_smoke import SMALL, rows, run_here

import common
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


@pytest.mark.parametrize(
    "command",
    ["grpo.py", "dapo.py", "ppo.py --lora-rank 4", "dpo.py", "reward_model.py", "opd.py", "grpo_tools.py", "kto.py"]
    + ["ipo.py", "simpo.py", "orpo.py", "grpo_engine.py --max-staleness 2", "grpo_engine.py --sync-every 3 --max-staleness 2"],
)
def test_interrupted_then_resumed_equals_uninterrupted(model_dir, teacher_dir, tool_run_flags, tmp_path, monkeypatch, command):
    """Three steps in one go, against Ctrl-C during step 2 (saved after it; the checkpoint every 5 steps would not
    have come) and --resume: every logged metric but time/*, the samples and the final weights agree. grpo.py stands for
    its siblings (the same lines), dapo.py keeps a count of its own, ppo.py trains a critic too (here with --lora-rank:
    the checkpoint holds only the adapters, the policy's and the critic's, and the critic's head, and the saved weights
    are the merged ones; ppo.py without an adapter resumes under FSDP2 in test_distributed.py), dpo.py and
    reward_model.py walk pairs, opd.py has a teacher, grpo_tools.py's conversations call a tool, grpo_engine.py keeps
    the batches its engine sampled ahead and, saved between two syncs (--sync-every 3), the engine's older weights."""
    script, *lora_flags = command.split()
    monkeypatch.setattr(tasks.Task, "verify", by_text)
    flags = ["--model-name-or-path", model_dir, "--save-every", "5", "--max-new-tokens", "4", *lora_flags]
    if script == "grpo_tools.py":
        flags = [*tool_run_flags, "--save-every", "5"]
    if script in ("dpo.py", "reward_model.py", "kto.py", "ipo.py", "simpo.py", "orpo.py"):
        pairs = tmp_path / "pairs.jsonl"
        row = lambda a: {"prompt": f"{a:02d}+11=", "chosen": "1", "rejected": "22", "completion": "1" * a, "label": a % 2}
        pairs.write_text("\n".join(json.dumps(row(a)) for a in range(8)))  # kto.py reads completion and label
        # 6 to train on, 2 a step: the save after step 2 falls mid-epoch, with the pairs left in `order` to carry over
        flags += ["--dataset", str(pairs), "--num-eval", "2", "--batch-size", "2", "--total-steps", "3", "--eval-every", "2"]
        flags += ["--device", "cpu"]
    else:
        flags += [*SMALL, "--total-steps", "3", "--eval-every", "2", "--num-prompts", "2", "--group-size", "4"]
        flags += ["--teacher", teacher_dir] if script == "opd.py" else []
    run_here(monkeypatch, script, *flags, "--output-dir", str(tmp_path / "whole"))

    monkeypatch.setattr(run_state.MetricsLogger, "log", interrupt_after(2))
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        run_here(monkeypatch, script, *flags, "--output-dir", str(tmp_path / "parts"))
    assert stopped.value.code == 0 and signal.getsignal(signal.SIGINT) is handler  # Ctrl-C is given back
    assert [r["step"] for r in rows(tmp_path / "parts")] == [0, 1, 2]
    monkeypatch.undo()
    monkeypatch.setattr(tasks.Task, "verify", by_text)
    run_here(monkeypatch, script, *flags, "--output-dir", str(tmp_path / "parts"), "--resume")

    untimed = lambda run: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows(tmp_path / run)]
    # exactly: the resumed run repeats the same operations on the same shapes, kernels and random state, in one process
    assert untimed("parts") == untimed("whole") and [r["step"] for r in rows(tmp_path / "parts")] == [0, 1, 2, 3]
    samples = lambda run: (tmp_path / run / "samples.jsonl").read_text()
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


def tiny_checkpoint(tmp_path, resume=False):
    """A Checkpoint of a one-parameter model, as a script makes one (args with output_dir, save_every, resume)."""
    import random
    from types import SimpleNamespace

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    args = SimpleNamespace(output_dir=str(tmp_path), save_every=0, resume=resume)
    return weight, run_state.Checkpoint(args, optimizer, random.Random(0))


def test_a_checkpoint_of_two_processes_is_refused_in_one_before_any_weight_is_loaded(tmp_path):
    """What a run of 2 processes saves (the per-rank random states are lists), resumed in one process: one line naming
    --resume and both counts, and the weights untouched (rather than a TypeError after loading them)."""
    weight, checkpoint = tiny_checkpoint(tmp_path)
    checkpoint.save(1)
    checkpoint.close()
    state = torch.load(checkpoint.path, weights_only=False)
    state.update(world_size=2, torch_rng=[state["torch_rng"]] * 2, cuda_rng=[state["cuda_rng"]] * 2)
    state["trained"] = [torch.zeros(3)]
    torch.save(state, checkpoint.path)
    with pytest.raises(SystemExit) as info:
        tiny_checkpoint(tmp_path, resume=True)
    assert str(info.value.code).startswith(f"--resume: {checkpoint.path} was saved by 2 processes, this run has 1")


def test_only_a_second_ctrl_c_stops_at_once(tmp_path):
    """The first signal lets the step finish; SIGTERM twice (a scheduler and torchrun's forwarding) still saves, while a
    second Ctrl-C stops at once."""
    _, checkpoint = tiny_checkpoint(tmp_path)
    try:
        checkpoint.interrupt(signal.SIGTERM, None)
        checkpoint.interrupt(signal.SIGTERM, None)
    except KeyboardInterrupt:
        pytest.fail("a repeated SIGTERM stopped the run without its checkpoint")
    assert checkpoint.interrupted
    checkpoint.interrupt(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.interrupt(signal.SIGINT, None)
    checkpoint.close()


def test_a_resume_killed_while_rewriting_the_metrics_loses_no_row(tmp_path, monkeypatch):
    """On --resume the logger rewrites metrics.jsonl without the rows after the checkpoint; if the process dies half way
    through, the old file must still be whole."""
    rows = [{"step": s, "time/elapsed": float(s)} for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls, dumps = [], json.dumps

    def dies_on_the_second_row(obj, *args, **kwargs):
        calls.append(obj)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the kill, half way through the rewrite
        return dumps(obj, *args, **kwargs)

    monkeypatch.setattr(json, "dumps", dies_on_the_second_row)
    with pytest.raises(KeyboardInterrupt):
        run_state.MetricsLogger(str(tmp_path), 2, common.pool_metrics)
    monkeypatch.undo()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows
