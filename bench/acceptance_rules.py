"""Sampled tau of the two lossless acceptance rules for chains, side by side on the tiny pair.

Run: ``python bench/acceptance_rules.py [--temperature 0.7] [--num-prompts 8] [--max-new-tokens 128]``

Rules (SPEC: sampling): ``match`` drafts at the drafter's choice (DFlash: its argmax; DFlash2: the
selector's draw) and accepts while the draft equals the target's sample; ``rejection`` samples each draft
from the drafter's processed distribution ``q`` and accepts it with probability ``min(1, p(x)/q(x))``,
resampling the first rejection from ``max(p - q, 0)``. Both give exactly the target's sampling
distribution; they differ in how many tokens a round commits. Every row uses the same prompts and seeds
(prompt ``i``: seed ``i``), the tiny target and each shipped drafter, in one process; tau = committed
tokens / rounds, pooled over the prompts.
"""

import argparse
import json
from pathlib import Path

import torch

import dflash_kernels
from dflash import DFlashDraftModel, generate
from dflash.tiny.corpus import heldout_prompts
from dflash.tiny.pair import load_target

ASSETS = Path(__file__).resolve().parents[1] / "dflash" / "assets" / "tiny"


def pooled_tau(target, draft, prompts, temperature, acceptance, max_new_tokens):
    committed = rounds = 0
    for i, p in enumerate(prompts):
        r = generate(target, draft, torch.tensor(p, dtype=torch.long), method="dflash", temperature=temperature,
                     max_new_tokens=max_new_tokens, seed=i, acceptance=acceptance)
        committed += sum(r.acceptance_lengths)
        rounds += r.num_rounds
    return committed / max(rounds, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafters", default="drafter,drafter2", help="shipped drafter directories, comma-separated")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target = load_target(str(ASSETS / "target"))
    prompts = heldout_prompts(args.num_prompts, args.prompt_len, seed=0)
    rows = []
    with dflash_kernels.force_backend("reference"):
        for name in args.drafters.split(","):
            path = ASSETS / name
            if not path.exists():
                print(f"{name}: not shipped in this checkout, skipped")
                continue
            draft = DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32)
            kind = type(draft).__name__
            taus = {rule: pooled_tau(target, draft, prompts, args.temperature, rule, args.max_new_tokens)
                    for rule in ("match", "rejection")}
            rows.append(dict(drafter=name, kind=kind, **taus))
    print(f"T={args.temperature}, {args.num_prompts} prompts x {args.max_new_tokens} new tokens")
    print("| drafter | class | tau, match | tau, rejection | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['kind']} | {r['match']:.3f} | {r['rejection']:.3f} | "
              f"{r['rejection'] / r['match']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(vars(args), rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
