"""Run under torchrun by test_distributed.py: what dist.global_count_per_rank gives each rank for counts that differ
between the ranks (rank r holds count COUNTS[r]), written to OUT.json by rank 0."""

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from plumbing import dist  # noqa: E402

if __name__ == "__main__":
    dist.init_device("cpu")
    counts = [int(c) for c in sys.argv[2:]]
    shares = dist.gather_objects(dist.global_count_per_rank(torch.tensor(counts[dist.rank()])).item())
    if dist.is_main():
        with open(sys.argv[1], "w") as f:
            json.dump(shares, f)
