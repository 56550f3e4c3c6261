"""``python -m dflash bench``'s command line: the parser and its list arguments."""

from __future__ import annotations

import argparse
from typing import List

from .configs import ALL_METHODS

#: the parser's description (the first line of :mod:`dflash.benchmark.run`'s docstring)
DESCRIPTION = "End-to-end benchmark: ``python -m dflash bench``."


def _budget_list(text: str) -> list:
    """``--budgets``: comma-separated ints >= 1 and ``auto``."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if "auto" in items:
        rest = ",".join(x for x in items if x != "auto")
        return (int_list(rest) if rest else []) + ["auto"]
    return int_list(text)


def int_list(text: str) -> List[int]:
    """argparse type: comma-separated ints >= 1 (errors name the text)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _float_list(text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {text!r}")
    return list(dict.fromkeys(values))


def _method_list(text: str) -> List[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [v for v in values if v not in ALL_METHODS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown or text!r}; allowed: {', '.join(ALL_METHODS)}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Methods: " + ", ".join(ALL_METHODS))
    p.add_argument("--target", help="local HF target directory (default: the embedded tiny pair)")
    p.add_argument("--draft", help="local DFlash drafter directory (default: the embedded tiny pair)")
    p.add_argument("--prompts", help='JSONL file: one {"prompt": "..."} or {"input_ids": [...]} per line '
                                     "(default: held-out standard-library code)")
    p.add_argument("--num-prompts", type=int, default=8, help="number of prompts (the first N of --prompts)")
    p.add_argument("--prompt-len", type=int, default=128, help="bytes per built-in prompt")
    p.add_argument("--methods", type=_method_list, default=list(ALL_METHODS),
                   help="comma-separated, default: all (ar always runs: it is the baseline)")
    p.add_argument("--budgets", type=_budget_list, default=[4, 16, 64],
                   help="DDTree node budgets (ints, and 'auto': chosen each round)")
    p.add_argument("--temperatures", type=_float_list, default=[0.0, 0.7])
    p.add_argument("--block-sizes", type=int_list, default=None, help="drafter block sizes (default: the drafter's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the warm-up generation per configuration")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-text tokens")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: small models decode fastest single-threaded)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i")
    p.add_argument("--out", default="runs/bench", help="directory for results.json, results.md and the plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--batch-sizes", type=int_list, default=None,
                   help="measure padded batches instead (dflash/benchmark/batch.py): e.g. 1,4,16; ours batched, the "
                        "same method row by row, and transformers' generate at each size")
    p.add_argument("--compile", action="store_true",
                   help="run ar / dflash / ddtree as compiled rounds (generate(compile=True)); the compile happens "
                        "in the warm-up and is never timed")
    return p
