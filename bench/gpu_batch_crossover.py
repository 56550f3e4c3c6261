"""Where trees stop paying as the batch grows: tokens/s of ar, the DFlash chain and DDTree budgets at batch 1, 4, 16.

Run on a GPU machine: ``python bench/gpu_batch_crossover.py [--layers 4] [--batch-sizes 1,4,16]
[--budgets 8,32,64]``. On a CPU (tests): ``python bench/gpu_batch_crossover.py --dry-run`` (tiny fp32
shapes: a check of the script, not of speed).

The target is a ``Qwen3ForCausalLM`` with random weights at Qwen3-8B shapes cut to ``--layers`` decoder
layers, fp32 by default for the reason ``gpu_auto_budget.py`` gives (random weights' flat logits flip
near-ties in bf16, and the steered drafter then drafts the wrong text). The drafter is that script's
:class:`~gpu_auto_budget.SteeredDraft`: it ranks the target's own greedy continuation first with
probability ``--p-right`` per block position (else a wrong token first and the right one second), so
acceptance falls along the block as a real drafter's does and wider trees catch the misses. A batch is
``b`` copies of one prompt (the rows run independently; the same text keeps every row steered).

Rows: ``ar``, ``dflash`` (block ``--block``) and ``ddtree`` at each budget, at each batch size; one warm-up
generation each, then ``--repeats`` passes over the rows, interleaved. tokens/s = every row's new tokens over
the generations' ``total_time`` (set-up excluded), pooled; tau = committed tokens per round. Printed and in
the JSON: the table and, per batch size, the fastest method and its speed over ``ar``: the crossover where
the tree's extra verify rows stop paying is where ``ddtree`` stops being the fastest.

JSON goes to ``--json``, else ``$OUT/gpu_batch_crossover.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_auto_budget import steered_pair  # noqa: E402
from gpu_common import add_dry_run, apply_dry_run, default_json, fail_without_cuda, write_json  # noqa: E402

import dflash  # noqa: E402

PROG = "gpu_batch_crossover"


def _ints(text: str):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small fp32 model (CPU test of this script)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the cut target (default 4; tiny 2)")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 4, 16])
    p.add_argument("--budgets", type=_ints, default=[8, 32, 64])
    p.add_argument("--block", type=int, default=16, help="drafter block size")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--p-right", type=float, default=0.8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", default=None)
    add_dry_run(p)
    args = p.parse_args(argv)
    apply_dry_run(args, PROG, layers=2, block=6, prompt_len=24, new_tokens=12, repeats=1, batch_sizes=[1, 3],
                  budgets=[4, 8])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if fail_without_cuda(torch, device, PROG):
        return 2
    target, draft, prompt, ref, dtype, layers = steered_pair(args, device)
    methods = [("ar", None), ("dflash", None)] + [(f"ddtree {b}", b) for b in args.budgets]
    rows = [(name, budget, b) for b in args.batch_sizes for name, budget in methods]
    stats = {row: dict(tokens=0, seconds=0.0, rounds=0, committed=0, equal=True) for row in rows}

    def run(name, budget, b):
        ids = prompt[None].expand(b, -1).contiguous()
        kw = dict(max_new_tokens=args.new_tokens, attention_mask=torch.ones_like(ids))
        if name == "ar":
            return dflash.generate(target, None, ids, method="ar", **kw)
        if name == "dflash":
            return dflash.generate(target, draft, ids, method="dflash", **kw)
        return dflash.generate(target, draft, ids, method="ddtree", tree_budget=budget, **kw)

    for row in rows:
        run(*row)
    for _ in range(args.repeats):
        for row in rows:
            res = run(*row)
            s = stats[row]
            s["tokens"] += res.num_new_tokens
            s["seconds"] += res.total_time
            s["rounds"] += res.num_rounds
            s["committed"] += sum(res.acceptance_lengths)
            outs = [r.output_ids for r in res.rows] if res.rows else [res.output_ids]
            s["equal"] &= all(bool(torch.equal(o, ref)) for o in outs)
    table = [dict(method=name, budget=budget, batch_size=b, tokens_per_second=s["tokens"] / s["seconds"],
                  tau=s["committed"] / s["rounds"], equal_to_greedy=s["equal"])
             for (name, budget, b), s in stats.items()]
    best = {}
    for b in args.batch_sizes:
        at = [r for r in table if r["batch_size"] == b]
        ar = next(r for r in at if r["method"] == "ar")
        top = max(at, key=lambda r: r["tokens_per_second"])
        best[str(b)] = dict(method=top["method"], over_ar=top["tokens_per_second"] / ar["tokens_per_second"])
    report = dict(prog=PROG, device=str(device), dtype=str(dtype), layers=layers, block=args.block,
                  p_right=args.p_right, prompt_len=args.prompt_len, new_tokens=args.new_tokens, table=table,
                  best=best)
    print("| batch | method | tokens/s | tau | equal to greedy |\n|---|---|---|---|---|")
    for r in table:
        print(f"| {r['batch_size']} | {r['method']} | {r['tokens_per_second']:.1f} | {r['tau']:.2f} | "
              f"{r['equal_to_greedy']} |")
    for b, top in best.items():
        print(f"batch {b}: fastest {top['method']}, {top['over_ar']:.2f}x ar")
    write_json(default_json(args.json, "gpu_batch_crossover.json"), report)
    if dtype == torch.float32 and not all(r["equal_to_greedy"] for r in table):
        print(f"{PROG}: FAIL: an fp32 row differs from greedy decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
