"""Every dflash_kernels op on the device against its reference, at real model shapes; plus the key ratios.

Run on a GPU machine: ``python bench/gpu_kernel_check.py [--model qwen3-8b] [--json PATH]``.
On a CPU (tests): ``python bench/gpu_kernel_check.py --device cpu --tiny`` runs the Triton
kernels under the interpreter at small shapes (a check of this script, not of speed);
``--dry-run`` is the same and names what it leaves out (compiled Triton, CUDA-event timing).
The JSON report is rewritten after each op family, so a run cut short keeps what finished.

Correctness (exit status 1 on any mismatch): the Triton path (``force_backend("triton")``)
against :mod:`dflash_kernels.reference` on identical inputs, bf16:

* ``gather_concat`` (prefill rows and accepted rows): bit-exact;
* ``lm_head_logits``: fp32 logits within (3e-2, 1e-2) (bf16 operands, fp32 accumulation in
  another order); ``lm_head_argmax`` and ``lm_head_sample`` at temperature 1e-4: the reference
  logit of the chosen id is within that tolerance of the row maximum (a near-tie may go either
  way); ``lm_head_topk``: values within tolerance of the reference log-probs, and the reference
  log-prob of every returned id equal to its value; ``lm_head_sample`` at T = 1: reproducible
  with a seed, ids in range; ``lm_head_cross_entropy``: per-row losses within (2e-2, 1e-2);
  the same checks (logits, argmax, top-K, cold sampling, CE) with the final-logit softcap
  (``softcap=2``, Gemma 2 / 3);
* ``ancestor_bits``, ``tree_attention_mask``, ``compact_kv_``: bit-exact;
  ``tree_attention``: within (3e-2, 2e-2) of the fp32 reference, also with an attention
  softcap and per-head sinks (Gemma 2 / gpt-oss), with and without a sliding window, and
  with a forced 3-way key split (the sinks added once by the merge);
* ``build_tree`` / ``walk_tree`` (C++) against the Python reference, ``tree_positions``
  against depths + start: exact.

Ratios (reported, not gated): achieved fraction of ``Tensor.copy_`` bandwidth for
``gather_concat`` (bytes read + written / time, against a contiguous copy of the same
bytes); the bare GEMM ``hidden @ W.T`` time over each fused lm_head op's time (1.0 = the
fusion costs nothing beyond the GEMM); tree attention against SDPA with a dense float mask
(mask prebuilt, and mask built by the torch reference); and at ``budget + 1`` tree rows over the
``prefix`` and ``long_prefix`` keys (Qwen3-8B: 257 rows over 4096 and 32768) the dense-mask SDPA time
over tree attention's (goal >= 2), with the launcher's config and split count and the time of each
forced split count (what the split model is judged by). Times: median over repeats of the
mean of back-to-back calls between CUDA events, L2 not flushed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import add_dry_run, apply_dry_run, default_json, skipped, write_json  # noqa: E402

PROG = "gpu_kernel_check"

# model name -> (hidden, decoder layers, vocab, q heads, kv heads, head dim)
MODELS = {
    "qwen3-8b": (4096, 36, 151936, 32, 8, 128),
    "qwen3-4b": (2560, 36, 151936, 32, 8, 128),
    "llama-3.1-8b": (4096, 32, 128256, 32, 8, 128),
}


@dataclass
class Shapes:
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    captured: int = 5  # target layers read by the drafter
    prefill: int = 4096  # rows captured at prefill
    prefix: int = 4096  # committed tokens before a verify round
    long_prefix: int = 32768  # the long-context verify round of the attention ratio
    budget: int = 256  # DDTree nodes per round (tree tokens = budget + 1)
    block: int = 16  # DFlash block (draft rows = block - 1)
    accepted: int = 16  # accepted rows per round (gather, compaction)
    topk: int = 64
    ce_rows: int = 1024  # supervised positions of a training step
    cache_len: int = 8192


FAMILIES = ("gather", "lm_head", "tree", "compaction")


def real_shapes(model: str) -> Shapes:
    return Shapes(*MODELS[model])


def tiny_shapes() -> Shapes:
    return Shapes(hidden=64, layers=3, vocab=1000, heads=4, kv_heads=2, head_dim=16, captured=2, prefill=48,
                  prefix=40, long_prefix=100, budget=16, block=8, accepted=5, topk=8, ce_rows=24, cache_len=96)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU tests of this script)")
    p.add_argument("--only", default=",".join(FAMILIES), help="comma-separated op families to check: "
                   + ", ".join(FAMILIES))
    p.add_argument("--json", default=None, help="write results here (default: $OUT/gpu_kernel_check.json if OUT is set)")
    add_dry_run(p)
    args = p.parse_args(argv)
    apply_dry_run(args, PROG)
    args.only = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = [f for f in args.only if f not in FAMILIES]
    if unknown or not args.only:
        p.error(f"unknown op families {unknown}; allowed: {', '.join(FAMILIES)}")
    return args


class Checker:
    """Collects named pass/fail checks with a one-line detail each."""

    def __init__(self):
        self.results = []

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results.append(dict(check=name, ok=bool(ok), detail=detail))
        return ok

    @property
    def failed(self):
        return [r for r in self.results if not r["ok"]]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":  # the kernels run under Triton's interpreter; set before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_kernel_check: CUDA is not available (use --device cpu --tiny to test this script)", file=sys.stderr)
        return 2
    import dflash_kernels as dk
    from dflash_kernels import reference as ref

    if "triton" not in dk.available_backends(device):
        print(f"gpu_kernel_check: Triton cannot run on {device} here", file=sys.stderr)
        return 2
    shapes = tiny_shapes() if args.tiny else real_shapes(args.model)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if args.dry_run:
        skipped(PROG, "compiled Triton kernels", "no GPU: the kernels run under Triton's CPU interpreter")
        skipped(PROG, "CUDA-event timing", "no GPU: wall-clock times of one call each (they mean nothing)")
    # on a CPU the interpreter runs the kernels: one timed call each, no warm-up (the times mean nothing)
    timing = dict(repeats=1, inner=1, warmup=False) if device.type == "cpu" else dict(repeats=7, inner=20)
    check = Checker()
    ratios = {}
    path = default_json(args.json, "gpu_kernel_check.json")
    report = dict(device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  model=None if args.tiny else args.model, shapes=shapes.__dict__, checks=check.results,
                  ratios=ratios, triton_interpreter=interpreting, dry_run=args.dry_run, families=args.only,
                  finished=[], complete=False)
    families = dict(gather=lambda: check_gather(torch, dk, ref, shapes, device, check, ratios, timing),
                    lm_head=lambda: check_lm_head(torch, dk, ref, shapes, device, check, ratios, timing),
                    tree=lambda: check_tree(torch, dk, ref, shapes, device, check, ratios, timing),
                    compaction=lambda: check_compaction(torch, dk, ref, shapes, device, check))
    torch.manual_seed(0)
    with torch.inference_mode():
        for family in FAMILIES:
            if family not in args.only:
                continue
            t0 = time.perf_counter()
            families[family]()
            report["finished"].append(dict(family=family, seconds=round(time.perf_counter() - t0, 2)))
            write_json(path, report)  # what finished survives a kill
    report["complete"] = True
    print_report(report)
    write_json(path, report)
    if path:
        print(f"wrote {path}")
    if check.failed:
        print(f"FAILED: {len(check.failed)} kernel result(s) differ from the reference: "
              + ", ".join(r["check"] for r in check.failed), file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- helpers
def time_ms(torch, fn, device, repeats: int, inner: int, warmup: bool = True) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` back-to-back calls (after one warm-up call)."""
    if warmup:
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples)


def max_abs(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def close(torch, got, want, atol, rtol):
    """(ok, detail) of an elementwise |got - want| <= atol + rtol * |want| check."""
    if got.shape != want.shape:
        return False, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.float() - want.float()).abs()
    bound = atol + rtol * want.float().abs()
    bad = int((err > bound).sum())
    return bad == 0, f"max |err| {float(err.max()) if err.numel() else 0.0:.3g}, {bad} elements out of tolerance"


def random_parents(torch, n_nodes: int, seed: int = 0):
    """DDTree-like parents ``[n_nodes]`` (root first, depth <= 15)."""
    gen = torch.Generator().manual_seed(seed)
    parents, depth = [-1], [0]
    for i in range(1, n_nodes):
        p = int(torch.randint(max(0, i - 32), i, (1,), generator=gen))
        while depth[p] >= 15:
            p = parents[p]
        parents.append(p)
        depth.append(depth[p] + 1)
    return torch.tensor(parents, dtype=torch.int64)


# ---------------------------------------------------------------- gather
def check_gather(torch, dk, ref, s: Shapes, device, check: Checker, ratios: dict, timing: dict) -> None:
    dt = torch.bfloat16
    prefill = [torch.randn(s.prefill, s.hidden, device=device, dtype=dt) for _ in range(s.captured)]
    verify = [torch.randn(s.budget + 1, s.hidden, device=device, dtype=dt) for _ in range(s.captured)]
    rows = torch.randperm(s.budget + 1, device=device)[: s.accepted].sort().values
    with dk.force_backend("triton"):
        got_all = dk.gather_concat(prefill)
        got_rows = dk.gather_concat(verify, rows=rows)
    check.add("gather_concat prefill rows", torch.equal(got_all, ref.gather_concat(prefill)),
              f"[{s.prefill}, {s.captured}x{s.hidden}]")
    check.add("gather_concat accepted rows", torch.equal(got_rows, torch.cat(verify, dim=1)[rows]),
              f"{s.accepted} of {s.budget + 1} rows")
    for name, layers, r in (("prefill", prefill, None), ("accepted", verify, rows)):
        n_rows = layers[0].shape[0] if r is None else r.numel()
        moved = 2 * n_rows * s.captured * s.hidden * 2  # read + write, bf16
        src = torch.randn(n_rows, s.captured * s.hidden, device=device, dtype=dt)
        dst = torch.empty_like(src)
        out = torch.empty_like(src)
        with dk.force_backend("triton"):
            t_gather = time_ms(torch, lambda: dk.gather_concat(layers, rows=r, out=out, check_bounds=False), device,
                               **timing)
        t_copy = time_ms(torch, lambda: dst.copy_(src), device, **timing)
        ratios[f"gather_{name}"] = dict(
            rows=n_rows, bytes_moved=moved, gather_ms=t_gather, copy_ms=t_copy,
            gather_gb_s=moved / t_gather / 1e6, copy_gb_s=moved / t_copy / 1e6,
            fraction_of_copy_bandwidth=t_copy / t_gather)


# ---------------------------------------------------------------- lm_head
LOGIT_TOL = (3e-2, 1e-2)


def _choice_is_a_max(torch, logits, ids, atol, rtol):
    """Every chosen id's reference logit lies within tolerance of its row's maximum."""
    top = logits.max(dim=1).values
    picked = logits.gather(1, ids.view(-1, 1)).squeeze(1)
    short = top - picked
    bad = int((short > atol + rtol * top.abs()).sum())
    return bad == 0, f"largest shortfall below the row max {float(short.max()):.3g}, {bad} rows off"


def check_lm_head(torch, dk, ref, s: Shapes, device, check: Checker, ratios: dict, timing: dict) -> None:
    dt = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(1)
    weight = (torch.randn(s.vocab, s.hidden, device=device, generator=gen) / math.sqrt(s.hidden)).to(dt)
    norm_weight = (1 + 0.1 * torch.randn(s.hidden, device=device, generator=gen)).to(dt)
    atol, rtol = LOGIT_TOL
    for rows in sorted({s.block - 1, s.budget + 1}):
        hidden = (3 * torch.randn(rows, s.hidden, device=device, generator=gen)).to(dt)
        kw = dict(norm_weight=norm_weight)
        logits = ref.lm_head_logits(hidden, weight, **kw)
        with dk.force_backend("triton"):
            got_logits = dk.lm_head_logits(hidden, weight, **kw)
            got_ids = dk.lm_head_argmax(hidden, weight, **kw)
            values, top_ids = dk.lm_head_topk(hidden, weight, s.topk, **kw)
            cold = dk.lm_head_sample(hidden, weight, 1e-4, seed=3, **kw)
            warm_a = dk.lm_head_sample(hidden, weight, 1.0, seed=5, **kw)
            warm_b = dk.lm_head_sample(hidden, weight, 1.0, seed=5, **kw)
        check.add(f"lm_head_logits N={rows}", *close(torch, got_logits, logits, atol, rtol))
        check.add(f"lm_head_argmax N={rows}", *_choice_is_a_max(torch, logits, got_ids, atol, rtol))
        check.add(f"lm_head_sample T=1e-4 N={rows}", *_choice_is_a_max(torch, logits, cold, atol, rtol))
        in_range = bool(((warm_a >= 0) & (warm_a < s.vocab)).all())
        check.add(f"lm_head_sample T=1 N={rows}", torch.equal(warm_a, warm_b) and in_range,
                  "same seed gives the same ids" if torch.equal(warm_a, warm_b) else "same seed, different ids")
        logprobs = torch.log_softmax(logits, dim=1)
        ok_vals, detail_vals = close(torch, values, logprobs.topk(s.topk, dim=1).values, atol, rtol)
        ok_ids, detail_ids = close(torch, logprobs.gather(1, top_ids), values, atol, rtol)
        check.add(f"lm_head_topk k={s.topk} N={rows}", ok_vals and ok_ids, f"values: {detail_vals}; ids: {detail_ids}")
        check_head_merge(torch, dk, check, hidden, weight, kw, rows)

        normed = ref.rms_norm(hidden, norm_weight) if hasattr(ref, "rms_norm") else hidden
        t_gemm = time_ms(torch, lambda: normed @ weight.T, device, **timing)
        t_torch = time_ms(torch, lambda: (ref.rms_norm(hidden, norm_weight) @ weight.T).float().argmax(1), device,
                          **timing) if hasattr(ref, "rms_norm") else None
        entry = dict(rows=rows, vocab=s.vocab, hidden=s.hidden, gemm_ms=t_gemm, torch_norm_gemm_argmax_ms=t_torch,
                     head_plan=head_plan(torch, dk, rows, s.vocab, device))
        with dk.force_backend("triton"):
            for name, fn in (("argmax", lambda: dk.lm_head_argmax(hidden, weight, **kw)),
                             ("topk", lambda: dk.lm_head_topk(hidden, weight, s.topk, **kw)),
                             ("sample", lambda: dk.lm_head_sample(hidden, weight, 0.7, seed=1, **kw))):
                t = time_ms(torch, fn, device, **timing)
                entry[f"{name}_ms"] = t
                entry[f"{name}_gemm_fraction"] = t_gemm / t
        if device.type == "cuda" and rows > 16:
            entry["head_sweep"] = sweep_heads(torch, dk, hidden, weight, kw, t_gemm, device, timing)
            entry["topk_sweep"] = sweep_topk(torch, dk, hidden, weight, kw, s.topk, t_gemm, device, timing)
        ratios[f"lm_head_N{rows}"] = entry

    rows = s.ce_rows
    hidden = (3 * torch.randn(rows, s.hidden, device=device, generator=gen)).to(dt)
    targets = torch.randint(0, s.vocab, (rows,), device=device, generator=gen)
    want = ref.lm_head_cross_entropy(hidden, weight, targets, norm_weight=norm_weight)
    with dk.force_backend("triton"):
        got = dk.lm_head_cross_entropy(hidden, weight, targets, norm_weight=norm_weight)
        t_ce = time_ms(torch, lambda: dk.lm_head_cross_entropy(hidden, weight, targets, norm_weight=norm_weight),
                       device, **timing)
    check.add(f"lm_head_cross_entropy N={rows}", *close(torch, got, want, 2e-2, 1e-2))
    t_gemm = time_ms(torch, lambda: hidden @ weight.T, device, **timing)
    ratios[f"lm_head_cross_entropy_N{rows}"] = dict(rows=rows, gemm_ms=t_gemm, cross_entropy_ms=t_ce,
                                                    gemm_fraction=t_gemm / t_ce)
    check_lm_head_softcap(torch, dk, ref, s, device, check, weight, norm_weight, gen)


LOGIT_SOFTCAP = 2.0  # small enough to change logits of a few units (Gemma 2 / 3 use 30)


def head_plan(torch, dk, rows: int, vocab: int, device) -> dict:
    """The heads' launch at this shape: row tile, vocab tile, vocab tiles per split and splits (argmax; the
    Gumbel epilogue's vocab tile may be narrower)."""
    from dflash_kernels import lm_head
    cfg = lm_head.head_config(rows, torch.bfloat16)
    row_tiles = -(-rows // cfg["BLOCK_M"])
    per, splits = lm_head.vocab_split_plan(row_tiles, -(-vocab // cfg["BLOCK_N"]),
                                           lm_head._head_programs(torch.device(device)))
    return dict(block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"], row_tiles=row_tiles, tiles_per_split=per,
                splits=splits)


#: (BLOCK_M, BLOCK_N of the greedy head, programs per SM) timed besides the shipped plan (sampling keeps its
#: narrower vocab tile where the greedy one is wider than 128 ids): the tile/occupancy trade-off at this row count.
HEAD_SWEEP = ((64, 128, 1), (64, 256, 1), (64, 256, 2), (128, 128, 2), (128, 128, 1))


def sweep_heads(torch, dk, hidden, weight, kw, t_gemm: float, device, timing: dict) -> list:
    """GEMM fraction of the greedy and Gumbel heads under each :data:`HEAD_SWEEP` plan (bf16 only)."""
    from dflash_kernels import lm_head
    shipped_config, shipped_programs = lm_head.head_config, lm_head.HEAD_PROGRAMS_PER_SM
    out = []
    try:
        for block_m, block_n, per_sm in HEAD_SWEEP:
            def config(n_rows, dot_dtype, gumbel=False, block_m=block_m, block_n=block_n):
                cfg = shipped_config(n_rows, dot_dtype, gumbel)
                if n_rows > 16 and dot_dtype != torch.float32:  # sampling: the widths that compile without spills
                    cfg.update(BLOCK_M=block_m, BLOCK_N=(64 if block_m == 128 else 128) if gumbel else block_n)
                return cfg
            lm_head.head_config, lm_head.HEAD_PROGRAMS_PER_SM = config, per_sm
            with dk.force_backend("triton"):
                t_arg = time_ms(torch, lambda: dk.lm_head_argmax(hidden, weight, **kw), device, **timing)
                t_smp = time_ms(torch, lambda: dk.lm_head_sample(hidden, weight, 0.7, seed=1, **kw), device, **timing)
            out.append(dict(block_m=block_m, block_n=block_n, programs_per_sm=per_sm,
                            argmax_gemm_fraction=t_gemm / t_arg, sample_gemm_fraction=t_gemm / t_smp))
    finally:
        lm_head.head_config, lm_head.HEAD_PROGRAMS_PER_SM = shipped_config, shipped_programs
    return out


#: Programs per SM of the fused top-K's split plan timed besides the shipped one (its tiles are fixed by what
#: compiles without spills: 64 x 128 above 16 rows).
TOPK_SWEEP_PROGRAMS = (1, 3, 4)


def sweep_topk(torch, dk, hidden, weight, kw, k: int, t_gemm: float, device, timing: dict) -> list:
    """GEMM fraction of the fused top-K under each :data:`TOPK_SWEEP_PROGRAMS` split plan."""
    from dflash_kernels import lm_head
    shipped = lm_head.HEAD_PROGRAMS_PER_SM
    out = []
    try:
        for per_sm in TOPK_SWEEP_PROGRAMS:
            lm_head.HEAD_PROGRAMS_PER_SM = per_sm
            with dk.force_backend("triton"):
                t = time_ms(torch, lambda: dk.lm_head_topk(hidden, weight, k, **kw), device, **timing)
            out.append(dict(programs_per_sm=per_sm, topk_gemm_fraction=t_gemm / t))
    finally:
        lm_head.HEAD_PROGRAMS_PER_SM = shipped
    return out


def check_head_merge(torch, dk, check: Checker, hidden, weight, kw, rows: int) -> None:
    """The split heads' ticket merge on the device: 20 back-to-back argmax / device-seed draws give the same ids,
    and the ticket counters are back at zero (a lost or doubled ticket would leave them non-zero)."""
    from dflash_kernels import lm_head
    seed = torch.tensor([11], dtype=torch.int64, device=hidden.device)
    with dk.force_backend("triton"):
        greedy = [dk.lm_head_argmax(hidden, weight, **kw) for _ in range(20)]
        drawn = [dk.lm_head_sample(hidden, weight, 1.0, seed=seed, **kw) for _ in range(20)]
    same = all(torch.equal(g, greedy[0]) for g in greedy) and all(torch.equal(d, drawn[0]) for d in drawn)
    zero = not bool(lm_head._tickets(hidden.device, 1).any())
    check.add(f"lm_head_argmax split merge (and seeded sample) N={rows}", same and zero,
              f"repeatable: {same}; tickets at zero: {zero}")


def check_lm_head_softcap(torch, dk, ref, s: Shapes, device, check: Checker, weight, norm_weight, gen) -> None:
    """Every lm_head op with the final-logit softcap against the reference (capped fp32 logits)."""
    dt, c = torch.bfloat16, LOGIT_SOFTCAP
    atol, rtol = LOGIT_TOL
    rows = s.budget + 1
    hidden = (3 * torch.randn(rows, s.hidden, device=device, generator=gen)).to(dt)
    kw = dict(norm_weight=norm_weight, softcap=c)
    logits = ref.lm_head_logits(hidden, weight, **kw)
    with dk.force_backend("triton"):
        got_logits = dk.lm_head_logits(hidden, weight, **kw)
        got_ids = dk.lm_head_argmax(hidden, weight, **kw)
        values, top_ids = dk.lm_head_topk(hidden, weight, s.topk, **kw)
        cold = dk.lm_head_sample(hidden, weight, 1e-4, seed=3, **kw)
    check.add(f"lm_head_logits softcap={c} N={rows}", *close(torch, got_logits, logits, atol, rtol))
    check.add(f"lm_head_argmax softcap={c} N={rows}", *_choice_is_a_max(torch, logits, got_ids, atol, rtol))
    check.add(f"lm_head_sample softcap={c} T=1e-4 N={rows}", *_choice_is_a_max(torch, logits, cold, atol, rtol))
    logprobs = torch.log_softmax(logits, dim=1)
    ok_vals, detail_vals = close(torch, values, logprobs.topk(s.topk, dim=1).values, atol, rtol)
    ok_ids, detail_ids = close(torch, logprobs.gather(1, top_ids), values, atol, rtol)
    check.add(f"lm_head_topk softcap={c} k={s.topk} N={rows}", ok_vals and ok_ids,
              f"values: {detail_vals}; ids: {detail_ids}")
    targets = torch.randint(0, s.vocab, (rows,), device=device, generator=gen)
    want = ref.lm_head_cross_entropy(hidden, weight, targets, **kw)
    with dk.force_backend("triton"):
        got = dk.lm_head_cross_entropy(hidden, weight, targets, **kw)
    check.add(f"lm_head_cross_entropy softcap={c} N={rows}", *close(torch, got, want, 2e-2, 1e-2))


# ---------------------------------------------------------------- tree
ATTENTION_SOFTCAP = 2.0  # bf16 unit-variance q/k at scale D**-0.5: scores of a few units, capped at 2


def check_tree(torch, dk, ref, s: Shapes, device, check: Checker, ratios: dict, timing: dict) -> None:
    import torch.nn.functional as F

    from dflash_kernels.tree_attention import tree_attention_mask

    # host side: C++ build and walk against the Python reference
    gen = torch.Generator().manual_seed(2)
    depth = s.block - 1
    logprobs, ids = (torch.randn(depth, min(4096, s.vocab), generator=gen) * 3).log_softmax(-1).topk(
        min(s.budget, s.vocab), dim=-1)
    built = dk.build_tree(logprobs, ids, s.budget)
    want = ref.build_tree(logprobs, ids, s.budget)
    check.add(f"build_tree budget={s.budget}", all(torch.equal(a, b) for a, b in zip(built, want)))
    tokens, depths, parents = built[:3]
    choices = torch.cat([tokens[:4], torch.randint(0, s.vocab, (s.budget + 1 - 4,), generator=gen)])
    got_walk, want_walk = dk.walk_tree(parents, tokens, choices), ref.walk_tree(parents, tokens, choices)
    check.add("walk_tree", torch.equal(got_walk[0], want_walk[0]) and int(got_walk[1]) == int(want_walk[1]))
    positions = dk.tree_positions(depths.to(device), s.prefix)
    check.add("tree_positions", positions.tolist() == [s.prefix] + [s.prefix + int(d) for d in depths])

    # device side: bits, mask, attention
    parents_d = parents.to(device)
    with dk.force_backend("triton"):
        bits = dk.ancestor_bits(parents_d)
    check.add(f"ancestor_bits N+1={s.budget + 1}", torch.equal(bits.cpu(), ref.ancestor_bits(parents)))
    big_parents = random_parents(torch, 4 * s.budget + 1, seed=3)
    with dk.force_backend("triton"):
        big_bits = dk.ancestor_bits(big_parents.to(device))
    check.add(f"ancestor_bits N+1={4 * s.budget + 1}", torch.equal(big_bits.cpu(), ref.ancestor_bits(big_parents)))
    with dk.force_backend("triton"):
        mask = tree_attention_mask(bits, s.prefix, torch.bfloat16)
    check.add("tree_attention_mask", torch.equal(mask, ref.tree_attention_mask(bits, s.prefix, torch.bfloat16)))

    T, S = s.budget + 1, s.prefix + s.budget + 1
    dt = torch.bfloat16
    gen_d = torch.Generator(device=device).manual_seed(4)
    q = torch.randn(1, s.heads, T, s.head_dim, device=device, dtype=dt, generator=gen_d)
    cache = torch.randn(2, 2, s.kv_heads, S + 64, s.head_dim, device=device, dtype=dt, generator=gen_d)
    k, v = cache[1, 0, :, :S][None], cache[1, 1, :, :S][None]
    want_attn = ref.tree_attention(q, k, v, bits, s.prefix)
    with dk.force_backend("triton"):
        got_attn = dk.tree_attention(q, k, v, bits, s.prefix)
        t_tree = time_ms(torch, lambda: dk.tree_attention(q, k, v, bits, s.prefix), device, **timing)
    check.add(f"tree_attention T={T} prefix={s.prefix}", *close(torch, got_attn, want_attn, 3e-2, 2e-2))

    # Gemma 2 / gpt-oss features: attention softcap, per-head sinks (bf16, as the model's parameter),
    # a sliding window over tree positions, and a forced key split (the merge adds each sink once).
    from dflash_kernels.tree_attention import tree_attention_triton

    sinks = (torch.randn(s.heads, device=device, generator=gen_d) + math.log(S)).to(dt)
    tree_pos = positions.to(torch.int64)
    window = max(2, s.prefix // 3)
    for label, extra, splits in (("", {}, None), (f" window={window}", dict(positions=tree_pos, window=window), None),
                                 (f" window={window} split=3", dict(positions=tree_pos, window=window), 3)):
        kw = dict(softcap=ATTENTION_SOFTCAP, sinks=sinks, **extra)
        want_feat = ref.tree_attention(q, k, v, bits, s.prefix, **kw)
        with dk.force_backend("triton"):
            if splits is None:
                got_feat = dk.tree_attention(q, k, v, bits, s.prefix, **kw)
            else:
                got_feat = tree_attention_triton(q, k, v, bits, s.prefix, num_splits=splits, **kw)
        check.add(f"tree_attention softcap={ATTENTION_SOFTCAP}+sinks{label} T={T} prefix={s.prefix}",
                  *close(torch, got_feat, want_feat, 3e-2, 2e-2))

    def sdpa(m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m[None, None], enable_gqa=True)

    t_sdpa = time_ms(torch, lambda: sdpa(mask), device, **timing)
    t_sdpa_build = time_ms(torch, lambda: sdpa(ref.tree_attention_mask(bits, s.prefix, dt)), device, **timing)
    ratios["tree_attention"] = dict(tree_tokens=T, prefix=s.prefix, heads=s.heads, kv_heads=s.kv_heads,
                                    head_dim=s.head_dim, tree_attention_ms=t_tree, sdpa_dense_mask_ms=t_sdpa,
                                    sdpa_with_torch_mask_build_ms=t_sdpa_build,
                                    speedup_over_sdpa_dense_mask=t_sdpa / t_tree,
                                    speedup_over_sdpa_with_mask_build=t_sdpa_build / t_tree,
                                    dense_mask_mib=T * S * 2 / 2**20)
    ratios["tree_attention_prefixes"] = [
        tree_attention_vs_sdpa(torch, dk, ref, s, device, check, timing, bits, prefix)
        for prefix in (s.prefix, s.long_prefix)]


#: the goal of tree attention against SDPA with a prebuilt dense mask, at budget + 1 rows over each prefix
TREE_ATTENTION_GOAL = 2.0
#: the forced split counts timed next to the launcher's choice
SPLIT_SWEEP = (1, 2, 3, 4, 5, 7, 9, 11, 15, 22)
#: calls captured in one CUDA graph by :func:`graph_ms`
GRAPH_CALLS = 10


def graph_ms(torch, fn, device, timing: dict):
    """Device time of one ``fn()``: ``GRAPH_CALLS`` calls captured in one CUDA graph (no host launch cost: a
    verify round runs captured), its replays timed as :func:`time_ms` does, divided by ``GRAPH_CALLS``. None
    off CUDA."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture (compiles, allocator pools, cached device queries)
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return time_ms(torch, graph.replay, device, **timing) / GRAPH_CALLS


def tree_attention_vs_sdpa(torch, dk, ref, s: Shapes, device, check: Checker, timing: dict, bits, prefix: int) -> dict:
    """``budget + 1`` tree rows over ``prefix`` committed keys (one sequence, bf16): checked against the reference,
    timed against SDPA with the prebuilt dense additive mask (``enable_gqa``), eagerly (host launch costs
    included) and as CUDA-graph replays (device time: the ratio the goal is about), and each forced split count
    (graph replays) next to the launcher's choice."""
    import torch.nn.functional as F

    from dflash_kernels.tree_attention import tree_attention_mask, tree_attention_plan, tree_attention_triton

    T, S, dt = s.budget + 1, prefix + s.budget + 1, torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(6)
    q = torch.randn(1, s.heads, T, s.head_dim, device=device, dtype=dt, generator=gen)
    k = torch.randn(1, s.kv_heads, S, s.head_dim, device=device, dtype=dt, generator=gen)
    v = torch.randn(1, s.kv_heads, S, s.head_dim, device=device, dtype=dt, generator=gen)
    with dk.force_backend("triton"):
        mask = tree_attention_mask(bits, prefix, dt)[None, None]
        got = dk.tree_attention(q, k, v, bits, prefix)
    check.add(f"tree_attention T={T} prefix={prefix} (timed)", *close(torch, got, ref.tree_attention(q, k, v, bits, prefix),
                                                                     3e-2, 2e-2))

    def tree():
        with dk.force_backend("triton"):
            return dk.tree_attention(q, k, v, bits, prefix)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    t_tree, t_sdpa = time_ms(torch, tree, device, **timing), time_ms(torch, sdpa, device, **timing)
    g_tree, g_sdpa = graph_ms(torch, tree, device, timing), graph_ms(torch, sdpa, device, timing)
    cfg, splits = tree_attention_plan(q, k, prefix)
    sweep = {}
    if device.type == "cuda":  # (the interpreter's times mean nothing)
        for n in SPLIT_SWEEP:
            sweep[n] = graph_ms(torch, lambda: tree_attention_triton(q, k, v, bits, prefix, num_splits=n), device,
                                timing)
    ratio = None if g_tree is None else g_sdpa / g_tree
    return dict(tree_tokens=T, prefix=prefix, tree_attention_ms=t_tree, sdpa_dense_mask_ms=t_sdpa,
                eager_speedup_over_sdpa_dense_mask=t_sdpa / t_tree, graph_tree_attention_ms=g_tree,
                graph_sdpa_dense_mask_ms=g_sdpa, speedup_over_sdpa_dense_mask=ratio, goal=TREE_ATTENTION_GOAL,
                meets_goal=None if ratio is None else ratio >= TREE_ATTENTION_GOAL,
                config={k_: cfg[k_] for k_ in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}, num_splits=splits,
                forced_split_graph_ms={str(n): t for n, t in sweep.items()},
                best_forced_split=min(sweep, key=sweep.get) if sweep else None)


def check_compaction(torch, dk, ref, s: Shapes, device, check: Checker) -> None:
    kv = torch.randn(s.layers, 2, s.kv_heads, s.cache_len, s.head_dim, device=device, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    tail = torch.randperm(s.budget, generator=gen)[: s.accepted - 1].sort().values + s.prefix + 1
    src = torch.cat([torch.tensor([s.prefix]), tail]).to(device)
    want = ref.compact_kv_(kv.clone(), src, s.prefix)
    with dk.force_backend("triton"):
        got = dk.compact_kv_(kv, src, s.prefix)
    check.add(f"compact_kv_ {s.layers} layers, {s.accepted} rows", torch.equal(got, want))


# ---------------------------------------------------------------- report
def print_report(report: dict) -> None:
    print(f"== dflash_kernels on {report['device_name']} ({report['device']}), shapes "
          f"{report['model'] or 'tiny'}" + (" [Triton interpreter: times mean nothing]"
                                            if report["triton_interpreter"] else ""))
    width = max(len(r["check"]) for r in report["checks"])
    for r in report["checks"]:
        print(f"  {'ok  ' if r['ok'] else 'FAIL'}  {r['check']:<{width}}  {r['detail']}")
    rt = report["ratios"]
    print("== ratios")
    for key in ("gather_prefill", "gather_accepted"):
        if key not in rt:
            continue
        g = rt[key]
        print(f"  gather_concat {g['rows']:>5} rows: {g['gather_gb_s']:8.1f} GB/s vs copy_ {g['copy_gb_s']:8.1f} GB/s"
              f" -> {100 * g['fraction_of_copy_bandwidth']:5.1f}% of copy bandwidth")
    for key, e in rt.items():
        if key.startswith("lm_head_N"):
            print(f"  lm_head N={e['rows']:>4}: bare GEMM {e['gemm_ms']:.3f} ms; fused argmax {e['argmax_ms']:.3f} ms "
                  f"({100 * e['argmax_gemm_fraction']:.0f}% of GEMM speed), topk {e['topk_ms']:.3f} ms "
                  f"({100 * e['topk_gemm_fraction']:.0f}%), sample {e['sample_ms']:.3f} ms "
                  f"({100 * e['sample_gemm_fraction']:.0f}%)")
            for w in e.get("head_sweep", ()):
                print(f"    heads M{w['block_m']} N{w['block_n']} {w['programs_per_sm']}/SM: argmax "
                      f"{100 * w['argmax_gemm_fraction']:.0f}%, sample {100 * w['sample_gemm_fraction']:.0f}% of GEMM speed")
            for w in e.get("topk_sweep", ()):
                print(f"    top-K {w['programs_per_sm']}/SM: {100 * w['topk_gemm_fraction']:.0f}% of GEMM speed")
        elif key.startswith("lm_head_cross_entropy"):
            print(f"  lm_head_cross_entropy N={e['rows']}: {e['cross_entropy_ms']:.3f} ms vs bare GEMM "
                  f"{e['gemm_ms']:.3f} ms ({100 * e['gemm_fraction']:.0f}% of GEMM speed)")
    if "tree_attention" not in rt:
        return
    t = rt["tree_attention"]
    print(f"  tree_attention T={t['tree_tokens']} prefix={t['prefix']}: {t['tree_attention_ms']:.3f} ms; SDPA + dense "
          f"mask {t['sdpa_dense_mask_ms']:.3f} ms ({t['speedup_over_sdpa_dense_mask']:.2f}x), with torch mask build "
          f"{t['sdpa_with_torch_mask_build_ms']:.3f} ms ({t['speedup_over_sdpa_with_mask_build']:.2f}x)")
    for e in rt.get("tree_attention_prefixes", ()):
        c = e["config"]
        head = (f"  tree_attention T={e['tree_tokens']} prefix={e['prefix']} ({c['BLOCK_M']}x{c['BLOCK_N']} tiles, "
                f"{c['num_warps']} warps, {e['num_splits']} splits): eager {e['tree_attention_ms']:.3f} ms vs SDPA + "
                f"dense mask {e['sdpa_dense_mask_ms']:.3f} ms ({e['eager_speedup_over_sdpa_dense_mask']:.2f}x)")
        if e["speedup_over_sdpa_dense_mask"] is None:
            print(head)
            continue
        sweep = ", ".join(f"{n}: {ms:.4f}" for n, ms in e["forced_split_graph_ms"].items())
        print(f"{head}; CUDA graph {e['graph_tree_attention_ms']:.4f} ms vs {e['graph_sdpa_dense_mask_ms']:.4f} ms -> "
              f"{e['speedup_over_sdpa_dense_mask']:.2f}x (goal {e['goal']:.0f}x: "
              f"{'met' if e['meets_goal'] else 'NOT met'}); forced splits ms {{{sweep}}}, best "
              f"{e['best_forced_split']}")

if __name__ == "__main__":
    sys.exit(main())
