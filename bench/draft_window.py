"""The drafter window on long prompts: tau and decode tokens/s with and without ``draft_window``.

Run: ``python bench/draft_window.py [--lengths 2048,4096,8192] [--windows none,256,512,1024]
[--max-new-tokens 128] [--prompts 2] [--repeats 1] [--method dflash] [--json out.json]``

The shipped tiny pair (``load_default_pair``: byte-level target and its DFlash drafter), fp32 on the CPU, one
thread, greedy. Prompts of each length are byte windows of the held-out standard-library packages
(``heldout_prompts``: each starts at a line start inside one file the pair never trained on). For every prompt
the windows take turns (the order rotated prompt by prompt and repeat by repeat), after one short warm-up
generation per window; with ``--repeats R`` each (prompt, window) runs R times and its fastest run counts
(greedy rounds are the same every time, so only the clock varies: the minimum drops what other processes
on the machine cost).
Every windowed output is checked against the unwindowed one (greedy: the target's own tokens; the script
fails on any difference). tau = committed tokens / rounds pooled over the prompts; decode tokens/s = the new
tokens after the first / the time after the first token (the prefill is the same with or without a window);
draft and verify are milliseconds per round. Prints a Markdown table.

On the CPU the drafter's reference attention still runs over every cached context row, masked (the window
bounds what the drafter sees, not the cache), so the speed column measures what a different acceptance does;
on a GPU the Triton kernel also skips the key tiles before the window.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import dflash
from dflash.tiny.corpus import heldout_prompts
from dflash.tiny.pair import load_default_pair


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def _windows(text):
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        if x:
            out.append(None if x in ("none", "off") else int(x))
    return out


def _label(window):
    return "none" if window is None else str(window)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=_ints, default=[2048, 4096, 8192], help="prompt lengths in tokens (bytes)")
    p.add_argument("--windows", type=_windows, default=[None, 256, 512, 1024],
                   help="drafter windows to compare; 'none' is no window (the reference of every output)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=2, help="prompts per length")
    p.add_argument("--repeats", type=int, default=1, help="runs per (prompt, window); the fastest counts")
    p.add_argument("--method", choices=["dflash", "ddtree"], default="dflash")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    windows = list(dict.fromkeys([None] + args.windows))  # the unwindowed run is every output's reference
    torch.set_num_threads(1)
    target, draft, _ = load_default_pair()
    kw = dict(method=args.method, max_new_tokens=args.max_new_tokens)
    for w in windows:  # warm-up: one short generation per setting
        dflash.generate(target, draft, heldout_prompts(1, 64, seed=1)[0], method=args.method, max_new_tokens=8,
                        draft_window=w)
    rows = []
    for length in args.lengths:
        prompts = heldout_prompts(args.prompts, length, seed=0)
        stats = {w: dict(committed=0, rounds=0, decode_tokens=0, decode_time=0.0, draft=0.0, verify=0.0)
                 for w in windows}
        for i, prompt in enumerate(prompts):
            outputs, fastest = {}, {}
            for rep in range(args.repeats):
                turn = (i + rep) % len(windows)
                for w in windows[turn:] + windows[:turn]:
                    res = dflash.generate(target, draft, prompt, draft_window=w, **kw)
                    if w in outputs and not torch.equal(res.output_ids, outputs[w]):
                        raise SystemExit(f"draft_window={w}: two runs of prompt {i} differ")
                    outputs[w] = res.output_ids
                    if w not in fastest or res.decode_time < fastest[w].decode_time:
                        fastest[w] = res
            for w, res in fastest.items():
                s = stats[w]
                s["committed"] += sum(res.acceptance_lengths)
                s["rounds"] += res.num_rounds
                s["decode_tokens"] += res.num_new_tokens - 1
                s["decode_time"] += res.decode_time
                s["draft"] += res.draft_time
                s["verify"] += res.verify_time
            for w in windows:
                if not torch.equal(outputs[w], outputs[None]):
                    raise SystemExit(f"draft_window={w} changed the output of prompt {i} at {length} tokens")
        for w in windows:
            s = stats[w]
            rows.append(dict(length=length, window=_label(w), tau=s["committed"] / max(1, s["rounds"]),
                             decode_tokens_per_second=s["decode_tokens"] / s["decode_time"],
                             draft_ms_per_round=1e3 * s["draft"] / max(1, s["rounds"]),
                             verify_ms_per_round=1e3 * s["verify"] / max(1, s["rounds"])))
    print(f"\n{args.prompts} held-out prompts per length x {args.max_new_tokens} new tokens, {args.method}, greedy, "
          f"tiny pair, CPU fp32, one thread, fastest of {args.repeats} run(s) ({time.strftime('%Y-%m-%d')}); every "
          f"output equal to the unwindowed one\n")
    print("| prompt tokens | draft_window | tau | decode tokens/s | draft ms/round | verify ms/round |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {r['window']} | {r['tau']:.2f} | {r['decode_tokens_per_second']:.1f} | "
              f"{r['draft_ms_per_round']:.2f} | {r['verify_ms_per_round']:.2f} |")
    report = dict(method=args.method, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                  repeats=args.repeats, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
