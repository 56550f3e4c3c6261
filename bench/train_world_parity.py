"""World 1 against world 2 (DDP and FSDP2, torchrun, gloo on the CPU): the drafter after the same steps.

Trains the tiny target's drafter on the target's own greedy continuations three times at the same global
batch: one process, then ``torchrun --nproc-per-node 2 -m dflash train --parallel ddp`` and ``... fsdp``,
and prints the largest absolute difference of the fp32 weights (and of the AdamW moments) between each
world-2 run and world 1::

    python bench/train_world_parity.py --steps 20 --out /tmp/world_parity

Differences come from the order of fp32 additions only (the all-reduce sums two halves of the batch
that one process adds in another order).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tensors(out: Path):
    from safetensors.torch import load_file

    meta = json.loads((out / "training_state" / "training_state.json").read_text())
    return load_file(str(out / "training_state" / meta["tensors"]["file"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/world_parity")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4, help="global batch (sequences per step)")
    p.add_argument("--sequences", type=int, default=16, help="greedy continuations to train on")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    target = str(ROOT / "dflash" / "assets" / "tiny" / "target")
    data = out / "data.jsonl"
    if not data.is_file():
        subprocess.run([sys.executable, "-m", "dflash.training.data", "--target", target, "--out", str(data),
                        "--num", str(args.sequences), "--prompt-len", "64", "--new-tokens", "64", "--batch-size",
                        str(args.sequences), "--seed", "0", "--threads", "1"], env=env, check=True)
    common = ["-m", "dflash", "train", "--target", target, "--data", str(data), "--layers", "2", "--block-size", "8",
              "--target-layer-ids", "1,3", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--blocks-per-seq", "8", "--lr", "1e-3", "--warmup-steps", "5", "--seed", "0", "--threads", "1",
              "--quiet", "--save-every", "0", "--save-dtype", "fp32", "--no-tensorboard"]
    runs = {"world1": [sys.executable] + common + ["--out", str(out / "world1")]}
    for parallel in ("ddp", "fsdp"):
        runs[f"world2_{parallel}"] = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc-per-node", "2"] + common + ["--parallel", parallel,
                                                                               "--out", str(out / f"world2_{parallel}")]
    seconds = {}
    for name, cmd in runs.items():
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True)
        seconds[name] = time.perf_counter() - t0
    ref = _tensors(out / "world1")
    report = {"steps": args.steps, "global_batch": args.batch_size, "seconds": {k: round(v, 1) for k, v in seconds.items()}}
    for parallel in ("ddp", "fsdp"):
        other = _tensors(out / f"world2_{parallel}")
        weights = max((ref[k] - other[k]).abs().max().item() for k in ref if k.startswith("model."))
        moments = max((ref[k] - other[k]).abs().max().item() for k in ref if k.startswith("optim."))
        scale = max(ref[k].abs().max().item() for k in ref if k.startswith("model."))
        report[parallel] = {"max_abs_weight_diff": weights, "max_abs_adam_moment_diff": moments,
                            "max_abs_weight": scale}
        print(f"world 2 {parallel:4s} vs world 1 after {args.steps} steps: max |dW| = {weights:.3g} "
              f"(largest |W| {scale:.3g}), max |d moment| = {moments:.3g}")
    (out / "parity.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
