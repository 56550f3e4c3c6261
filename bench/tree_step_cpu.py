"""The CPU implementation of the DDTree round's tree step: C++ host build + walk vs the device ops, eager.

Usage: ``python bench/tree_step_cpu.py [--prompts 8] [--max-new-tokens 128] [--budgets 8 32] [--repeats 3]
[--threads 1]``

On the CPU with the reference backend an eager DDTree round builds its tree
with :func:`dflash_kernels.build_tree` and walks it with
:func:`dflash_kernels.walk_tree` (C++ on host tensors); a traced round uses
the tensor ops (:func:`dflash_kernels.build_tree` with ``on_device=True``,
:func:`dflash_kernels.walk_tree_device`). This runs the tiny pair's eager
DDTree both ways, interleaved prompt by prompt, and prints tokens/s of each,
the ratio, and whether the tokens are the same (they must be: the same tree
and path).
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import dflash
    from dflash.decoding import compiled
    from dflash.tiny.corpus import line_start_prompts
    from dflash.tiny.pair import load_default_pair

    host_round = compiled.Round

    class DeviceTreeRound(host_round):
        def __init__(self, *a, **k):
            super().__init__(*a, host_tree=False, **k)

    target, draft, _ = load_default_pair()
    prompts = [torch.tensor(q) for q in line_start_prompts("heldout", args.prompts, 64, seed=0)]
    print(f"threads={args.threads} prompts={args.prompts} max_new_tokens={args.max_new_tokens} "
          f"repeats={args.repeats} torch={torch.__version__}")
    print("| budget | host tree tok/s | device ops tok/s | host / device | same tokens |")
    print("|---|---|---|---|---|")
    for budget in args.budgets:
        seconds = {"host": 0.0, "device": 0.0}
        tokens = {"host": 0, "device": 0}
        same = True
        for _ in range(args.repeats):
            for prompt in prompts:
                outs = {}
                for way, cls in (("host", host_round), ("device", DeviceTreeRound)):
                    compiled.Round = cls
                    try:
                        r = dflash.generate(target, draft, prompt, method="ddtree", tree_budget=budget,
                                            max_new_tokens=args.max_new_tokens)
                    finally:
                        compiled.Round = host_round
                    seconds[way] += r.total_time
                    tokens[way] += r.num_new_tokens
                    outs[way] = r.output_ids
                same &= torch.equal(outs["host"], outs["device"])
        tps = {w: tokens[w] / seconds[w] for w in seconds}
        print(f"| {budget} | {tps['host']:.1f} | {tps['device']:.1f} | {tps['host'] / tps['device']:.2f}x | "
              f"{'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
