"""Run several scripts, one after another, in the processes of one torchrun (they are slow to start, so they are shared):

    torchrun --standalone --nproc-per-node 2 tests/distributed_jobs.py JOBS.json

JOBS.json is a list of {"script": ..., "argv": [...], "rollouts": FOLDER or ""}. Each script runs as `python SCRIPT ARGV`
would, with its sampled rollouts recorded to FOLDER (or replayed, when recorded there; see rollouts.py), the verifier of
`verifier_of(script)`, and a copy of checkpoint.pt kept after every save (checkpoint.pt.STEP). test_distributed.py does the
same in one process and compares."""

import json
import os
import runpy
import shutil
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rollouts import record_or_replay  # noqa: E402

import common  # noqa: E402
import tasks  # noqa: E402
from plumbing import dist, run_state  # noqa: E402


def text_reward(self, completions, answers):
    """A reward that depends only on the completion's text, in 7 levels: the same answers get the same scores in every
    run, and a group of four different answers is rarely all equal (DAPO's dynamic sampling keeps it)."""
    return torch.tensor([sum(map(ord, c)) % 7 / 6 for c in completions])


def binary_text_reward(self, completions, answers):
    """text_reward's 0 / 1 version, for maxrl.py, whose estimator needs a success or a failure."""
    return torch.tensor([float(sum(map(ord, c)) % 2) for c in completions])


def verifier_of(script: str):
    return binary_text_reward if script == "maxrl.py" else text_reward


def keep_every_checkpoint(save=run_state.Checkpoint.save):
    """Checkpoint.save that also keeps a copy of each step's checkpoint (rank 0 writes it)."""

    def save_and_copy(self, step, extra=None):
        save(self, step, extra)
        if dist.is_main():
            shutil.copy(self.path, f"{self.path}.{step}")

    return save_and_copy


generate = common.generate  # the real one, for the jobs that record nothing


def run_job(job: dict) -> None:
    common.generate = record_or_replay(job["rollouts"]) if job["rollouts"] else generate
    tasks.Task.verify = verifier_of(job["script"])
    sys.argv = [job["script"], *job["argv"]]
    try:
        runpy.run_path(os.path.join(ROOT, job["script"]), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise


if __name__ == "__main__":
    os.environ["TQDM_DISABLE"] = "1"
    run_state.Checkpoint.save = keep_every_checkpoint()
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        run_job(job)
