"""Run under torchrun by test_distributed.py: the gloo threads each rank still has after dist.leave_process_group (what
a script's exit runs), when torch.distributed.fsdp was first imported after the process group existed, as
dist.prepare_models imports it. Rank 0 writes their names to OUT.json."""

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from plumbing import dist  # noqa: E402

if __name__ == "__main__":
    dist.init_device("cpu")
    from torch.distributed.fsdp import fully_shard  # noqa: F401, E402

    dist.all_reduce(torch.ones(1))
    dist.leave_process_group()
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    if dist.is_main():
        with open(sys.argv[1], "w") as f:
            json.dump([n for n in names if "gloo" in n], f)
