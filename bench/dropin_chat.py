"""The drop-in over a chat: ``target.generate()`` after ``dflash.apply`` against plain ``target.generate()``.

    python bench/dropin_chat.py [--calls 20] [--max-new-tokens 48] [--rows plain,eager,compiled]
                                [--max-cache-len auto|none|N] [--json out.json]

A chat-like sequence of ``--calls`` greedy calls on the shipped tiny pair (fp32, one thread): the first prompt
is ``--first-prompt-len`` bytes of held-out code, and each later prompt is the previous prompt, the previous
answer and a new "user line" (``--line-len`` bytes of other held-out code), so the prompt grows call by call
(from 128 to about 1800 bytes at the defaults) as a conversation's does. Rows, each on its own copy of the
target, applied once as a user would:

* ``plain``: transformers' own ``target.generate()``;
* ``eager``: ``dflash.apply(target, draft, method="ddtree")`` (DDTree, ``tree_budget="auto"``, eager rounds);
* ``compiled``: ``dflash.apply(target, draft, method="ddtree", compile=True)`` (inductor, its C++ wrapper on the CPU).

Every call runs every row, in an order that rotates by one row per call (a slow phase of the machine falls on
all of them). Nothing is warmed up: a drop-in row pays its set-up where it falls (the auto budget's cost
measurement on its first call; with ``compile=True`` also a compiled round on each call whose prompt and new
tokens the pooled rounds' caches cannot hold: with ``--max-cache-len auto``, the default, on the CPU none is
reserved, so a new round per power of two of rows, 256 to 2048 at the defaults; ``--max-cache-len 1900``
reserves the whole chat on the first call), which the handle reports
(``handle.last_setup_seconds``) and which is left out of tokens/s (and counted in "total s"). Target passes
are calls of the target's first decoder layer (a forward hook): prefill chunks plus one per round for the
drop-in, one per new token for transformers. Each drop-in call's tokens are checked against the plain call's
(the answer that extends the chat is the plain one).

Prints a markdown table (total seconds with set-up, set-up seconds and how many calls had any, tokens/s without
set-up, target passes per call: the first call, then the mean of the others, set-up passes included, and
whether every call gave plain's tokens) and the tokens/s ratios of each drop-in row over plain, measured side
by side in this run.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

ROWS = ("plain", "eager", "compiled")


def _budget(text):
    return "auto" if text == "auto" else [int(x) for x in text.split(",")] if "," in text else int(text)


def _cache_len(text):
    return "auto" if text == "auto" else None if text == "none" else int(text)


def _eager_pass_hook(counter):
    """A forward hook on the target's first layer counting its eager calls. Inside a compiled step it does
    nothing (it is traced once, and a CUDA graph replays no Python): those passes are counted per step call
    (:func:`count_passes`)."""

    def hook(*_):
        if not torch.compiler.is_compiling():
            counter[0] += 1

    return hook


def count_passes(passes):
    """Count each call of a compiled verify step as one target pass of its target (``passes[id(target)]``): the
    set-up's warm-up rounds and cost measurement and every round (on the CPU every verify calls it)."""
    from dflash.decoding import compiled

    real = compiled.RoundSteps._run_verify
    if getattr(real, "_counting", False):
        real = real._real

    def run_verify(self, bucket):
        if self.traced:
            counter = passes.get(id(self.rnd.adapter.model))
            if counter is not None:
                counter[0] += 1
        return real(self, bucket)

    run_verify._counting, run_verify._real = True, real
    compiled.RoundSteps._run_verify = run_verify
    return real


def chat_turns(calls: int, first_len: int, line_len: int):
    """``(first prompt, user lines)``: held-out code, the first prompt and one line per later call."""
    from dflash.tiny.corpus import heldout_prompts

    first = heldout_prompts(1, first_len, seed=0)[0]
    lines = heldout_prompts(max(calls - 1, 1), line_len, seed=1)
    return first, [[ord("\n")] + line for line in lines][: calls - 1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--first-prompt-len", type=int, default=128)
    p.add_argument("--line-len", type=int, default=40)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of plain,eager,compiled")
    p.add_argument("--tree-budget", type=_budget, default="auto", help="the drop-in's tree_budget (default auto)")
    p.add_argument("--max-cache-len", type=_cache_len, default="auto",
                   help="the compiled row's apply(max_cache_len=): auto (default: none reserved on the CPU), none, "
                        "or tokens")
    p.add_argument("--json", help="write every call's numbers here")
    p.add_argument("--quiet", action="store_true", help="no line per call on stderr")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not rows or any(r not in ROWS for r in rows):
        p.error(f"--rows must name some of {', '.join(ROWS)}")
    if args.calls < 1:
        p.error("--calls must be >= 1")
    torch.set_num_threads(1)
    import dflash
    from dflash.decoding import compiled
    from dflash.tiny.pair import load_default_pair

    base, draft, _ = load_default_pair()
    targets, handles, passes = {}, {}, {}
    real_run_verify = count_passes(passes)
    for row in rows:
        target = copy.deepcopy(base)
        passes[row] = [0]
        passes[id(target)] = passes[row]
        target.model.layers[0].register_forward_hook(_eager_pass_hook(passes[row]))
        if row != "plain":
            extra = dict(compile=True, max_cache_len=args.max_cache_len) if row == "compiled" else {}
            handles[row] = dflash.apply(target, draft, method="ddtree", tree_budget=args.tree_budget, **extra)
        targets[row] = target
    first, lines = chat_turns(args.calls, args.first_prompt_len, args.line_len)
    log = {row: [] for row in rows}
    prompt = list(first)
    try:
        for call in range(args.calls):
            ids = torch.tensor([prompt])
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                      do_sample=False)
            outs = {}
            order = rows[call % len(rows):] + rows[: call % len(rows)]
            for row in order:
                before = passes[row][0]
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    out = targets[row].generate(**kw)
                    seconds = time.perf_counter() - t0
                setup = handles[row].last_setup_seconds if row in handles else 0.0
                outs[row] = out[0, ids.shape[1]:].tolist()
                log[row].append(dict(prompt=ids.shape[1], new=len(outs[row]), seconds=seconds, setup=setup,
                                     passes=passes[row][0] - before))
            if not args.quiet:
                print(f"call {call + 1}/{args.calls}, prompt {ids.shape[1]}: " + ", ".join(
                    f"{row} {log[row][-1]['seconds']:.2f} s ({log[row][-1]['setup']:.2f} set-up, "
                    f"{log[row][-1]['passes']} passes)" for row in rows), file=sys.stderr, flush=True)
            answer = outs["plain"] if "plain" in outs else outs[rows[0]]
            for row in rows:
                log[row][-1]["same"] = outs[row] == answer
            if call + 1 < args.calls:
                prompt = prompt + answer + lines[call]
    finally:
        for handle in handles.values():
            handle.__exit__()
        compiled.RoundSteps._run_verify = real_run_verify

    summary = {}
    for row in rows:
        calls = log[row]
        total = sum(c["seconds"] for c in calls)
        setup = sum(c["setup"] for c in calls)
        new = sum(c["new"] for c in calls)
        later = [c["passes"] for c in calls[1:]]
        summary[row] = dict(total_s=total, setup_s=setup, new_tokens=new, tokens_per_s=new / max(total - setup, 1e-9),
                            tokens_per_s_with_setup=new / total, first_passes=calls[0]["passes"],
                            later_passes=sum(later) / len(later) if later else None,
                            setup_calls=sum(c["setup"] > 0 for c in calls),
                            same_tokens=all(c["same"] for c in calls))
    names = {"plain": "plain `target.generate()`", "eager": "drop-in, eager",
             "compiled": "drop-in, `compile=True`" + ("" if args.max_cache_len == "auto" else
                                                       f", `max_cache_len={args.max_cache_len}`")}
    print(f"{args.calls} chat calls, prompts {log[rows[0]][0]['prompt']} to {log[rows[0]][-1]['prompt']} tokens, "
          f"up to {args.max_new_tokens} new tokens each, greedy, the tiny pair, one thread\n")
    print("| row | total s | set-up s (calls with set-up) | tokens/s (set-up excluded) | target passes per call "
          "(first / later) | same tokens as plain |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        s = summary[row]
        later = "-" if s["later_passes"] is None else f"{s['later_passes']:.1f}"
        print(f"| {names[row]} | {s['total_s']:.1f} | {s['setup_s']:.1f} ({s['setup_calls']}) | "
              f"{s['tokens_per_s']:.0f} | {s['first_passes']} / {later} | {'yes' if s['same_tokens'] else 'NO'} |")
    if "plain" in rows:
        for row in rows:
            if row != "plain":
                s, ref = summary[row], summary["plain"]
                print(f"\n{names[row]} / plain: {s['tokens_per_s'] / ref['tokens_per_s']:.2f}x tokens/s "
                      f"(set-up excluded), {ref['total_s'] / s['total_s']:.2f}x over the whole chat with its set-up")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), summary=summary, calls=log), f, indent=1)
    if not all(summary[row]["same_tokens"] for row in rows):
        print("FAILED: a drop-in call's tokens differ from plain target.generate()'s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
