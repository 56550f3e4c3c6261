"""DDTree over DFlash2 drafters, side by side with the DFlash2 chain and DDTree over a DFlash drafter.

Run: ``python bench/dflash2_trees.py [--target DIR] [--drafter2 DIR] [--drafter DIR] [--budgets 8,16,32]``

Rows (same prompts, interleaved per prompt after one warm-up generation per row; greedy):

* ``ar``: plain decoding (the tokens/s baseline and the tokens every row must equal);
* ``dflash2 chain``: ``method="dflash"`` with the DFlash2 drafter (its selector's greedy chain);
* ``ddtree/dflash2 N``: ``method="ddtree"`` with the DFlash2 drafter: the tree over the selector's
  conditional scores (``dflash_kernels.build_selector_tree_device``), budget ``N``;
* ``dflash chain`` / ``ddtree/dflash N``: the same with the DFlash drafter (independent per-position top-K).

tau = committed tokens per round (bonus included), pooled over prompts; tokens/s = new tokens / wall time
of the whole generation. Defaults: the shipped tiny target and drafters (``dflash/assets/tiny/{target,
drafter,drafter2}``); the DFlash2 rows are skipped, with a note, when no DFlash2 drafter is found. Prompts:
held-out standard-library code, as ``python -m dflash bench`` gathers them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import dflash
from dflash.benchmark.prompts import builtin_prompts
from dflash.tiny.pair import ASSETS, load_target, load_tokenizer


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def rows(have2: bool, have1: bool, budgets):
    out = [("ar", None, "ar", None)]
    if have2:
        out.append(("dflash2 chain", "d2", "dflash", None))
        out += [(f"ddtree/dflash2 {b}", "d2", "ddtree", b) for b in budgets]
    if have1:
        out.append(("dflash chain", "d1", "dflash", None))
        out += [(f"ddtree/dflash {b}", "d1", "ddtree", b) for b in budgets]
    return out


def run_one(target, drafter, method, budget, prompt, new_tokens):
    kw = dict(method=method, max_new_tokens=new_tokens)
    if budget is not None:
        kw["tree_budget"] = budget
    start = time.perf_counter()
    res = dflash.generate(target, drafter if method != "ar" else None, prompt, **kw)
    return res, time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(ASSETS / "target"))
    p.add_argument("--drafter2", default=str(ASSETS / "drafter2"), help="a DFlash2 drafter directory")
    p.add_argument("--drafter", default=str(ASSETS / "drafter"), help="a DFlash drafter directory ('' to skip)")
    p.add_argument("--budgets", type=_ints, default=[8, 16, 32])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = load_target(args.target, dtype, args.device)
    drafters = {}
    for key, path in (("d2", args.drafter2), ("d1", args.drafter)):
        if path and (Path(path) / "config.json").is_file():
            drafters[key] = dflash.DFlashDraftModel.from_pretrained(path, dtype=dtype, device=args.device)
        elif path:
            print(f"note: no drafter at {path}: its rows are skipped")
    if "d2" in drafters and not isinstance(drafters["d2"], dflash.DFlash2DraftModel):
        raise SystemExit(f"--drafter2 {args.drafter2} is not a DFlash2 drafter")
    if "d1" in drafters and isinstance(drafters["d1"], dflash.DFlash2DraftModel):
        raise SystemExit(f"--drafter {args.drafter} is a DFlash2 drafter; pass it as --drafter2")
    table = rows("d2" in drafters, "d1" in drafters, args.budgets)
    prompts = builtin_prompts(load_tokenizer(args.target), args.num_prompts, args.prompt_len, 0)
    stats = {label: dict(tokens=0, rounds=0, lengths=0, time=0.0, lossless=True) for label, *_ in table}
    for label, key, method, budget in table:  # one warm-up generation per row
        run_one(target, drafters.get(key), method, budget, prompts[0], 8)
    for i, prompt in enumerate(prompts):
        order = table[i % len(table):] + table[: i % len(table)]
        results = {}
        for label, key, method, budget in order:
            res, wall = run_one(target, drafters.get(key), method, budget, prompt, args.max_new_tokens)
            results[label] = res
            s = stats[label]
            s["tokens"] += res.output_ids.shape[-1] - len(prompt)
            s["time"] += wall
            s["rounds"] += len(res.acceptance_lengths)
            s["lengths"] += sum(res.acceptance_lengths)
        want = results["ar"].output_ids
        for label, res in results.items():
            stats[label]["lossless"] &= bool(torch.equal(res.output_ids, want))
    print(f"device {args.device}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, greedy")
    print(f"{'row':<20} {'tau':>6} {'tokens/s':>9}  equals ar")
    for label, *_ in table:
        s = stats[label]
        tau = s["lengths"] / max(1, s["rounds"]) if label != "ar" else 1.0
        print(f"{label:<20} {tau:>6.2f} {s['tokens'] / s['time']:>9.1f}  {'yes' if s['lossless'] else 'NO'}")
    return 0 if all(s["lossless"] for s in stats.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
