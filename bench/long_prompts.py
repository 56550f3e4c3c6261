"""Long prompts: ours against transformers' own ``generate()`` at 2k to 32k-token prompts.

    python bench/long_prompts.py [--lengths 2048,8192,16384,32768] [--new-tokens 64] [--reps 2]
                                 [--shape tiny|qwen3-8b] [--layers N] [--device cpu|cuda] [--dtype float32|bfloat16]
                                 [--memory-lengths all|none|N,..] [--json out.json] [--dry-run]

A random target at ``--shape`` (``tiny``: Qwen3, 4 layers, 64 wide, 4 query / 2 K/V heads of 16, vocab 1024;
``qwen3-8b``: Qwen3-8B's widths, ``--layers`` of them), ``max_position_embeddings`` 65536, and a random
one-layer DFlash drafter (block 16); random prompt ids. At each length, taking turns (each implementation runs
once per repetition, the order rotating; the minimum over ``--reps`` is kept):

* ``hf``: ``target.generate(do_sample=False)`` for 1 new token (its time is the time to first token) and for
  ``1 + --new-tokens`` (the difference over ``--new-tokens`` is its time per token: one decode step);
* ``ar``: ``dflash.generate(method="ar")``, the same two calls (our prefill, then one target pass per token);
* ``dflash`` and ``ddtree``: ``1 + --new-tokens`` tokens; their round time is the decode time over the rounds
  (``result.total_time - result.time_to_first_token``, over ``len(result.acceptance_lengths)``).

Peak memory: in a fresh process per implementation and length (``--memory-lengths``; by default every length
on the CPU, the longest on CUDA), after one 64-token warm-up generation, the growth of the peak RSS (CPU) or of
``torch.cuda.max_memory_allocated`` (CUDA) over one generation of ``1 + --new-tokens`` tokens: activations,
caches and whatever the call allocates and holds. ``ar``, ``dflash`` and ``ddtree`` must give ``hf``'s tokens
(the table says ``equal``).

Printed: a markdown table per length (time to first token, time per token, each method's round time, peak memory,
the ratios ours / transformers'), and how each time grew from the first length (a round's growth against
transformers' decode step's). ``--dry-run``: 64 and 128-token prompts, 4 new tokens, one repetition, fp32 on the
CPU, the memory of the 128-token prompt in one process as on CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import add_dry_run, apply_dry_run, default_json, write_json  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
}
IMPLEMENTATIONS = ("hf", "ar", "dflash", "ddtree")


def build_pair(shape: str, layers, device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash import DFlashDraftModel, make_draft_config

    dims = dict(SHAPES[shape])
    if layers:
        dims["num_hidden_layers"] = layers
    torch.manual_seed(0)
    config = Qwen3Config(max_position_embeddings=65536, tie_word_embeddings=False, **dims)
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(dtype).eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    draft_config = make_draft_config(
        hidden_size=dims["hidden_size"], num_hidden_layers=1, num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_key_value_heads"], head_dim=dims["head_dim"],
        intermediate_size=dims["intermediate_size"], vocab_size=dims["vocab_size"],
        num_target_layers=dims["num_hidden_layers"], block_size=16, mask_token_id=dims["vocab_size"] - 1,
        max_position_embeddings=65536)
    with torch.device(device):
        draft = DFlashDraftModel(draft_config).to(dtype).eval()
    return target, draft


class Stamps:
    """A generate() streamer that keeps the time of each ``put`` after the prompt's: ``times[0]`` is the first
    new token's, then one per decode step (transformers, ``ar``) or per round (``dflash``, ``ddtree``)."""

    def __init__(self, device):
        self.device, self.times, self.prompt_seen = device, [], False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_once(name, target, draft, ids, new_tokens, device):
    """One timed generation of ``1 + new_tokens`` tokens: ``{ttft, step, tokens}``; ``step`` is the mean time
    between the streamer's calls after the first token (a decode step, or a round)."""
    import dflash

    stamps = Stamps(device)
    kw = dict(max_new_tokens=1 + new_tokens, do_sample=False, streamer=stamps,
              attention_mask=torch.ones_like(ids))  # no padding: transformers must not infer a mask from pad ids
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    if name == "hf":
        out = target.generate(ids, **kw)
    else:
        out = dflash.generate(target, None if name == "ar" else draft, ids, method=name, **kw).output_ids
    times = stamps.times
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return dict(ttft=times[0] - start, step=step, tokens=out[0, ids.shape[1]:].tolist())


def peak_memory(name, target, draft, ids, new_tokens, device):
    """MiB the peak memory grew by over one generation (:class:`~dflash.benchmark.memory.PeakGrowth`: peak RSS on
    the CPU, max allocated on CUDA), in a process that has run nothing longer: :func:`main` runs it in a fresh
    process per implementation and length (``--memory-of``)."""
    from dflash.benchmark.memory import PeakGrowth

    with PeakGrowth(device) as growth:
        run_once(name, target, draft, ids, new_tokens, device)
    return growth.mib


def prompt_ids(length: int, vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(length)
    return torch.randint(1, vocab - 1, (1, length), generator=g).to(device)  # no pad (0), no mask id (vocab - 1)


def measure(target, draft, lengths, new_tokens, reps, device, implementations=IMPLEMENTATIONS):
    """``{length: {implementation: {ttft, step, equal}}}``, each the minimum over ``reps``, the implementations
    taking turns (the order rotates by one each repetition)."""
    vocab = target.config.vocab_size
    for name in implementations:  # set-up and first-call costs out of the clock (a 64-token prompt)
        run_once(name, target, draft, prompt_ids(64, vocab, device), 2, device)
    results = {}
    for length in lengths:
        ids = prompt_ids(length, vocab, device)
        best = {}
        for rep in range(reps):
            k = rep % len(implementations)
            for name in implementations[k:] + implementations[:k]:
                rec = run_once(name, target, draft, ids, new_tokens, device)
                old = best.setdefault(name, rec)
                for key in ("ttft", "step"):
                    if rec[key] is not None and (old[key] is None or rec[key] < old[key]):
                        old[key] = rec[key]
        for name in implementations:
            best[name]["equal"] = best[name]["tokens"] == best["hf"]["tokens"]
        for name in implementations:
            del best[name]["tokens"]
        results[length] = best
        print(f"measured {length}-token prompts", flush=True)
    return results


def _ms(x):
    return "-" if x is None else f"{1e3 * x:.1f}"


def _mib(x):
    return "-" if x is None else f"{x:.0f}"


def table(results) -> str:
    lines = [
        "| prompt | time to first token, ours / transformers (ratio) | time per token, `ar` / transformers (ratio) "
        "| `dflash` round | `ddtree` round | peak memory MiB, `ar` / `dflash` / `ddtree` / transformers | equal |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for length, r in results.items():
        hf, ar = r["hf"], r["ar"]
        equal = all(rec["equal"] for rec in r.values())
        lines.append(
            f"| {length} | {_ms(ar['ttft'])} / {_ms(hf['ttft'])} ms ({ar['ttft'] / hf['ttft']:.2f}x) "
            f"| {_ms(ar['step'])} / {_ms(hf['step'])} ms ({ar['step'] / hf['step']:.2f}x) "
            f"| {_ms(r['dflash']['step'])} ms | {_ms(r['ddtree']['step'])} ms "
            f"| {' / '.join(_mib(r[name].get('memory_mib')) for name in ('ar', 'dflash', 'ddtree', 'hf'))} "
            f"| {'yes' if equal else 'NO'} |")
    first = next(iter(results))
    lines += ["", f"Growth from the {first}-token prompt (time at this length / time at {first}):", "",
              "| prompt | transformers' decode step | `ar` step | `dflash` round | `ddtree` round |",
              "| --- | --- | --- | --- | --- |"]
    for length, r in results.items():
        cells = [f"{r[name]['step'] / results[first][name]['step']:.2f}x" for name in IMPLEMENTATIONS]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_in_subprocesses(args, lengths, device) -> dict:
    """``{length: {implementation: MiB}}``: :func:`peak_memory` of each implementation at each length, in fresh
    processes: one per implementation and length on the CPU (a process's RSS keeps what its allocator kept),
    one per length on CUDA (max allocated counts only live tensors: each implementation's growth is its own)."""
    import json
    import subprocess

    per_length = device.type != "cpu" or args.dry_run  # a dry run groups as the CUDA run it stands for
    groups = [list(IMPLEMENTATIONS)] if per_length else [[name] for name in IMPLEMENTATIONS]
    out = {}
    for length in lengths:
        for names in groups:
            cmd = [sys.executable, os.path.abspath(__file__), "--memory-of", ",".join(names), "--lengths",
                   str(length), "--new-tokens", str(args.new_tokens), "--shape", args.shape, "--device",
                   args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
            if args.layers:
                cmd += ["--layers", str(args.layers)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"the memory process {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
            out.setdefault(length, {}).update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,8192,16384,32768")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory-lengths", default=None,
                        help="lengths whose peak memory is measured, a fresh process per implementation and length "
                             "(default: every length on the CPU, the longest on CUDA; 'none': skip)")
    parser.add_argument("--memory-of", default=None,
                        help="(internal) print the peak memory of one generation of each of these implementations "
                             "(a comma list) at the one length given, as JSON")
    parser.add_argument("--json", default=None)
    add_dry_run(parser)
    args = parser.parse_args(argv)
    apply_dry_run(args, "long_prompts", lengths="64,128", new_tokens=4, reps=1, shape="tiny", layers=None,
                  dtype="float32", memory_lengths="128")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    lengths = [int(x) for x in str(args.lengths).split(",")]
    if min(lengths) < 2 or args.new_tokens < 1 or args.reps < 1:
        parser.error("--lengths must be >= 2 tokens each, --new-tokens and --reps >= 1")
    target, draft = build_pair(args.shape, args.layers, device, getattr(torch, args.dtype))
    if args.memory_of:
        import json

        names = args.memory_of.split(",")
        if not set(names) <= set(IMPLEMENTATIONS):
            parser.error(f"--memory-of takes {', '.join(IMPLEMENTATIONS)}, got {args.memory_of}")
        vocab = target.config.vocab_size
        report = {}
        for name in names:
            run_once(name, target, draft, prompt_ids(64, vocab, device), 2, device)
            report[name] = peak_memory(name, target, draft, prompt_ids(lengths[0], vocab, device), args.new_tokens,
                                       device)
        print(json.dumps(report))
        return 0
    results = measure(target, draft, lengths, args.new_tokens, args.reps, device)
    memory_lengths = args.memory_lengths or ("all" if device.type == "cpu" else str(max(lengths)))
    if memory_lengths != "none":
        chosen = lengths if memory_lengths == "all" else [int(x) for x in memory_lengths.split(",")]
        for length, by_name in memory_in_subprocesses(args, chosen, device).items():
            for name, mib in by_name.items():
                results.setdefault(length, {}).setdefault(name, {})["memory_mib"] = mib
    print(table(results))
    write_json(default_json(args.json, "long_prompts.json"),
               dict(device=str(device), shape=args.shape, dtype=args.dtype, new_tokens=args.new_tokens,
                    results={str(k): v for k, v in results.items()}))
    bad = [length for length, r in results.items() if not all(rec["equal"] for rec in r.values())]
    if bad:
        print(f"long_prompts: a method's tokens differ from transformers' at {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
