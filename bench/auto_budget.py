"""``tree_budget="auto"`` against every fixed DDTree budget, per prompt set, side by side.

Run: ``python bench/auto_budget.py [--budgets 4,8,16,32,64] [--prompts 8] [--new-tokens 96] [--repeats 3]
[--drafter dflash|dflash2] [--json out.json]``

Prompt sets, each of ``--prompts`` prompts of 128 bytes from the held-out standard-library packages
(code the tiny pair never trained on):

* ``code``: prompts that start at a line start (what ``python -m dflash bench`` uses);
* ``prose``: prompts that end where a comment or docstring line begins, so the continuation is English text.

Rows: ``ar`` (the tokens every row must equal), ``ddtree N`` for each fixed budget, ``ddtree auto`` (the
buckets are the fixed budgets). Each row runs one warm-up generation first (the auto row's cost measurement
happens there, outside the timed runs), then the rows take turns prompt by prompt, ``--repeats`` times over,
in an order that rotates by one row per prompt, so slow phases of a noisy machine fall on every row alike.
tokens/s = new tokens / the generations' ``total_time`` (set-up excluded), pooled; tau = committed tokens per
round, pooled. Greedy, one thread.

Printed per set: the table, the best and the median fixed budget, and auto's tokens/s as a ratio of each.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import dflash
from dflash.tiny.corpus import heldout_prompts, load_corpus
from dflash.tiny.pair import load_default_pair

PROMPT_LEN = 128


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def prose_prompts(n: int, prompt_len: int = PROMPT_LEN, following: int = 256) -> list:
    """``n`` prompts of ``prompt_len`` bytes of held-out files that end just before a comment or docstring line
    (its stripped text starts with ``#``, or it lies inside a triple-quoted block and starts with a letter);
    evenly spread over the eligible places, deterministic."""
    places = []
    for data in load_corpus("heldout"):
        inside, start = False, 0
        while start < len(data):
            nl = data.find(b"\n", start)
            end = len(data) if nl < 0 else nl
            line = data[start:end]
            text = line.strip()
            prose = text.startswith(b"#") or (inside and text[:1].isalpha())
            if prose and prompt_len <= start <= len(data) - following:
                places.append(list(data[start - prompt_len : start]))
            if line.count(b'"""') % 2 == 1:
                inside = not inside
            start = end + 1
    if len(places) < n:
        raise ValueError(f"only {len(places)} prose places, asked for {n}")
    step = len(places) / n
    return [places[int(i * step)] for i in range(n)]


def run(target, draft, prompt, budget, new_tokens):
    kw = dict(max_new_tokens=new_tokens)
    if budget is None:
        return dflash.generate(target, None, prompt, method="ar", **kw)
    return dflash.generate(target, draft, prompt, method="ddtree", tree_budget=budget, **kw)


def measure(target, draft, prompts, budgets, new_tokens, repeats):
    rows = [("ar", None)] + [(f"ddtree {b}", b) for b in budgets] + [("ddtree auto", list(budgets))]
    stats = {name: dict(tokens=0, seconds=0.0, rounds=0, committed=0, equal=True, sizes=[]) for name, _ in rows}
    for name, budget in rows:  # warm-up (and auto's cost measurement) outside the timed runs
        run(target, draft, torch.tensor(prompts[0]), budget, new_tokens)  # the timed runs' cache size: set-up here
    turn = 0
    for _ in range(repeats):
        for prompt in prompts:
            ids = torch.tensor(prompt)
            outputs = {}
            # the rows' order rotates from prompt to prompt, so no row always runs after the same one (after the
            # largest tree, say, whose caches are the longest) or first after a prompt changes
            for name, budget in rows[turn % len(rows):] + rows[: turn % len(rows)]:
                res = run(target, draft, ids, budget, new_tokens)
                s = stats[name]
                s["tokens"] += res.num_new_tokens
                s["seconds"] += res.total_time
                if budget is not None:
                    s["rounds"] += len(res.acceptance_lengths)
                    s["committed"] += sum(res.acceptance_lengths)
                    s["sizes"] += res.tree_sizes
                outputs[name] = res.output_ids
            for name, _ in rows:  # every row against ar's tokens
                if not torch.equal(outputs[name], outputs["ar"]):
                    stats[name]["equal"] = False
            turn += 1
    table = {}
    for name, _ in rows:
        s = stats[name]
        table[name] = dict(tokens_per_second=s["tokens"] / s["seconds"],
                           tau=s["committed"] / s["rounds"] if s["rounds"] else None,
                           equal_to_ar=s["equal"],
                           mean_tree_nodes=statistics.fmean(s["sizes"]) if s["sizes"] else None)
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=_ints, default=[4, 8, 16, 32, 64])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drafter", choices=["dflash", "dflash2"], default="dflash")
    p.add_argument("--sets", default="code,prose")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    target, draft, _ = load_default_pair(drafter=args.drafter)
    sets = {"code": lambda: heldout_prompts(args.prompts, PROMPT_LEN, seed=0),
            "prose": lambda: prose_prompts(args.prompts)}
    report = {}
    for name in args.sets.split(","):
        table = measure(target, draft, sets[name](), args.budgets, args.new_tokens, args.repeats)
        fixed = {b: table[f"ddtree {b}"]["tokens_per_second"] for b in args.budgets}
        best = max(fixed, key=fixed.get)
        median = statistics.median(fixed.values())
        auto = table["ddtree auto"]["tokens_per_second"]
        report[name] = dict(table=table, best_fixed=best, auto_over_best=auto / fixed[best],
                            auto_over_median=auto / median)
        print(f"\n## {name} ({args.prompts} prompts x {args.new_tokens} new tokens, {args.repeats} repeats, "
              f"drafter {args.drafter})\n")
        print("| row | tokens/s | tau | mean tree nodes | equal to ar |\n|---|---|---|---|---|")
        for row, r in table.items():
            tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
            nodes = "" if r["mean_tree_nodes"] is None else f"{r['mean_tree_nodes']:.1f}"
            print(f"| {row} | {r['tokens_per_second']:.0f} | {tau} | {nodes} | {r['equal_to_ar']} |")
        print(f"\nbest fixed budget {best}; auto / best = {auto / fixed[best]:.3f}, "
              f"auto / median fixed = {auto / median:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
