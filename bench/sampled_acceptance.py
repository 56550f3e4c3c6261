"""Sampled tau of this package's DFlash chains against z-lab's ``dflash`` 0.1.0, per temperature and filter.

Run: ``python bench/sampled_acceptance.py [--json out.json] [--acceptance rejection|match]``
(the full grid of tests/fixtures/zlab_sampled/acceptance.json: both pairs' drafters, T in {0.3, 0.7, 1.0},
no filter and top-p 0.95 / top-k 20, its seeds and prompts; ``--dry-run``: one drafter, one configuration,
one seed, one prompt, a few tokens). ``--write-prompts DIR`` writes the prompts (8 held-out prompts of
128 bytes) that bench/zlab_sampled_reference.py reads.

Each pair of the fixture (the shipped tiny pair; tests/fixtures/zlab_dflash2's target and z-lab-made
drafters), fp32, runs through :func:`dflash.generate` (``method="dflash"``,
the default sampled rule, the target's eos as the stop token, ``max_new_tokens`` as the fixture's) on
every prompt once per seed (``seed = 1000 * seed + prompt index``, the key z-lab's side seeded its
global generator with; the two sides' noise is unrelated). Per configuration: ``tau_s`` = committed
tokens / rounds pooled over the prompts for seed ``s``; the table shows the mean of ``tau_s`` over the
seeds with its standard error, for both implementations, and their difference with the standard error
of the difference (independent runs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

import dflash_kernels
from dflash import DFlashDraftModel, generate
from dflash.tiny.pair import load_target

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "zlab_sampled"


def write_prompts(directory: Path, n: int = 8, prompt_len: int = 128) -> None:
    from dflash.tiny.corpus import heldout_prompts

    directory.mkdir(parents=True, exist_ok=True)
    prompts = heldout_prompts(n, prompt_len, seed=0)
    (directory / "prompts.json").write_text(json.dumps(dict(source=f"heldout_prompts({n}, {prompt_len}, seed=0)",
                                                            prompts=prompts)) + "\n")


def summary(taus):
    mean = sum(taus) / len(taus)
    var = sum((t - mean) ** 2 for t in taus) / max(len(taus) - 1, 1)
    return mean, math.sqrt(var / len(taus))


def measure(target, draft, prompts, seeds, temperature, filt, max_new_tokens, acceptance, eos):
    """Per seed: committed tokens, rounds and their ratio, pooled over the prompts."""
    committed, rounds = [], []
    for seed in seeds:
        c = n = 0
        for i, ids in enumerate(prompts):
            # every filter given, "none" as top_k=0 / top_p=1.0: transformers' global top_k=50 would otherwise
            # filter our side where z-lab's samples the plain softmax
            r = generate(target, draft, torch.tensor(ids, dtype=torch.long), method="dflash", do_sample=True,
                         temperature=temperature, max_new_tokens=max_new_tokens, seed=1000 * seed + i,
                         acceptance=acceptance, eos_token_id=eos, **filt)
            c += sum(r.acceptance_lengths)
            n += r.num_rounds
        committed.append(c)
        rounds.append(n)
    return dict(committed=committed, rounds=rounds, tau=[c / max(n, 1) for c, n in zip(committed, rounds)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", default=str(FIXTURE / "acceptance.json"), help="z-lab's fixture")
    p.add_argument("--acceptance", default=None, choices=["rejection", "match"],
                   help="our rule (default: the package's default for a sampled chain)")
    p.add_argument("--pairs", default=None, help="comma-separated subset of the fixture's pairs (tiny, zlab_fixture)")
    p.add_argument("--drafters", default=None, help="comma-separated subset of the fixture's drafters")
    p.add_argument("--temperatures", default=None, help="comma-separated subset of the fixture's temperatures")
    p.add_argument("--filters", default=None, help="comma-separated subset of the fixture's filters")
    p.add_argument("--seeds", type=int, default=None, help="the first N of the fixture's seeds")
    p.add_argument("--prompts", type=int, default=None, help="the first N of the fixture's prompts")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the fixture's")
    p.add_argument("--dry-run", action="store_true", help="one configuration, one seed, one prompt, 8 tokens")
    p.add_argument("--write-prompts", default=None, metavar="DIR", help="write DIR/prompts.json and exit")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.write_prompts:
        write_prompts(Path(args.write_prompts))
        return 0
    torch.set_num_threads(1)
    ref = json.loads(Path(args.reference).read_text())
    configs = list(ref["configs"].values())
    if args.dry_run:
        configs, args.seeds, args.prompts = configs[:1], 1, 1
        args.max_new_tokens = args.max_new_tokens or 8
    if args.pairs:
        configs = [c for c in configs if c["pair"] in args.pairs.split(",")]
    if args.drafters:
        configs = [c for c in configs if c["drafter"] in args.drafters.split(",")]
    if args.temperatures:
        configs = [c for c in configs if c["temperature"] in [float(t) for t in args.temperatures.split(",")]]
    if args.filters:
        configs = [c for c in configs if c["filter"] in args.filters.split(",")]
    seeds = ref["seeds"][: args.seeds]
    prompts = ref["prompts"][: args.prompts]
    max_new = args.max_new_tokens or ref["max_new_tokens"]
    targets, drafts, rows = {}, {}, []
    with dflash_kernels.force_backend("reference"):
        for c in configs:
            pair = ref["pairs"][c["pair"]]
            if c["pair"] not in targets:
                targets[c["pair"]] = load_target(str(ROOT / pair["target"]))
            target = targets[c["pair"]]
            key = (c["pair"], c["drafter"])
            if key not in drafts:
                drafts[key] = DFlashDraftModel.from_pretrained(str(ROOT / pair["drafter_dir"] / c["drafter"]),
                                                               target_config=target.config, dtype=torch.float32)
            m = measure(target, drafts[key], prompts, seeds, c["temperature"], ref["filters"][c["filter"]],
                        max_new, args.acceptance, ref["eos"])
            mean, se = summary(m["tau"])
            z = summary(c["tau"][: len(seeds)]) if len(seeds) > 1 else (c["tau"][0], 0.0)
            rows.append(dict(pair=c["pair"], drafter=c["drafter"], kind=c["kind"], temperature=c["temperature"], filter=c["filter"],
                             ours=m, tau=mean, se=se, zlab_tau=z[0], zlab_se=z[1]))
            print(f"{c['pair']}/{c['drafter']} T={c['temperature']} {c['filter']}: ours {mean:.3f} +- {se:.3f}, "
                  f"z-lab {z[0]:.3f} +- {z[1]:.3f}", file=sys.stderr, flush=True)
    print(f"{len(seeds)} seeds x {len(prompts)} prompts x {max_new} new tokens, fp32, "
          f"acceptance {args.acceptance or 'default'}; tau = mean over seeds +- standard error\n")
    print("| pair | drafter | T | filter | ours | z-lab | ours - z-lab |\n|---|---|---|---|---|---|---|")
    for r in rows:
        d = r["tau"] - r["zlab_tau"]
        print(f"| {r['pair']} | {r['drafter']} ({r['kind']}) | {r['temperature']} | {r['filter']} | {r['tau']:.3f} +- {r['se']:.3f} "
              f"| {r['zlab_tau']:.3f} +- {r['zlab_se']:.3f} | {d:+.3f} +- {math.hypot(r['se'], r['zlab_se']):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(vars(args), seeds=seeds, max_new_tokens=max_new, rows=rows),
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
