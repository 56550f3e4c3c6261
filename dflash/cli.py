"""Command line: ``python -m dflash {demo,generate,bench,train,train-target,convert} ...``.

``demo`` and ``generate`` live here; the other commands belong to their
modules (each exposes ``main(argv)``) and are dispatched by name.

A bad argument (a block size below 2, a tree budget below 1, a missing
directory, a drafter that does not fit the target, an unknown method, a
refused generate keyword) prints ONE line, ``python -m dflash <cmd>: error:
<what is wrong and what is allowed>``, and exits with status 2; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

from .decoding.options import ACCEPTANCE_RULES, DEFAULTS, METHODS

# command -> (module, one-line help); each module has main(argv) -> int
DELEGATED = {
    "bench": ("dflash.benchmark.run", "end-to-end benchmark: methods, budgets, temperatures, peers, plots"),
    "train": ("dflash.training.train", "train a DFlash drafter for a target"),
    "train-target": ("dflash.tiny.pretrain", "train the tiny byte-level target on the standard library"),
    "convert": ("dflash.drafter.convert", "convert a drafter checkpoint between the z-lab, transformers and speculators formats"),
}

METHOD_CHOICES = METHODS


class UsageError(Exception):
    """A bad command-line argument: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit status 2."""

    def error(self, message):
        raise UsageError(message)


def _number_at_least(kind, low, what: str):
    """An argparse type: ``kind(text)`` (int or float), at least ``low``; else a message ending in ``what``."""
    noun = "an int" if kind is int else "a number"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}; {what}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small; {what}")
        return value
    return parse


def _int_at_least(low: int, what: str):
    return _number_at_least(int, low, what)


def _float_at_least(low: float, what: str):
    return _number_at_least(float, low, what)


def _tree_budget(text: str):
    """``--tree-budget``: ``auto`` or an int >= 1."""
    if text == "auto":
        return "auto"
    return _int_at_least(1, "--tree-budget must be an int >= 1 (draft nodes per round) or 'auto'")(text)


DEMO_PROMPT = 'def parse_header(line):\n    """Split a "Key: value" header line."""\n'


def _load_pair(target_dir: Optional[str], draft_dir: Optional[str], dtype, drafter: Optional[str] = None):
    """(target, draft, tokenizer): from directories, else the embedded default pair (with the tiny ``drafter``:
    ``dflash`` or ``dflash2``)."""
    from .tiny.pair import load_default_pair, load_pair

    if drafter is not None and (target_dir is not None or draft_dir is not None):
        raise UsageError("--drafter picks an embedded tiny drafter: give it without --target / --draft")
    if target_dir is None and draft_dir is None:
        try:
            return load_default_pair(dtype=dtype, drafter=drafter or "dflash")
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
    if target_dir is None or draft_dir is None:
        raise UsageError("give both --target and --draft, or neither (the embedded default pair)")
    for flag, path, marker in (("--target", target_dir, "config.json"), ("--draft", draft_dir, "config.json")):
        if not os.path.isdir(path):
            raise UsageError(f"{flag} {path}: no such directory (a local model directory with {marker})")
        if not os.path.isfile(os.path.join(path, marker)):
            raise UsageError(f"{flag} {path}: not a model directory (no {marker} in it)")
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
    target, draft, tokenizer = _load_pair(args.target, args.draft, torch.float32, args.drafter)
    prompt = _encode(tokenizer, args.prompt)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0,
              stop_token_ids=[tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else None)
    tree = dict(tree_budget=args.tree_budget) if args.method == "ddtree" else {}
    generate(target, draft, prompt, method=args.method, max_new_tokens=8, **tree)  # warm-up
    baseline = generate(target, None, prompt, method="ar", **kw)
    result = generate(target, draft, prompt, method=args.method, **tree, **kw)
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


def _read_prompt(args) -> str:
    """The prompt: --prompt, else --prompt-file, else stdin (when it is not a terminal)."""
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        if not os.path.isfile(args.prompt_file):
            raise UsageError(f"--prompt-file {args.prompt_file}: no such file")
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    if sys.stdin is not None and not sys.stdin.isatty():
        text = sys.stdin.read()
        if text:
            return text
    raise UsageError("no prompt: give --prompt TEXT, --prompt-file FILE, or pipe the prompt on stdin")


def _chat_ids(tokenizer, text: str, chat: Optional[bool]):
    """Token ids of the prompt, through the tokenizer's chat template when it has one (``--chat`` / ``--no-chat``)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise UsageError("--chat: the target's tokenizer has no chat template (drop --chat for a raw prompt)")
    if has_template and chat is not False:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        import torch

        return torch.tensor([list(ids)], dtype=torch.long)
    return _encode(tokenizer, text)


def cmd_generate(args) -> int:
    """Stream the continuation of a prompt as text; statistics on stderr."""
    import torch

    from . import stream

    if args.acceptance is not None:
        from .decoding.options import check_acceptance

        check_acceptance(args.acceptance, args.method)  # before any model loads
    if args.draft_window is not None:
        from .decoding.options import check_draft_window

        check_draft_window(args.draft_window, args.method)  # before any model loads
    text = _read_prompt(args)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries only the statistics (or the one error line)
    target, draft, tokenizer = _load_pair(args.target, args.draft, getattr(torch, args.dtype), args.drafter)
    prompt = _chat_ids(tokenizer, text, args.chat)
    kw = dict(method=args.method, max_new_tokens=args.max_new_tokens, seed=args.seed)
    if args.temperature is not None:
        kw["temperature"] = args.temperature
    for name in ("do_sample", "top_k", "top_p", "min_p"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.method != "ar" and args.block_size is not None:
        kw["block_size"] = args.block_size
    if args.method == "ddtree" and args.tree_budget is not None:
        kw["tree_budget"] = args.tree_budget
    if args.method != "ar" and args.acceptance is not None:
        kw["acceptance"] = args.acceptance
    if args.draft_window is not None:
        kw["draft_window"] = args.draft_window  # with --method ar: refused by generate, naming the keyword
    if args.compile:
        kw["compile"] = True
    it = stream(target, draft if args.method != "ar" else None, prompt, tokenizer=tokenizer, **kw)
    for piece in it:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = it.result.summary()
    print(f"[{s['method']}] tau {s['tau']:.2f}, {s['tokens_per_second']:.1f} tokens/s, "
          f"ttft {s['time_to_first_token'] * 1e3:.1f} ms, tpot {s['time_per_output_token'] * 1e3:.2f} ms"
          + (f", compiled in {s['compile_time']:.1f} s (not in tokens/s)" if args.compile else ""),
          file=sys.stderr)
    return 0


def _add_pair_args(p: argparse.ArgumentParser, generate: bool = False) -> None:
    p.add_argument("--target", help="local HF target directory (default: the embedded tiny pair)")
    p.add_argument("--draft", help="local DFlash drafter directory (default: the embedded tiny pair)")
    p.add_argument("--drafter", choices=["dflash", "dflash2"], default=None,
                   help="which embedded tiny drafter pairs with the tiny target (default: dflash)")
    p.add_argument("--method", choices=METHOD_CHOICES, default=DEFAULTS.method)
    if generate:
        p.add_argument("--prompt", default=None, help="the prompt (default: --prompt-file, else stdin)")
        p.add_argument("--prompt-file", default=None, help="read the prompt from this file")
        p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                       help="wrap the prompt in the tokenizer's chat template (default: when it has one)")
    else:
        p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-new-tokens", type=_int_at_least(1, "--max-new-tokens must be >= 1"), default=256)
    p.add_argument("--temperature", type=_float_at_least(0.0, "--temperature must be >= 0 (0 = greedy)"),
                   default=None if generate else 0.0)
    p.add_argument("--tree-budget", type=_tree_budget, default=DEFAULTS.tree_budget,
                   help="DDTree draft nodes per round, or 'auto' (chosen each round from measured costs)")
    p.add_argument("--threads", type=_int_at_least(1, "--threads must be >= 1"), default=1,
                   help="torch CPU threads (default 1: small models decode fastest single-threaded)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m dflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="generate with the embedded default pair and show tau and speedup")
    _add_pair_args(demo)
    gen = sub.add_parser("generate", help="generate text with a target and a drafter (streamed)")
    _add_pair_args(gen, generate=True)
    gen.add_argument("--block-size", type=_int_at_least(2, "--block-size must be >= 2 (anchor + at least one "
                                                           "draft)"), default=DEFAULTS.block_size)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                     help="sample (default: the target's generation_config; --temperature > 0 alone samples)")
    gen.add_argument("--top-k", type=_int_at_least(0, "--top-k must be >= 0 (0 = off)"), default=None)
    gen.add_argument("--top-p", type=_float_at_least(0.0, "--top-p must be in [0, 1]"), default=None)
    gen.add_argument("--min-p", type=_float_at_least(0.0, "--min-p must be in [0, 1]"), default=None)
    gen.add_argument("--acceptance", choices=ACCEPTANCE_RULES, default=DEFAULTS.acceptance,
                     help="how a sampled DFlash chain accepts drafts: rejection (default: drafts sampled from the "
                          "drafter, kept with probability min(1, p/q)) or match (argmax drafts kept while they "
                          "equal the target's sample); ddtree walks its tree (match only)")
    gen.add_argument("--draft-window", type=_int_at_least(1, "--draft-window must be an int >= 1 (the drafter "
                                                            "attends only to the last W context rows before its "
                                                            "block); leave it out for no window"), default=DEFAULTS.draft_window,
                     metavar="W", help="the drafter attends only to the last W context rows before its block "
                                       "(dflash / ddtree; the output is unchanged, only acceptance; default: off)")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    gen.add_argument("--compile", action="store_true",
                     help="compiled fixed-shape rounds (torch.compile; CUDA graphs on a GPU), set up before the "
                          "clock starts")
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _target_structure_error():
    from .target import TargetStructureError

    return TargetStructureError


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


def main(argv: Optional[List[str]] = None) -> int:
    """Run a command; returns its exit status (2 for a bad argument, with one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    debug = "--debug" in argv
    command = argv[0] if argv and not argv[0].startswith("-") else None
    prog = "python -m dflash" + (f" {command}" if command in ("demo", "generate") else "")
    try:
        args = build_parser().parse_args(argv)
        return {"demo": cmd_demo, "generate": cmd_generate}[args.command](args)
    except UsageError as exc:
        if debug:
            raise
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (ValueError, NotImplementedError, OSError, _target_structure_error()) as exc:
        # DraftConfigError, UnsupportedGeneration and the loops' argument checks are ValueErrors
        if debug:
            raise
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
