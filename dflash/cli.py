"""Command line: ``python -m dflash {demo,generate,bench,train,train-target} ...``.

``demo`` and ``generate`` live here; the other commands belong to their
modules (each exposes ``main(argv)``) and are dispatched by name.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import List, Optional

# command -> (module, one-line help); each module has main(argv) -> int
DELEGATED = {
    "bench": ("dflash.benchmark.run", "end-to-end benchmark: methods, budgets, temperatures, peers, plots"),
    "train": ("dflash.training.train", "train a DFlash drafter for a target"),
    "train-target": ("dflash.tiny.pretrain", "train the tiny byte-level target on the standard library"),
}

DEMO_PROMPT = 'def parse_header(line):\n    """Split a "Key: value" header line."""\n'


def _load_pair(target_dir: Optional[str], draft_dir: Optional[str], dtype):
    """(target, draft, tokenizer): from directories, else the embedded default pair."""
    from .tiny.pair import load_default_pair, load_pair

    if target_dir is None and draft_dir is None:
        return load_default_pair(dtype=dtype)
    if target_dir is None or draft_dir is None:
        raise SystemExit("give both --target and --draft, or neither (the embedded default pair)")
    return load_pair(target_dir, draft_dir, dtype=dtype)


def _encode(tokenizer, text: str):
    import torch

    ids = tokenizer.encode(text)
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


def cmd_demo(args) -> int:
    """Generate from a code prompt with the default pair; print text, tau, tokens/s and speedup."""
    import torch

    from . import generate

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = _load_pair(args.target, args.draft, torch.float32)
    prompt = _encode(tokenizer, args.prompt)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0,
              stop_token_ids=[tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else None)
    generate(target, draft, prompt, method=args.method, max_new_tokens=8, tree_budget=args.tree_budget)  # warm-up
    baseline = generate(target, None, prompt, method="ar", **kw)
    result = generate(target, draft, prompt, method=args.method, tree_budget=args.tree_budget, **kw)
    same = torch.equal(result.output_ids, baseline.output_ids)
    text = tokenizer.decode(result.generated_ids[0].tolist())
    print("=" * 72)
    print(args.prompt + text)
    print("=" * 72)
    name = args.method + (f" (tree budget {args.tree_budget})" if args.method == "ddtree" else "")
    print(f"method            {name}, temperature {args.temperature}")
    print(f"new tokens        {result.num_new_tokens} in {result.num_rounds} rounds")
    print(f"tau               {result.tau:.2f} tokens per round")
    print(f"tokens/s          {result.tokens_per_second:.1f} (plain decoding: {baseline.tokens_per_second:.1f})")
    print(f"speedup           {baseline.total_time / result.total_time:.2f}x over plain decoding")
    if args.temperature == 0:
        print(f"lossless          {'yes: identical to plain greedy decoding' if same else 'NO: outputs differ'}")
        return 0 if same else 1
    return 0


def cmd_generate(args) -> int:
    import torch

    from . import generate

    torch.set_num_threads(args.threads)
    target, draft, tokenizer = _load_pair(args.target, args.draft, getattr(torch, args.dtype))
    prompt = _encode(tokenizer, args.prompt)
    result = generate(target, draft, prompt, method=args.method, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, seed=args.seed, tree_budget=args.tree_budget,
                      block_size=args.block_size)
    print(tokenizer.decode(result.generated_ids[0].tolist()))
    s = result.summary()
    print(f"[{s['method']}] tau {s['tau']:.2f}, {s['tokens_per_second']:.1f} tokens/s, "
          f"ttft {s['time_to_first_token'] * 1e3:.1f} ms, tpot {s['time_per_output_token'] * 1e3:.2f} ms",
          file=sys.stderr)
    return 0


def _add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="local HF target directory (default: the embedded tiny pair)")
    p.add_argument("--draft", help="local DFlash drafter directory (default: the embedded tiny pair)")
    p.add_argument("--method", choices=["ar", "dflash", "ddtree"], default="dflash")
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tree-budget", type=int, default=None)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: small models decode fastest single-threaded)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate with the embedded default pair and show tau and speedup")
    _add_pair_args(demo)
    gen = sub.add_parser("generate", help="generate text with a target and a drafter")
    _add_pair_args(gen)
    gen.add_argument("--block-size", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return {"demo": cmd_demo, "generate": cmd_generate}[args.command](args)
