"""Eager vs compiled rounds (torch.compile + CUDA graphs) at Qwen3-8B shapes: one draft and one verify round,
and end-to-end tokens/s.

Run on a GPU machine: ``python bench/gpu_compiled_round.py [--layers 8] [--prompt-len 512]``.
On a CPU (tests): ``python bench/gpu_compiled_round.py --device cpu --tiny --mode static`` (a
small fp32 model; ``--mode static`` runs the fixed-shape steps eagerly instead of compiling:
a check of the script, not of speed).

The target is a ``Qwen3ForCausalLM`` with random bf16 weights at Qwen3-8B shapes (hidden 4096,
32/8 heads, head dim 128, MLP 12288, vocab 151936) cut to ``--layers`` decoder layers (the
per-layer launch overhead the graphs remove scales with the layer count; 8 keeps the compile
inside the check's budget); a 2-layer random drafter reads 3 of its layers. For each method
(DFlash block 16, DDTree budget 32) the same prompt is generated eagerly and compiled
(``generate(compile=True)``: the compile and the graph capture happen before the clock starts
and are reported as ``setup s``), ``--repeats`` times each, interleaved. Per-round draft and
verify times come from the loops' CUDA-event stage clock (``result.draft_time / rounds``);
tokens/s from the wall clock. With random weights acceptance is ~1 token per round for both
paths, so the round times compare like for like. The greedy tokens of the two paths must be
equal (exit status 1 otherwise).
JSON goes to ``--json``, else ``$OUT/gpu_compiled_round.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_round_latency import QWEN3_8B, TINY, build_target  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small fp32 model (CPU test of this script)")
    p.add_argument("--layers", type=int, default=None, help="target decoder layers (default 8; tiny 4)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; tiny 24)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64; tiny 12")
    p.add_argument("--block", type=int, default=None, help="DFlash block size (default 16; tiny 4)")
    p.add_argument("--budget", type=int, default=None, help="DDTree budget (default 32; tiny 6)")
    p.add_argument("--repeats", type=int, default=None, help="generations per path (default 3; tiny 1)")
    p.add_argument("--mode", choices=["compile", "static"], default="compile",
                   help="compile: torch.compile + CUDA graphs (the measurement); static: the fixed-shape steps "
                        "eagerly (a fast script check)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    defaults = dict(layers=4 if args.tiny else 8, prompt_len=24 if args.tiny else 512,
                    max_new_tokens=12 if args.tiny else 64, block=4 if args.tiny else 16,
                    budget=6 if args.tiny else 32, repeats=1 if args.tiny else 3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def build_pair(args, device):
    import dflash

    shape = TINY if args.tiny else QWEN3_8B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target = build_target(shape, args.layers, dtype, device)
    target.generation_config.eos_token_id = None
    L = args.layers
    ids = sorted({1, L // 2, L - 1}) if L >= 3 else list(range(L))
    cfg = dflash.make_draft_config(
        hidden_size=shape["hidden_size"], num_hidden_layers=2, num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], intermediate_size=shape["intermediate_size"],
        vocab_size=shape["vocab_size"], num_target_layers=L, block_size=args.block,
        mask_token_id=shape["vocab_size"] - 1, target_layer_ids=ids, max_position_embeddings=32768)
    torch.manual_seed(1)
    draft = dflash.DFlashDraftModel(cfg).to(device=device, dtype=dtype).eval()
    return target, draft


def main(argv=None) -> int:
    import dflash

    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_compiled_round: no CUDA device", file=sys.stderr)
        return 2
    target, draft = build_pair(args, device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size - 1, (args.prompt_len,), generator=g)
    mode = True if args.mode == "compile" else "static"
    methods = [("ar", {}), ("dflash", dict(block_size=args.block)),
               ("ddtree", dict(block_size=args.block, tree_budget=args.budget))]
    rows, ok = [], True
    for method, extra in methods:
        kw = dict(method=method, max_new_tokens=args.max_new_tokens, **extra)
        d = draft if method != "ar" else None
        dflash.generate(target, d, prompt, max_new_tokens=4, **{k: v for k, v in kw.items() if k != "max_new_tokens"})
        t0 = time.perf_counter()
        first = dflash.generate(target, d, prompt, compile=mode, **kw)  # compiles + captures (setup, untimed)
        setup_s = first.compile_time
        first_call_s = time.perf_counter() - t0
        runs = {False: [], True: []}
        for _ in range(args.repeats):
            for m in (False, mode):
                runs[bool(m)].append(dflash.generate(target, d, prompt, compile=m, **kw))
        same = all(torch.equal(a.output_ids, b.output_ids) for a, b in zip(runs[False], runs[True]))
        ok &= same
        row = dict(method=method, setup_s=setup_s, first_call_s=first_call_s, same_tokens=same)
        for name, rs in (("eager", runs[False]), ("compiled", runs[True])):
            rounds = statistics.mean(r.num_rounds for r in rs)
            row[f"{name}_tokens_per_s"] = statistics.median(r.tokens_per_second for r in rs)
            row[f"{name}_draft_ms"] = statistics.median(r.draft_time / max(1, r.num_rounds) for r in rs) * 1e3
            row[f"{name}_verify_ms"] = statistics.median(r.verify_time / max(1, r.num_rounds) for r in rs) * 1e3
            row[f"{name}_tau"] = statistics.mean(r.tau for r in rs)
            row[f"{name}_rounds"] = rounds
        rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_compiled_round: {name}, {'tiny' if args.tiny else 'Qwen3-8B'} shapes, {args.layers} layers, "
          f"prompt {args.prompt_len}, {args.max_new_tokens} new tokens, mode {args.mode}")
    print("| method | draft ms eager | draft ms graph | verify ms eager | verify ms graph | tok/s eager | "
          "tok/s graph | ratio | setup s | same |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['eager_draft_ms']:.2f} | {r['compiled_draft_ms']:.2f} | {r['eager_verify_ms']:.2f} "
              f"| {r['compiled_verify_ms']:.2f} | {r['eager_tokens_per_s']:.1f} | {r['compiled_tokens_per_s']:.1f} | "
              f"{r['compiled_tokens_per_s'] / r['eager_tokens_per_s']:.2f}x | {r['setup_s']:.1f} | "
              f"{'yes' if r['same_tokens'] else 'NO'} |")
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_compiled_round.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(dict(device=name, args=vars(args), rows=rows), f, indent=2)
    if not ok:
        print("gpu_compiled_round: FAIL: compiled tokens differ from eager tokens", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
