"""benchmark_effects.py's bookkeeping on hand-made runs (no training, no matplotlib)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from benchmarks import benchmark_effects


def write_run(folder, rows, seconds=60.0, flags=None, code=None):
    """A complete run as run_measured leaves it: metrics.jsonl and measured.json (and flags.json when FLAGS, and
    code.json when CODE, as run_once adds them)."""
    os.makedirs(folder, exist_ok=True)
    if code is not None:
        with open(os.path.join(folder, "code.json"), "w") as f:
            json.dump(code, f)
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


def write_record(args, script, seed, rows, seconds=60.0, cpu="CPU A"):
    """A record as run_once saves it, for SCRIPT at SEED with EFFECT."""
    command = [f"{script}.py", *benchmark_effects.script_flags(script, seed)]
    record = {"command": command, "cpu": cpu, "torch": "2.13.0", "threads": 1, "runs_at_a_time": 2, "seconds": seconds}
    benchmark_effects.save_run(args, script, seed, {**record, "peak_bytes": 2**30, "rows": rows})


def test_a_finished_run_folder_becomes_a_record_and_a_record_is_not_run_again(tmp_path, monkeypatch):
    args = benchmark_effects.Args(model_dir="MODEL", runs_dir=str(tmp_path / "runs"), docs_dir=str(tmp_path / "docs"))
    command = ["grpo.py", *benchmark_effects.script_flags("grpo", 1)]
    code = benchmark_effects.code_version("grpo")
    write_run(str(tmp_path / "runs" / "grpo-seed1"), rows([0.1, 0.2, 0.3], 10.0, 40.0), 90.0, command, code)
    benchmark_effects.run_once(args, "grpo", 1)  # the folder is complete: nothing runs, its record is written
    record = benchmark_effects.load_run(args, "grpo", 1)
    assert record["command"] == command and record["seconds"] == 90.0 and record["rows"][-1]["eval/accuracy"] == 0.3
    assert record["code"] == code and len(code["code_sha256"]) == 64
    assert record["threads"] == max(1, (os.cpu_count() or 1) // args.jobs) and record["runs_at_a_time"] == 1
    # another checkout: the record is there, the run folder is not; nothing may run
    shutil.rmtree(tmp_path / "runs")
    monkeypatch.setattr(benchmark_effects, "run_measured", lambda *a, **k: pytest.fail("a recorded run ran again"))
    benchmark_effects.run_once(args, "grpo", 1)
    assert not benchmark_effects.needs_running(args, "grpo", 1)
    assert benchmark_effects.needs_running(benchmark_effects.Args(docs_dir=args.docs_dir, fresh=True), "grpo", 1)


def test_a_record_or_run_folder_of_another_command_is_refused_before_anything_runs(tmp_path):
    args = benchmark_effects.Args(model_dir="MODEL", runs_dir=str(tmp_path / "runs"), docs_dir=str(tmp_path / "docs"))
    write_record(args, "grpo", 1, rows([0.1, 0.2, 0.3], 10.0, 40.0))
    with open(benchmark_effects.record_path(args, "grpo", 1)) as f:
        record = json.load(f)
    benchmark_effects.save_run(args, "grpo", 1, {**record, "command": record["command"][:-1] + ["2"]})  # seed 2's
    with pytest.raises(SystemExit, match="holds a run of another command"):
        benchmark_effects.run_once(args, "grpo", 1)
    command = ["grpo.py", *benchmark_effects.script_flags("grpo", 2)]  # seed 2's command in seed 1's folder
    write_run(str(tmp_path / "runs" / "grpo-seed1"), rows([0.1, 0.2, 0.3], 10.0, 40.0), flags=command)
    os.remove(benchmark_effects.record_path(args, "grpo", 1))
    with pytest.raises(SystemExit, match="holds a run of another command"):
        benchmark_effects.run_once(args, "grpo", 1)


def test_a_record_or_run_folder_made_by_other_code_is_refused_and_fresh_runs_it(tmp_path, monkeypatch):
    """A record keeps a hash of its script and of the modules it may run: one made before (no hash) or by code that
    changed since is refused in one line, before anything runs, and --fresh runs it again; a complete run folder made by
    other code is refused too, and so is its model for pass@k, and pairs answered by another run than the record's."""
    args = benchmark_effects.Args(model_dir="MODEL", runs_dir=str(tmp_path / "runs"), docs_dir=str(tmp_path / "docs"))
    write_record(args, "grpo", 1, rows([0.1, 0.2, 0.3], 10.0, 40.0))  # no code: made before records kept it
    with pytest.raises(SystemExit, match="grpo-seed1.json: made before records kept their code version; --fresh runs"):
        benchmark_effects.needs_running(args, "grpo", 1)
    record = benchmark_effects.load_run(args, "grpo", 1)
    other = {**benchmark_effects.code_version("grpo"), "code_sha256": "0" * 64, "commit": "abc"}
    benchmark_effects.save_run(args, "grpo", 1, {**record, "code": other})
    with pytest.raises(SystemExit, match=r"grpo.py or the modules it runs changed since it was made \(at commit abc\)"):
        benchmark_effects.needs_running(args, "grpo", 1)
    assert benchmark_effects.needs_running(benchmark_effects.Args(docs_dir=args.docs_dir, fresh=True), "grpo", 1)
    # a complete run folder of the right command but other code, about to be reused as the record
    os.remove(benchmark_effects.record_path(args, "grpo", 1))
    command = ["grpo.py", *benchmark_effects.script_flags("grpo", 1)]
    write_run(str(tmp_path / "runs" / "grpo-seed1"), rows([0.1, 0.2, 0.3], 10.0, 40.0), 90.0, command, other)
    monkeypatch.setattr(benchmark_effects, "run_measured", lambda *a, **k: pytest.fail("nothing may run"))
    with pytest.raises(SystemExit, match="grpo-seed1: grpo.py or the modules it runs changed since"):
        benchmark_effects.run_once(args, "grpo", 1)
    # the model in the run folder is not the record's run: no pass@k from it
    os.makedirs(tmp_path / "runs" / "grpo-seed1" / "model")
    benchmark_effects.save_run(args, "grpo", 1, {**record, "code": benchmark_effects.code_version("grpo")})
    with pytest.raises(SystemExit, match="is not the model of its record"):
        benchmark_effects.sample_final_model(args, "grpo", 1)
    # pairs answered by another run of grpo seed 1 than its record's
    (tmp_path / "docs" / "effects-runs" / "sums-pairs.json").write_text(json.dumps({"answered_by": other}))
    with pytest.raises(SystemExit, match="built from another run of grpo.py seed 1 than its record's"):
        benchmark_effects.build_pairs(args)


def test_a_script_gets_the_shared_setting_and_only_its_own_flags():
    opd = benchmark_effects.script_flags("opd", 2)
    assert opd[opd.index("--num-prompts") + 1] == "32" and opd[opd.index("--group-size") + 1] == "1"
    assert opd[opd.index("--teacher") + 1] == "RUNS_DIR/grpo-seed1/model" and opd[-2:] == ["--seed", "2"]
    grpo = benchmark_effects.script_flags("grpo", 1)
    assert grpo == [*benchmark_effects.EFFECT, "--seed", "1"]
    assert grpo[grpo.index("--max-new-tokens") + 1] == "64" and grpo[grpo.index("--beta") + 1] == "0"


def test_the_headline_table_gives_the_mean_and_range_over_the_seeds_found(tmp_path):
    args = benchmark_effects.Args(docs_dir=str(tmp_path), seeds=[2])  # this invocation runs seed 2; the page shows all
    write_record(args, "grpo", 1, rows([0.05, 0.2, 0.3], 12.0, 50.0))
    write_record(args, "grpo", 2, rows([0.05, 0.2, 0.5], 14.0, 60.0))
    write_record(args, "dr_grpo", 1, rows([0.05, 0.3, 0.4], 10.0, 20.0))  # seed 2 and 3 not run yet
    lines = benchmark_effects.headline_section(args)
    section = lines[lines.index("### dr_grpo.py against grpo.py") :]
    assert "Seeds found: grpo.py [1, 2], dr_grpo.py [1]; each cell is the mean (min-max) over them." in section
    assert "| held-out accuracy at step 16 | 40.0% (30.0%-50.0%) | 40.0% |" in section
    assert "| wrong responses' length, steps 13-16 | 55.0 (50.0-60.0) | 20.0 |" in section
    assert "| right responses' length, steps 13-16 | 13.0 (12.0-14.0) | 10.0 |" in section


def test_the_page_says_on_which_machine_each_record_was_measured(tmp_path):
    args = benchmark_effects.Args(docs_dir=str(tmp_path), seeds=[1])
    write_record(args, "grpo", 1, rows([0.05, 0.2, 0.3], 12.0, 50.0), seconds=600.0)
    write_record(args, "grpo", 2, rows([0.05, 0.2, 0.3], 12.0, 50.0), seconds=120.0, cpu="CPU B")
    write_record(args, "rloo", 2, rows([0.05, 0.2, 0.3], 12.0, 50.0), seconds=60.0, cpu="CPU B")
    assert benchmark_effects.measured_on(args) == [
        "- CPU A, torch 2.13.0, 2 runs at a time with 1 thread each: 1 run, 10 minutes in all, about 5 of wall clock",
        "- CPU B, torch 2.13.0, 2 runs at a time with 1 thread each: 2 runs, 3 minutes in all, about 2 of wall clock",
    ]


def test_a_script_row_reads_its_first_and_last_steps():
    run = {"rows": rows([0.05, 0.2, 0.3], 12.0, 50.0), "seconds": 600.0, "peak_bytes": 3 * 2**30}
    run["rows"][1]["rollout/truncated_frac"] = 0.9  # steps 1-2 average 70%, steps 15-16 stay at 50%
    row = benchmark_effects.script_row("grpo", [], run)
    assert "| 5.0% -> 20.0% -> 30.0% | +25.0 | 60.0 -> 30.0 | 1.00 -> 1.00 | 70% -> 50% | 10.0 | 3.00 |" in row


def test_opd_starts_only_after_its_teacher_the_grpo_run_is_complete(tmp_path, monkeypatch):
    """With two runs at a time, opd.py (whose teacher is GRPO's seed-1 model) waits for that run even when a worker is
    free sooner."""
    events = []

    def fake_run_once(args, script, seed):
        events.append(("start", script))
        time.sleep(0.5 if script == "grpo" else 0.01)
        events.append(("end", script))

    monkeypatch.setattr(benchmark_effects, "run_once", fake_run_once)
    args = benchmark_effects.Args(runs_dir=str(tmp_path), jobs=2)
    benchmark_effects.run_all(args, [("grpo", 1), ("rloo", 1), ("opd", 1)])
    assert events.index(("start", "opd")) > events.index(("end", "grpo"))


def test_an_unknown_script_in_only_is_refused_in_one_line_before_anything_runs(tmp_path):
    command = [
        sys.executable,
        "-m",
        "benchmarks.benchmark_effects",
        "--only",
        "grpo",
        "drgrpo",
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 1 and "--only: 'drgrpo' is not one of grpo, rloo, dr_grpo" in result.stderr
    assert not os.path.exists(tmp_path / "runs")


def test_opd_without_its_teacher_is_refused_in_one_line_before_anything_runs(tmp_path):
    command = [
        sys.executable,
        "-m",
        "benchmarks.benchmark_effects",
        "--parts",
        "scripts",
        "--only",
        "opd",
        "--model-dir",
        "MODEL",
    ]
    command += ["--runs-dir", str(tmp_path / "runs"), "--docs-dir", str(tmp_path / "docs")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 1 and "opd.py's teacher, GRPO's seed-1 model" in result.stderr
    assert "add `--only grpo`" in result.stderr and not os.listdir(tmp_path / "runs")


def test_the_pairs_files_get_back_the_plain_prompt_and_answer_and_keep_each_end_id():
    sampled = {"prompt": ["<r>What is 1 + 2?</r>"], "chosen": ["1 + 2 = 3. 3"], "rejected": ["1 + 2 = 4. 4"]}
    sampled.update({"chosen_end": [2], "rejected_end": [7]})
    rows, examples = benchmark_effects.pair_files(sampled, {"<r>What is 1 + 2?</r>": ("What is 1 + 2?", "3")})
    assert rows == [
        {"prompt": "What is 1 + 2?", "answer": "3", "chosen": "1 + 2 = 3. 3", "rejected": "1 + 2 = 4. 4", "chosen_end": 2}
        | {"rejected_end": 7}
    ]
    assert [(e["completion"], e["completion_end"], e["label"]) for e in examples] == [
        ("1 + 2 = 3. 3", 2, True),
        ("1 + 2 = 4. 4", 7, False),
    ]
    assert {e["prompt"] for e in examples} == {"What is 1 + 2?"} and {e["answer"] for e in examples} == {"3"}


def test_kto_reads_the_examples_and_its_siblings_the_pairs():
    kto, dpo = benchmark_effects.script_flags("kto", 1), benchmark_effects.script_flags("dpo", 1)
    assert kto[kto.index("--dataset") + 1] == "DOCS_DIR/effects-runs/sums-examples.jsonl"
    assert dpo[dpo.index("--dataset") + 1] == "DOCS_DIR/effects-runs/sums-pairs.jsonl"
    assert dpo[: len(benchmark_effects.PREFERENCE)] == benchmark_effects.PREFERENCE


def test_kto_holds_out_the_same_prompts_as_its_siblings():
    """kto.py's --num-eval counts rows of the examples file, two per pair; its siblings' counts pairs."""
    import datasets

    import preference_pairs

    plain = {f"<r>What is {i} + 1?</r>": (f"What is {i} + 1?", str(i + 1)) for i in range(300)}
    sampled = {"prompt": list(plain), "chosen": [a for _, a in plain.values()], "rejected": ["0"] * 300}
    sampled.update({"chosen_end": [2] * 300, "rejected_end": [2] * 300})
    rows, examples = benchmark_effects.pair_files(sampled, plain)
    held_out = {}
    for script, lines in (("dpo", rows), ("kto", examples)):
        flags = benchmark_effects.script_flags(script, 1)
        num_eval = int(flags[flags.index("--num-eval") + 1])
        _, held_out[script] = preference_pairs.split_held_out(datasets.Dataset.from_list(lines), num_eval)
    assert len(held_out["dpo"]) == 64 and len(held_out["kto"]) == 128
    assert set(held_out["kto"]["prompt"]) == set(held_out["dpo"]["prompt"])


def test_a_preference_row_reads_each_evaluation(tmp_path, monkeypatch):
    args = benchmark_effects.Args(docs_dir=str(tmp_path))
    os.makedirs(tmp_path / "effects-runs")
    with open(tmp_path / "effects-runs" / "sums-pairs.json", "w") as f:
        json.dump({"prompts": 16, "samples": 8, "pairs": 5, "skipped": 11, "seconds": 120.0, "cpu": "C", "threads": 2}, f)
    with open(tmp_path / "effects-runs" / "sums-pairs.jsonl", "w") as f:  # (the lengths come from the model's tokenizer)
        f.write(json.dumps({"prompt": "What is 1 + 2?", "chosen": "1 + 2 = 3", "rejected": "1 + 2 = 4"}) + "\n")
    args.model_dir = str(tmp_path / "absent")
    built = {"chosen_tokens": 10.64, "rejected_tokens": 13.46, "chosen_longer": 39, "rejected_longer": 72}
    monkeypatch.setattr(benchmark_effects, "pair_lengths", lambda model_dir, path: built)  # the next test's subject
    benchmark_effects.build_pairs(args)  # a pairs file of before the lengths were kept gets them
    evals = [
        {"step": s, "eval/rewards_accuracies": a, "eval/accuracy": b, "eval/response_length": n}
        for s, a, b, n in ((0, 0.0, 0.0625, 60.0), (20, 0.5, 0.25, 30.0), (40, 0.75, 0.5, 12.5))
    ]
    write_record(args, "dpo", 1, [evals[0], {"step": 1, "loss/dpo": 0.6}, *evals[1:]], seconds=300.0)
    write_record(
        args, "reward_model", 1, [{"step": 0, "eval/pairwise_accuracy": 0.5}, {"step": 40, "eval/pairwise_accuracy": 0.9}]
    )
    lines = benchmark_effects.preference_section(args)
    assert "| `dpo.py` | 0.0% -> 50.0% -> 75.0% | 6.2% -> 25.0% -> 50.0% | 60.0 -> 30.0 -> 12.5 | 5.0 | 1.00 |" in lines
    assert "| `reward_model.py` | 50.0% -> 90.0% | - | - | 1.0 | 1.00 |" in lines
    assert "| `kto.py` | not run yet |" in lines and any("5 pairs (11 problems had no such pair)" in line for line in lines)
    assert any("10.6 tokens long on average, the rejected 13.5 (the rejected is the longer in 72 pairs" in x for x in lines)


def test_the_pairs_lengths_are_counted_in_the_models_tokens(tmp_path, model_dir):
    rows = [
        {"prompt": "What is 1 + 2?", "chosen": "1 + 2 = 3", "rejected": "1 + 2 = 1 + 1 + 1 + 1 = 4"},
        {"prompt": "What is 2 + 2?", "chosen": "2 + 2 = 4 because 2 and 2 make 4", "rejected": "2 + 2 = 5"},
        {"prompt": "What is 3 + 2?", "chosen": "3 + 2 = 5", "rejected": "3 + 2 = 6"},
    ]
    with open(tmp_path / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lengths = benchmark_effects.pair_lengths(model_dir, str(tmp_path / "pairs.jsonl"))
    assert (lengths["rejected_longer"], lengths["chosen_longer"]) == (1, 1)  # the third pair: the same length
    assert lengths["chosen_tokens"] > lengths["rejected_tokens"] > 0  # the long chosen answer outweighs the long rejected


def test_the_preference_part_without_the_model_that_answers_is_refused_in_one_line(tmp_path):
    command = [
        sys.executable,
        "-m",
        "benchmarks.benchmark_effects",
        "--parts",
        "preference",
        "--only",
        "dpo",
        "--model-dir",
        "MODEL",
    ]
    command += ["--runs-dir", str(tmp_path / "runs"), "--docs-dir", str(tmp_path / "docs")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 1 and "--parts preference: the pairs' answers come from" in result.stderr
    assert "grpo-seed1/model" in result.stderr and not os.path.exists(tmp_path / "docs" / "effects-runs")


def test_the_update_weight_by_difficulty_is_grpos_and_rloos_own_weighting(tmp_path):
    """Problems with 1, 4 and 7 of 8 answers right. GRPO: a group's total |A| is 8 * 2p(1-p) / std = 16 sqrt(p(1-p)),
    5.29, 8 and 5.29 (eps 1e-4 moves it by 3e-4 relative); RLOO: 8/7 * 16 p(1-p), 2, 4.57 and 2. All right or all wrong
    (0 and 8) weigh nothing in either."""
    import grpo
    import rloo

    grpo_shares = benchmark_effects.update_weight_shares([0, 1, 4, 7, 8], grpo.compute_advantages)
    rloo_shares = benchmark_effects.update_weight_shares([0, 1, 4, 7, 8], rloo.compute_advantages)
    hard, middle, easy = benchmark_effects.DIFFICULTY
    assert grpo_shares[hard] == pytest.approx(5.2915 / 18.583, abs=1e-3)
    assert grpo_shares[middle] == pytest.approx(8 / 18.583, abs=1e-3)
    assert grpo_shares[easy] == pytest.approx(grpo_shares[hard], rel=1e-6)  # p and 1 - p: the same weight
    assert rloo_shares[hard] == pytest.approx(2 / (4 + 32 / 7), abs=1e-6)
    assert rloo_shares[middle] == pytest.approx((32 / 7) / (4 + 32 / 7), abs=1e-6)
    assert rloo_shares[easy] == pytest.approx(rloo_shares[hard], rel=1e-6)
    args = benchmark_effects.Args(docs_dir=str(tmp_path), seeds=[1])
    write_record(args, "grpo", 1, rows([0.05, 0.2, 0.3], 12.0, 50.0))
    record = benchmark_effects.load_run(args, "grpo", 1)
    benchmark_effects.save_run(args, "grpo", 1, {**record, "correct_counts": [1, 4, 7]})
    with open(tmp_path / "effects-runs" / "untrained.json", "w") as f:
        json.dump({"correct_counts": [0.0, 1.0, 4.0, 7.0, 8.0]}, f)  # as the verifier's float scores sum
    lines = benchmark_effects.headline_section(args)
    assert "| weight on hard (1-2 of 8 right) problems, the untrained model's answers | 28.5% | 23.3% |" in lines
    assert "| weight on middle (3-5) problems, its own model's answers at step 16 | 43.1% | - |" in lines
    assert "| weight on hard (1-2 of 8 right) problems, the same answers (every final model's) | 28.5% | 23.3% |" in lines
