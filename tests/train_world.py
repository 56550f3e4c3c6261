"""Run several ``python -m dflash train`` command lines in one torchrun launch (one process group).

Used by tests/training/test_train_distributed.py: ``torchrun --standalone --nproc-per-node 2 tests/train_world.py
RUNS.json`` with RUNS.json a list of argument lists. Joining the group once and running the trainings
one after another saves a launch (process start-up, imports) per configuration.
"""

import json
import sys

import torch.distributed as dist

from dflash.training.train import main


def run(path: str) -> int:
    with open(path) as f:
        runs = json.load(f)
    dist.init_process_group("gloo")
    try:
        for argv in runs:
            rc = main(argv)
            if rc:
                return rc
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1]))
