"""Eager vs compiled rounds (``generate(compile=True)``) on the tiny pair, interleaved in one run.

Usage: ``python bench/compile_speed.py [--methods dflash ddtree ar] [--prompts 8] [--max-new-tokens 128]
[--repeats 3] [--threads 1] [--temperature 0]``

For each method, every repeat runs each prompt eagerly and compiled, one after
the other (these machines are noisy: only ratios measured side by side mean
anything). Compilation happens once per method before the timed runs and is
reported apart (``compile s``); tokens/s never include it. Prints a markdown
table: tokens/s eager, compiled, the ratio, tau of each, and whether the
compiled tokens equal the eager ones (greedy, or sampled with the same seed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["dflash", "ddtree"], choices=["ar", "dflash", "ddtree"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tree-budget", type=int, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import dflash
    from dflash.tiny.corpus import line_start_prompts
    from dflash.tiny.pair import load_default_pair

    target, draft, tok = load_default_pair()
    prompts = [torch.tensor(p) for p in line_start_prompts("heldout", args.prompts, 64, seed=0)]
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    rows = []
    for method in args.methods:
        kw = dict(common, method=method)
        if method == "ddtree" and args.tree_budget is not None:
            kw["tree_budget"] = args.tree_budget
        t0 = time.perf_counter()
        warm = dflash.generate(target, draft, prompts[0], compile=True, **kw)
        compile_s = warm.compile_time
        first_call_s = time.perf_counter() - t0
        times = {False: [], True: []}
        toks = {False: 0, True: 0}
        taus = {False: [], True: []}
        same = True
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                outs = {}
                for mode in (False, True):
                    kw["seed"] = 1000 * rep + i  # T > 0: every (prompt, repeat) its own draws, the same for both
                    r = dflash.generate(target, draft, prompt, compile=mode, **kw)
                    times[mode].append(r.total_time)
                    toks[mode] += r.num_new_tokens
                    taus[mode].append(r.tau)
                    outs[mode] = r.output_ids
                    if mode and r.compile_time > 0:
                        compile_s += r.compile_time  # a new cache-size bucket compiled (reported, not timed)
                same &= torch.equal(outs[False], outs[True])
        tps = {m: toks[m] / sum(times[m]) for m in (False, True)}
        rows.append((method, tps[False], tps[True], tps[True] / tps[False], statistics.mean(taus[False]),
                     statistics.mean(taus[True]), same, compile_s, first_call_s))
    print(f"threads={args.threads} prompts={args.prompts} max_new_tokens={args.max_new_tokens} "
          f"repeats={args.repeats} temperature={args.temperature} torch={torch.__version__}")
    print("| method | eager tok/s | compiled tok/s | ratio | tau eager | tau compiled | same tokens | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for m, e, c, ratio, te, tc, same, cs, _ in rows:
        same_s = "yes" if same else "NO"  # one seed: eager and compiled draw the same samples at T > 0 too
        print(f"| {m} | {e:.1f} | {c:.1f} | {ratio:.2f}x | {te:.2f} | {tc:.2f} | {same_s} | {cs:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
