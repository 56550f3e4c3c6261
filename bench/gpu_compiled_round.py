"""Eager vs compiled rounds (torch.compile + CUDA graphs) at Qwen3-8B shapes: one draft and one verify round,
and end-to-end tokens/s.

Run on a GPU machine: ``python bench/gpu_compiled_round.py [--layers 4] [--prompt-len 256]``.
On a CPU (tests): ``python bench/gpu_compiled_round.py --device cpu --tiny --mode static`` (a
small fp32 model; ``--mode static`` runs the fixed-shape steps eagerly instead of compiling:
a check of the script, not of speed), or ``--dry-run`` (the same, naming what it leaves out,
plus a check of the divergence report on a copy of an output with one token changed).

The target is a ``Qwen3ForCausalLM`` with random bf16 weights at Qwen3-8B shapes (hidden 4096,
32/8 heads, head dim 128, MLP 12288, vocab 151936) cut to ``--layers`` decoder layers (the
per-layer launch overhead the graphs remove scales with the layer count; bench/gpu_check.sh
uses 4 to keep the compiles inside its budget); a 2-layer random drafter reads up to 3 of its
layers. For each method (DFlash block 16, DDTree budget 32) the same prompt is generated
eagerly and compiled (``generate(compile=True)``: the compile and the graph capture happen
before the clock starts and are reported as ``setup s``), ``--repeats`` times each, interleaved.
Per-round draft and verify times come from the loops' CUDA-event stage clock
(``result.draft_time / rounds``); tokens/s from the wall clock. With random weights acceptance
is ~1 token per round for both paths, so the round times compare like for like.

Tokens (exit status 1 when a check fails):

* float32: the compiled greedy tokens must equal the eager ones exactly;
* bfloat16 / float16: inductor fuses ops and rounds intermediate results differently from the
  eager kernels, and the compiled attention may split its keys differently, so at a near-tie
  of two logits the two paths may pick different tokens. A divergence is accepted only at a
  near-tie: at the first differing position the target's own logits (``dflash.decoding.parity
  .first_divergence``, one plain forward of the common prefix) must have a top-1 minus top-2
  margin, and both paths' tokens a gap below the top-1, of at most ``--near-tie-ulps`` (default
  4) units in the last place of the dtype at the largest logit's magnitude
  (``eps * 2**floor(log2(max |logit|))``; for bf16 ``eps = 2**-7``). Every divergence is
  reported in the JSON (index, both tokens, the margins, the threshold).

JSON goes to ``--json``, else ``$OUT/gpu_compiled_round.json`` when ``OUT`` is set; it is
rewritten after each method, so a run cut short keeps the methods that finished.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import add_dry_run, apply_dry_run, default_json, fail_without_cuda, skipped, write_json  # noqa: E402
from gpu_round_latency import QWEN3_8B, TINY, build_target  # noqa: E402

PROG = "gpu_compiled_round"
NEAR_TIE_ULPS = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small fp32 model (CPU test of this script)")
    p.add_argument("--layers", type=int, default=None, help="target decoder layers (default 4; tiny 4)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 256; tiny 24)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 32; tiny 12")
    p.add_argument("--block", type=int, default=None, help="DFlash block size (default 16; tiny 4)")
    p.add_argument("--budget", type=int, default=None, help="DDTree budget (default 32; tiny 6)")
    p.add_argument("--repeats", type=int, default=None, help="generations per path (default 2; tiny 1)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default bfloat16; tiny float32 (where the tokens must be equal)")
    p.add_argument("--near-tie-ulps", type=float, default=NEAR_TIE_ULPS,
                   help="a divergence is a near-tie within this many units in the last place (16-bit dtypes)")
    p.add_argument("--mode", choices=["compile", "static"], default="compile",
                   help="compile: torch.compile + CUDA graphs (the measurement); static: the fixed-shape steps "
                        "eagerly (a fast script check)")
    p.add_argument("--json", default=None)
    add_dry_run(p)
    args = p.parse_args(argv)
    apply_dry_run(args, PROG, layers=4, prompt_len=24, max_new_tokens=12, block=4, budget=6, repeats=1,
                  dtype="float32")
    defaults = dict(layers=4, prompt_len=24 if args.tiny else 256, max_new_tokens=12 if args.tiny else 32,
                    block=4 if args.tiny else 16, budget=6 if args.tiny else 32, repeats=1 if args.tiny else 2,
                    dtype="float32" if args.tiny else "bfloat16")
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.dry_run and args.mode == "compile":
        skipped(PROG, "torch.compile and CUDA graphs", "the compiled rounds' fixed-shape steps run eagerly "
                "(--mode static) on the CPU")
        args.mode = "static"
    return args


def build_pair(args, device):
    import dflash

    shape = TINY if args.tiny else QWEN3_8B
    dtype = getattr(torch, args.dtype)
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


def unit_in_last_place(dtype, magnitude: float) -> float:
    """One unit in the last place of ``dtype`` at ``magnitude`` (``eps * 2**floor(log2 |x|)``)."""
    eps = torch.finfo(dtype).eps
    return eps * 2.0 ** math.floor(math.log2(magnitude)) if magnitude > 0 else eps


@torch.inference_mode()
def divergence_report(target, eager_ids: torch.Tensor, compiled_ids: torch.Tensor, prompt_len: int,
                      near_tie_ulps: float) -> dict | None:
    """None when equal; else the first divergence, the target's logit margins there, and whether it is a near-tie.

    ``top2_margin``: top-1 minus top-2 of the target's fp32 logits at the first differing position;
    ``pair_margin``: logit[eager token] - logit[compiled token]; ``eager_gap`` / ``compiled_gap``: each
    token's logit below the top-1. Near-tie (16-bit dtypes only): the top-2 margin and both gaps at most
    ``near_tie_ulps`` units in the last place of the target's dtype at the largest logit's magnitude.
    """
    from dflash.decoding.parity import first_divergence

    div = first_divergence(target, eager_ids.flatten(), compiled_ids.flatten())
    if div is None:
        return None
    report = dict(index=div.index, new_token=div.index - prompt_len, eager_token=div.expected,
                  compiled_token=div.got, describe=div.describe(), near_tie=False)
    if div.logit_margin is None:  # different lengths: never a near-tie
        return report
    device = target.lm_head.weight.device
    prefix = eager_ids.flatten()[: div.index].to(device)
    logits = target(input_ids=prefix[None]).logits[0, -1].float()
    top = float(logits.max())
    ulp = unit_in_last_place(target.dtype, float(logits.abs().max()))
    threshold = near_tie_ulps * ulp
    eager_gap, compiled_gap = top - float(logits[div.expected]), top - float(logits[div.got])
    sixteen_bit = target.dtype in (torch.bfloat16, torch.float16)
    report.update(top2_margin=div.top2_gap, pair_margin=div.logit_margin, eager_gap=eager_gap,
                  compiled_gap=compiled_gap, logit_max_abs=float(logits.abs().max()), ulp=ulp,
                  near_tie_ulps=near_tie_ulps, threshold=threshold, dtype=str(target.dtype).replace("torch.", ""),
                  near_tie=bool(sixteen_bit and div.top2_gap <= threshold
                                and max(eager_gap, compiled_gap) <= threshold))
    return report


def check_tokens(target, eager_runs, compiled_runs, prompt_len: int, near_tie_ulps: float):
    """(same, ok, divergences): equal tokens, or (16-bit only) every divergence at a near-tie."""
    divergences = []
    for i, (a, b) in enumerate(zip(eager_runs, compiled_runs)):
        d = divergence_report(target, a.output_ids, b.output_ids, prompt_len, near_tie_ulps)
        if d is not None:
            divergences.append(dict(repeat=i, **d))
    same = not divergences
    return same, all(d["near_tie"] for d in divergences), divergences


def dry_run_margin_check(target, ids: torch.Tensor, prompt_len: int, near_tie_ulps: float) -> bool:
    """The divergence report on a copy of ``ids`` with its last token changed: it must find that position."""
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % target.config.vocab_size
    d = divergence_report(target, ids, other, prompt_len, near_tie_ulps)
    ok = d is not None and d["index"] == ids.shape[1] - 1 and math.isfinite(d["top2_margin"])
    print(f"{PROG}: dry run: divergence report on a copy with its last token changed: "
          + (f"{d['describe']}; near-tie {d['near_tie']} (threshold {d['threshold']:.3g})" if d else "none found")
          + ("" if ok else "  <- WRONG"))
    return ok


def main(argv=None) -> int:
    import dflash

    args = parse_args(argv)
    device = torch.device(args.device)
    if fail_without_cuda(torch, device, PROG):
        return 2
    if args.dry_run:
        skipped(PROG, "CUDA-event stage times", "CPU: the stage clock reads the wall clock")
    target, draft = build_pair(args, device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size - 1, (args.prompt_len,), generator=g)
    mode = True if args.mode == "compile" else "static"
    methods = [("ar", {}), ("dflash", dict(block_size=args.block)),
               ("ddtree", dict(block_size=args.block, tree_budget=args.budget))]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows, ok = [], True
    report = dict(device=name, args=vars(args), dtype=args.dtype,
                  token_rule=("exact" if args.dtype == "float32" else
                              f"exact, or a divergence at a near-tie within {args.near_tie_ulps:g} ulps"),
                  rows=rows, complete=False)
    path = default_json(args.json, "gpu_compiled_round.json")
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
        same, tokens_ok, divergences = check_tokens(target, runs[False], runs[True], args.prompt_len,
                                                    args.near_tie_ulps)
        ok &= tokens_ok
        row = dict(method=method, setup_s=setup_s, first_call_s=first_call_s, same_tokens=same, tokens_ok=tokens_ok,
                   divergences=divergences)
        for label, rs in (("eager", runs[False]), ("compiled", runs[True])):
            rounds = statistics.mean(r.num_rounds for r in rs)
            row[f"{label}_tokens_per_s"] = statistics.median(r.tokens_per_second for r in rs)
            row[f"{label}_draft_ms"] = statistics.median(r.draft_time / max(1, r.num_rounds) for r in rs) * 1e3
            row[f"{label}_verify_ms"] = statistics.median(r.verify_time / max(1, r.num_rounds) for r in rs) * 1e3
            row[f"{label}_tau"] = statistics.mean(r.tau for r in rs)
            row[f"{label}_rounds"] = rounds
        rows.append(row)
        for dv in divergences:
            print(f"{PROG}: {method} repeat {dv['repeat']}: {dv['describe']}; "
                  + (f"top-2 margin {dv['top2_margin']:.4g}, gaps {dv['eager_gap']:.4g} / {dv['compiled_gap']:.4g} "
                     f"vs threshold {dv['threshold']:.4g}: " if "threshold" in dv else "")
                  + ("a near-tie (accepted)" if dv["near_tie"] else "NOT a near-tie"))
        write_json(path, report)  # what finished survives a kill
    if args.dry_run:
        ok &= dry_run_margin_check(target, runs[False][0].output_ids, args.prompt_len, args.near_tie_ulps)
    report["complete"] = True
    print(f"{PROG}: {name}, {'tiny' if args.tiny else 'Qwen3-8B'} shapes, {args.layers} layers, {args.dtype}, "
          f"prompt {args.prompt_len}, {args.max_new_tokens} new tokens, mode {args.mode}; "
          f"tokens: {report['token_rule']}")
    print("| method | draft ms eager | draft ms graph | verify ms eager | verify ms graph | tok/s eager | "
          "tok/s graph | ratio | setup s | same |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "yes" if r["same_tokens"] else ("near-tie" if r["tokens_ok"] else "NO")
        print(f"| {r['method']} | {r['eager_draft_ms']:.2f} | {r['compiled_draft_ms']:.2f} | {r['eager_verify_ms']:.2f} "
              f"| {r['compiled_verify_ms']:.2f} | {r['eager_tokens_per_s']:.1f} | {r['compiled_tokens_per_s']:.1f} | "
              f"{r['compiled_tokens_per_s'] / r['eager_tokens_per_s']:.2f}x | {r['setup_s']:.1f} | {same} |")
    write_json(path, report)
    if not ok:
        print(f"{PROG}: FAIL: compiled tokens differ from eager tokens "
              + ("(float32: must be equal)" if args.dtype == "float32" else "away from a near-tie"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
