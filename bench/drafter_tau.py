"""Held-out tau of the shipped tiny drafters side by side: DFlash (``drafter``) and DFlash2 (``drafter2``).

Run: ``python bench/drafter_tau.py [--prompts 16] [--new-tokens 128] [--temperatures 0,0.7] [--json out.json]``

The tiny target with each shipped drafter, DFlash chain generation (the drafter's own block size), on
``--prompts`` held-out prompts of 128 bytes (``heldout_prompts(seed=0)``: standard-library packages the
pair never trained on), no stop token, fp32, one thread, both drafters in one process. tau = committed
tokens / rounds pooled over the prompts (``dflash.training.evaluation.measure_tau``; at T > 0 prompt ``i``
samples with seed ``i``, the default acceptance rule). Prints a Markdown table, the training steps each
drafter's ``train_log.json`` records beside it.
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash.tiny.corpus import heldout_prompts
from dflash.tiny.pair import DRAFTERS as DRAFTER_DIRS, load_default_pair
from dflash.training.evaluation import measure_tau

DRAFTERS = ("dflash", "dflash2")


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=_floats, default=[0.0, 0.7])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    prompts = heldout_prompts(args.prompts, 128, seed=0)
    report = {}
    for name in DRAFTERS:
        target, draft, _ = load_default_pair(drafter=name)
        log = json.loads((DRAFTER_DIRS[name] / "train_log.json").read_text())
        row = dict(steps=log.get("steps"), scheduled_steps=log.get("scheduled_steps", log.get("steps")))
        for t in args.temperatures:
            m = measure_tau(target, draft, prompts, temperature=t, max_new_tokens=args.new_tokens)
            row[f"tau_T{t:g}"] = round(m["tau"], 3)
        report[name] = row
    print(f"\n{args.prompts} held-out prompts x {args.new_tokens} new tokens, DFlash chain, CPU fp32, one thread\n")
    print("| drafter | training steps | " + " | ".join(f"tau T={t:g}" for t in args.temperatures) + " |")
    print("|---|---|" + "---|" * len(args.temperatures))
    for name, row in report.items():
        print(f"| {name} | {row['steps']} of {row['scheduled_steps']} | "
              + " | ".join(f"{row[f'tau_T{t:g}']:.2f}" for t in args.temperatures) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
