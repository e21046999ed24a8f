"""benchmark_effects.py's bookkeeping on hand-made runs (no training, no matplotlib)."""

import json
import os
import subprocess
import sys
import time

import pytest

import benchmark_effects


def write_run(folder, rows, seconds=60.0, flags=None):
    """A complete run as run_measured leaves it: metrics.jsonl and measured.json (and flags.json when FLAGS)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(folder, "measured.json"), "w") as f:
        json.dump({"seconds": seconds, "peak_bytes": 2**30}, f)
    if flags is not None:
        with open(os.path.join(folder, "flags.json"), "w") as f:
            json.dump(flags, f)


def rows(accuracies, right_length, wrong_length):
    """16 steps, evaluated at 0, 8 and 16; every step's right and wrong responses of the given lengths."""
    out = [{"step": 0, "eval/accuracy": accuracies[0], "eval/response_length": 60.0}]
    for step in range(1, 17):
        row = {"step": step, "rollout/response_length_correct": right_length, "rollout/response_length_wrong": wrong_length}
        row.update({"train/entropy": 1.0, "rollout/truncated_frac": 0.5})
        if step in (8, 16):
            row.update({"eval/accuracy": accuracies[step // 8], "eval/response_length": 30.0})
        out.append(row)
    return out


def test_a_run_folder_of_another_command_is_refused_before_anything_runs(tmp_path):
    args = benchmark_effects.Args(model_dir="MODEL", runs_dir=str(tmp_path))
    flags = benchmark_effects.script_flags(args, "grpo", 1)
    folder = str(tmp_path / "grpo-seed1")
    write_run(folder, rows([0.1, 0.2, 0.3], 10.0, 40.0), flags=["grpo.py", *flags[:-1], "2"])  # seed 2's command
    with pytest.raises(SystemExit, match="holds a run of another command"):
        benchmark_effects.run_once(args, "grpo.py", flags, folder)
    write_run(folder, rows([0.1, 0.2, 0.3], 10.0, 40.0), flags=["grpo.py", *flags])  # the same command: reused
    assert benchmark_effects.run_once(args, "grpo.py", flags, folder)["seconds"] == 60.0


def test_a_script_gets_the_shared_setting_and_only_its_own_flags():
    args = benchmark_effects.Args(runs_dir="R")
    opd = benchmark_effects.script_flags(args, "opd", 2)
    assert opd[opd.index("--num-prompts") + 1] == "32" and opd[opd.index("--group-size") + 1] == "1"
    assert opd[opd.index("--teacher") + 1] == "R/grpo-seed1/model" and opd[-2:] == ["--seed", "2"]
    grpo = benchmark_effects.script_flags(args, "grpo", 1)
    assert grpo == [*benchmark_effects.EFFECT, "--seed", "1"]
    assert grpo[grpo.index("--max-new-tokens") + 1] == "64" and grpo[grpo.index("--beta") + 1] == "0"


def test_the_headline_table_gives_the_mean_and_range_over_the_seeds_found(tmp_path):
    args = benchmark_effects.Args(runs_dir=str(tmp_path), seeds=[1, 2, 3])
    write_run(str(tmp_path / "grpo-seed1"), rows([0.05, 0.2, 0.3], 12.0, 50.0))
    write_run(str(tmp_path / "grpo-seed2"), rows([0.05, 0.2, 0.5], 14.0, 60.0))
    write_run(str(tmp_path / "dr_grpo-seed1"), rows([0.05, 0.3, 0.4], 10.0, 20.0))  # seed 2 and 3 not run yet
    lines = benchmark_effects.headline_section(args, with_pass_at_k=False)
    section = lines[lines.index("### dr_grpo.py against grpo.py") :]
    assert "Seeds found: grpo.py [1, 2], dr_grpo.py [1]; each cell is the mean (min-max) over them." in section
    assert "| held-out accuracy at step 16 | 40.0% (30.0%-50.0%) | 40.0% |" in section
    assert "| wrong responses' length, steps 13-16 | 55.0 (50.0-60.0) | 20.0 |" in section
    assert "| right responses' length, steps 13-16 | 13.0 (12.0-14.0) | 10.0 |" in section


def test_a_script_row_reads_its_first_and_last_steps():
    run = {"rows": rows([0.05, 0.2, 0.3], 12.0, 50.0), "seconds": 600.0, "peak_bytes": 3 * 2**30}
    run["rows"][1]["rollout/truncated_frac"] = 0.9  # steps 1-2 average 70%, steps 15-16 stay at 50%
    row = benchmark_effects.script_row("grpo", [], run)
    assert "| 5.0% -> 20.0% -> 30.0% | +25.0 | 60.0 -> 30.0 | 1.00 -> 1.00 | 70% -> 50% | 10.0 | 3.00 |" in row


def test_opd_starts_only_after_its_teacher_the_grpo_run_is_complete(tmp_path, monkeypatch):
    """With two runs at a time, opd.py (whose teacher is GRPO's seed-1 model) waits for that run even when a worker is
    free sooner."""
    events = []

    def fake_run_once(args, script, flags, out):
        events.append(("start", script))
        time.sleep(0.5 if script == "grpo.py" else 0.01)
        events.append(("end", script))

    monkeypatch.setattr(benchmark_effects, "run_once", fake_run_once)
    args = benchmark_effects.Args(runs_dir=str(tmp_path), jobs=2)
    benchmark_effects.run_all(args, [("grpo", 1), ("rloo", 1), ("opd", 1)])
    assert events.index(("start", "opd.py")) > events.index(("end", "grpo.py"))


def test_an_unknown_script_in_only_is_refused_in_one_line_before_anything_runs(tmp_path):
    command = [sys.executable, "benchmark_effects.py", "--only", "grpo", "drgrpo", "--runs-dir", str(tmp_path / "runs")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 1 and "--only: 'drgrpo' is not one of grpo, rloo, dr_grpo" in result.stderr
    assert not os.path.exists(tmp_path / "runs")
