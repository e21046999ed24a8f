"""Training over several processes (torchrun, gloo on CPU) updates the weights exactly as one process that trains on the
union of the processes' rollouts; FSDP2 updates them as DDP does. One torchrun runs every script (see
distributed_jobs.py); each comparison then runs the script once more, in this process, on the recorded rollouts."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from distributed_jobs import keep_every_checkpoint, verifier_of
from rollouts import record_or_replay
from test_smoke import ROOT, rows, run_here

import common
import tasks
from plumbing import checks, models, run_state

SCRIPTS = ["grpo.py", "rloo.py", "dr_grpo.py", "dapo.py", "gspo.py", "ppo.py", "dpo.py", "reward_model.py"]
SCRIPTS += ["cispo.py", "reinforce_pp.py", "sapo.py", "opd.py", "grpo_tools.py", "maxrl.py", "grpo_engine.py"]
PREFERENCE = ("dpo.py", "ipo.py", "simpo.py", "orpo.py", "kto.py")  # pairs (kto.py: labelled examples) from --dataset
SCRIPTS += ["ipo.py", "simpo.py", "orpo.py", "kto.py"]
SHARDED = ["grpo_tools.py", "ppo.py"]  # grpo_tools.py: grpo.py's update, and conversations of several turns
LORA = "grpo.py --lora-rank 4"  # data parallel with an adapter: only the adapter's gradients are averaged


def script_and_name(command: str) -> tuple[str, list[str], str]:
    script, *more = command.split()
    return script, more, script[:-3] + ("_lora" if more else "")


def flags(script: str, model_dir: str, data: str, steps: int = 2, teacher: str = "", tool: tuple = ()) -> list[str]:
    """Two steps of one optimizer step each (one minibatch, one epoch), small batches that split over 2 processes, on
    the files of the folder `data`: addition problems (4 held out, so that an evaluation costs little) and pairs.
    grpo_tools.py runs on the multiplication task's model, with room for a call, its answer and a last turn."""
    pairs = os.path.join(data, "pairs.jsonl")
    if script == "grpo_tools.py":  # tool: conftest's tool_run_flags, which name the model
        model_dir, more = tool[1], [*tool[2:], "--max-new-tokens", "24"]
    shared = ["--model-name-or-path", model_dir, "--device", "cpu", "--total-steps", str(steps), "--save-every", "1"]
    shared += ["--eval-every", "2"] + (more if script == "grpo_tools.py" else ["--max-new-tokens", "4"])
    if script in PREFERENCE:
        return shared + ["--dataset", pairs, "--batch-size", "4", "--learning-rate", "1e-4"]  # a step larger than 1e-5
    if script == "reward_model.py":
        return shared + ["--dataset", pairs, "--batch-size", "4", "--num-eval", "2", "--learning-rate", "1e-3"]
    shared += ["--learning-rate", "1e-4"]  # the built-in model's rate: a folder gets a pretrained model's 1e-6
    if script != "grpo_tools.py":  # (its own problems are in `tool`)
        shared += ["--dataset", os.path.join(data, "problems.jsonl"), "--num-eval", "4"]
    if script == "ppo.py":
        return shared + ["--num-prompts", "8", "--num-minibatches", "1", "--num-epochs", "1"]
    if script == "opd.py":  # with a reference too, so that both frozen models are loaded and prepared
        shared += ["--teacher", teacher, "--beta", "0.04"]
    return shared + ["--num-prompts", "4", "--group-size", "4", "--num-minibatches", "1"]


@pytest.fixture(scope="module")
def runs(model_dir, teacher_dir, tool_run_flags, tmp_path_factory):
    """Every script for 2 steps under `torchrun --nproc-per-node 2` (DDP), grpo.py and ppo.py again with --fsdp on the
    same rollouts, and sft.py: all in one torchrun. Returns the folder with ddp/, fsdp/, rollouts/ and sft/."""
    root = tmp_path_factory.mktemp("distributed")
    pairs = root / "pairs.jsonl"
    row = lambda a: {"prompt": f"{a:02d}+11=", "chosen": "1", "rejected": "22", "completion": "1" * a, "label": a % 2}
    pairs.write_text("\n".join(json.dumps(row(a)) for a in range(8)))  # kto.py reads completion and label
    problem = lambda a: {"prompt": f"{a}+{a % 7 + 11}=", "answer": a + a % 7 + 11}
    (root / "problems.jsonl").write_text("\n".join(json.dumps(problem(a)) for a in range(10, 74)))
    jobs = []
    for command in [*SCRIPTS, LORA]:
        script, more, name = script_and_name(command)
        argv = flags(script, model_dir, str(root), teacher=teacher_dir, tool=tool_run_flags) + more
        jobs.append({"script": script, "argv": argv + ["--output-dir", str(root / "ddp" / name)], "rollouts": ""})
        jobs[-1]["rollouts"] = "" if script in (*PREFERENCE, "reward_model.py") else str(root / "rollouts" / name)
        if command in SHARDED:
            fsdp = argv + ["--fsdp", "--output-dir", str(root / "fsdp" / name)]
            jobs.append({"script": script, "argv": fsdp, "rollouts": jobs[-1]["rollouts"]})
    # PPO under FSDP2 (sharded weights, a critic, sharded optimizer state): 2 steps, against 1 step and then --resume
    ppo = lambda steps, out, *more: (
        flags("ppo.py", model_dir, str(root), steps) + ["--fsdp", "--output-dir", str(root / out), *more]
    )
    for argv in (ppo(2, "whole"), ppo(1, "parts"), ppo(2, "parts", "--resume")):
        jobs.append({"script": "ppo.py", "argv": argv, "rollouts": ""})
    sft_argv = ["--device", "cpu", "--max-steps", "2", "--num-check", "100", "--output-dir", str(root / "sft")]
    jobs.append({"script": "sft.py", "argv": sft_argv, "rollouts": ""})
    # reward_model.py on the built-in model with an empty pairs cache: rank 0 loads the policy and builds the pairs alone
    shutil.copytree(model_dir, models.builtin_model_dir(str(root / "cache"), "addition"))  # the warm-up, already cached
    rm_argv = ["--model-name-or-path", "builtin", "--cache-dir", str(root / "cache"), "--device", "cpu"]
    rm_argv += ["--num-pair-prompts", "64", "--group-size", "4", "--batch-size", "2", "--num-eval", "2"]
    rm_argv += ["--max-new-tokens", "4", "--total-steps", "1", "--output-dir", str(root / "rm_builtin")]
    jobs.append({"script": "reward_model.py", "argv": rm_argv, "rollouts": ""})
    for name, counts in (("empty_and_one", ["0", "1"]), ("three_and_five", ["3", "5"])):  # dist.global_count_per_rank
        jobs.append({"script": "tests/count_check.py", "argv": [str(root / f"{name}.json"), *counts], "rollouts": ""})
    (root / "jobs.json").write_text(json.dumps(jobs))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [os.path.join(ROOT, "tests", "distributed_jobs.py"), str(root / "jobs.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    return root


def trained(path) -> list[torch.Tensor]:
    return torch.load(path, weights_only=False)["trained"]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def first_moments(path) -> list[torch.Tensor]:
    """Adam's first moment of every trained tensor, m = 0.9 m + 0.1 g: after step 1 it is a tenth of the (clipped)
    gradient itself, after step 2 it mixes both steps' gradients."""
    state = torch.load(path, weights_only=False)["optimizer"]["state"]
    return [state[i]["exp_avg"] for i in sorted(state)]


# The ranks' gradients are summed in another order than one process's (each rank's partial sum, then the all-reduce),
# so float32 rounding differs: an entry of a gradient is a sum of at most a few thousand products (tokens of the batch
# times the hidden size), each rounded at u = 2^-24 = 6e-8, so the orders differ by at most about 1e-4 of the largest
# term; relative to each tensor's largest entry we allow 1e-4 (measured: below 1e-6). A missing average (a factor of
# 2) or a rank-local normaliser moves it by 10% or more. The weights themselves are not compared: Adam's first step
# moves a weight by lr * g / (|g| + 1e-8), which for a gradient entry near 1e-8 turns a 1e-10 rounding difference into
# 2% of the learning rate (seen: 1.84e-5 at lr 1e-3 on an AVX-512 CPU).
GRADIENT_TOLERANCE = 1e-4


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference of two lists of tensors, each relative to the largest entry of its tensor in `b`."""
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


@pytest.mark.parametrize("command", [*SCRIPTS, LORA])
def test_two_processes_update_like_one_on_the_union_of_their_rollouts(
    runs, model_dir, teacher_dir, tool_run_flags, monkeypatch, command
):
    """The gradients of the first optimizer step (and the second: Adam's first moments) of 2 ranks equal, to float32
    rounding, those of one process that replays the union of the 2 ranks' rollouts (DPO: of their pairs) with the same
    flags. Global reductions enter here: PPO's whitening and token mean, grpo_tools.py's conversations (a rank whose
    conversations end early keeps taking part in the turns of the other), DAPO's and CISPO's token means, DAPO's kept
    groups, REINFORCE++'s batch std, every script's mean over responses: a missing average or a rank-local normaliser
    would show. With --lora-rank the trained weights are the adapter's."""
    script, more, name = script_and_name(command)
    monkeypatch.setattr(tasks.Task, "verify", verifier_of(script))
    monkeypatch.setattr(run_state.Checkpoint, "save", keep_every_checkpoint())
    if script not in (*PREFERENCE, "reward_model.py"):
        monkeypatch.setattr(common, "generate", record_or_replay(str(runs / "rollouts" / name)))
    one = runs / "one" / name
    argv = flags(script, model_dir, str(runs), teacher=teacher_dir, tool=tool_run_flags) + more
    run_here(monkeypatch, script, *argv, "--output-dir", str(one))
    for step in (1, 2):
        ranks, single = (first_moments(run / f"checkpoint.pt.{step}") for run in (runs / "ddp" / name, one))
        assert relative_difference(ranks, single) < GRADIENT_TOLERANCE, f"step {step}"
    steps = (first_moments(one / f"checkpoint.pt.{step}") for step in (1, 2))
    assert relative_difference(*steps) > 100 * GRADIENT_TOLERANCE  # the second step saw another gradient
    ranks, single = rows(runs / "ddp" / name), rows(one)
    assert [r["step"] for r in ranks] == [0, 1, 2]  # one metrics.jsonl, written once per step
    if script == "grpo_tools.py":  # conversations with calls: one rank's may take more turns than the other's
        assert max(r.get("rollout/tool_calls", 0) for r in ranks) > 0
    keys = {"dpo.py": ("eval/rewards_margins", "loss/dpo"), "reward_model.py": ("eval/pairwise_accuracy", "loss/rm")}
    keys.update({s: ("eval/rewards_margins", f"loss/{s[:-3]}") for s in ("ipo.py", "simpo.py", "orpo.py")})
    keys["kto.py"] = ("eval/rewards_desirable", "kl/z0", "loss/kto")  # z0: over both ranks' mismatched pairs
    for key in keys.get(script, ("eval/accuracy", "loss/policy")):  # pooled over ranks
        # float32 means of at most 64 values of size below 10, taken in another order (64 * 10 * u = 4e-5 at worst; the
        # weights they are computed with differ by rounding only): measured below 1e-7
        assert ranks[-1][key] == pytest.approx(single[-1][key], abs=4e-5), key


@pytest.mark.parametrize("script", SHARDED)
def test_fsdp_updates_like_ddp_and_saves_a_model_that_loads(runs, script):
    from transformers import AutoModelForCausalLM

    name = script[:-3]
    for step in (1, 2):
        ddp, fsdp = (first_moments(runs / kind / name / f"checkpoint.pt.{step}") for kind in ("ddp", "fsdp"))
        assert relative_difference(fsdp, ddp) < GRADIENT_TOLERANCE, f"step {step}"
    fsdp = trained(runs / "fsdp" / name / "checkpoint.pt.2")
    model = AutoModelForCausalLM.from_pretrained(runs / "fsdp" / name / "model")
    saved = [p.detach() for p in model.parameters()]
    assert max_difference(saved, fsdp[: len(saved)]) == 0.0  # the gathered shards: the trained policy itself
    assert [r["step"] for r in rows(runs / "fsdp" / name)] == [0, 1, 2]


def test_a_resumed_fsdp_run_ends_like_an_uninterrupted_one(runs):
    """ppo.py --fsdp under 2 ranks: 2 steps in one go, against 1 step and then --resume for the second. The checkpoint
    gathers the shards of the weights and of the optimizer state and keeps each rank's random state: the metrics (but
    time/* and the first run's final evaluation at step 1) and the final weights are identical."""
    from safetensors.torch import load_file

    untimed = lambda run: [
        {k: v for k, v in r.items() if not k.startswith("time/") and not (k.startswith("eval/") and r["step"] == 1)}
        for r in rows(runs / run)
    ]
    assert untimed("parts") == untimed("whole") and [r["step"] for r in rows(runs / "parts")] == [0, 1, 2]
    whole, parts = (load_file(runs / run / "model" / "model.safetensors") for run in ("whole", "parts"))
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
    assert max_difference(trained(runs / "whole" / "checkpoint.pt"), trained(runs / "parts" / "checkpoint.pt")) == 0.0


def test_sft_under_torchrun_trains_like_one_process_on_the_whole_batch(runs, monkeypatch, tmp_path):
    """Two steps of the warm-up on 2 ranks (each half of every batch, whose answers have different numbers of tokens)
    against one process on the whole batches: the same weights, because each rank's token mean is rescaled by its share
    of the batch's answer tokens before the gradients are averaged (without that, the ranks' halves weigh alike)."""
    from safetensors.torch import load_file

    run_here(monkeypatch, "sft.py", "--device", "cpu", "--max-steps", "2", "--num-check", "100", "--output-dir", str(tmp_path))
    ranks, single = load_file(runs / "sft" / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    # The warm-up's rate ramps up: its first two Adam steps move a weight by at most lr_t = 2e-5, then 4e-5. The ranks'
    # gradients round differently by about u = 6e-8 of a tensor's largest entry (below 1e-2), which changes the step of
    # an entry near Adam's eps (1e-8) by at most 6e-10 / (4 * 1e-8) = 1.5% of lr_t: 6e-7. Weighing the ranks' halves alike
    # changes the second step's m / sqrt(v) by the relative change of the gradients (several percent): above 2e-6.
    assert max((ranks[k] - single[k]).abs().max().item() for k in single) < 2e-6


def test_the_global_count_is_shared_out_over_the_ranks(runs):
    """global_count_per_rank is the count over all ranks (at least 1) divided by their number: a rank with no valid token
    beside one with a single token gets 1/2, not 1 (each rank's share clamped at 1 would double that token's weight)."""
    for name, expected in (("empty_and_one", [0.5, 0.5]), ("three_and_five", [4.0, 4.0])):
        assert json.loads((runs / f"{name}.json").read_text()) == expected, name


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads' names from Linux's /proc")
def test_leaving_the_process_group_stops_its_gloo_threads(tmp_path):
    """At exit a script leaves the process group; its gloo threads must stop then, even when FSDP was imported after the
    group existed: a thread left running at Python's shutdown can abort the process as it frees a collective's tensors
    ("terminate called without an active exception"): that aborted this suite's torchrun in 5 of 80 tries of its
    last jobs."""
    out = tmp_path / "threads.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [os.path.join(ROOT, "tests", "leave_check.py"), str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text()) == []


def test_num_prompts_must_split_over_the_processes(monkeypatch):
    import grpo

    monkeypatch.setenv("WORLD_SIZE", "3")
    args = grpo.Args(num_prompts=32)
    with pytest.raises(SystemExit, match="--num-prompts 32: must split evenly over the 3 processes"):
        checks.distributed_flags(args, "num_prompts")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(SystemExit, match="--fsdp: shards the model over the processes of torchrun"):
        grpo.check_args(grpo.Args(fsdp=True))


def test_reward_model_builds_the_built_in_pairs_under_torchrun(runs):
    """Rank 0 loads the built-in policy and samples the pairs alone while the other rank waits for the cache: nothing in
    that build may wait for the other rank (it would never come)."""
    assert [r["step"] for r in rows(runs / "rm_builtin")] == [0, 1]
    assert any(name.startswith("dpo-pairs-") for name in os.listdir(runs / "cache"))
