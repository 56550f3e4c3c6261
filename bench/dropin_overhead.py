"""The drop-in's cost: ``target.generate`` after ``dflash.apply`` against a direct ``dflash.generate``, interleaved.

    python bench/dropin_overhead.py [--method ddtree] [--repeats 7] [--max-new-tokens 128]

Both run the same loop on the embedded tiny pair (fp32, one thread, T = 0) with the same prompts; the
script alternates them per repeat and prints the median tokens/s of each and their ratio (1.00x means the
drop-in adds nothing measurable), and checks that both give the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="ddtree", choices=["dflash", "ddtree"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import dflash
    from dflash.tiny.corpus import heldout_prompts
    from dflash.tiny.pair import load_default_pair

    target, draft, tok = load_default_pair()
    prompts = [torch.tensor([p]) for p in heldout_prompts(4, 128, seed=0)]
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    extra = {"tree_budget": 8} if args.method == "ddtree" else {}
    direct, dropin = [], []
    with torch.inference_mode():
        for prompt in prompts[:1]:  # warm-up
            dflash.generate(target, draft, prompt, method=args.method, **kw, **extra)
        for _ in range(args.repeats):
            t, n = time.perf_counter(), 0
            outs_a = []
            for prompt in prompts:
                out = dflash.generate(target, draft, prompt, method=args.method, **kw, **extra).output_ids
                outs_a.append(out)
                n += out.shape[1] - prompt.shape[1]
            direct.append(n / (time.perf_counter() - t))
            with dflash.apply(target, draft, method=args.method, **extra):
                t, n = time.perf_counter(), 0
                outs_b = []
                for prompt in prompts:
                    out = target.generate(input_ids=prompt, **kw)
                    outs_b.append(out)
                    n += out.shape[1] - prompt.shape[1]
                dropin.append(n / (time.perf_counter() - t))
            if not all(torch.equal(a, b) for a, b in zip(outs_a, outs_b)):
                print("FAILED: the drop-in's tokens differ from the direct call's", file=sys.stderr)
                return 1
    a, b = statistics.median(direct), statistics.median(dropin)
    print(f"{args.method}: direct dflash.generate {a:.1f} tok/s, apply-ed target.generate {b:.1f} tok/s, "
          f"ratio {b / a:.3f}x (medians of {args.repeats} interleaved repeats, 4 prompts each, same tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
