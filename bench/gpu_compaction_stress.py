"""Stress test: KV compaction kernel vs the reference on thousands of adversarial accepted paths.

Run: ``python bench/gpu_compaction_stress.py [--cases N] [--seed S] [--json PATH]``

On a GPU: a Qwen3-8B-shaped cache ``[36, 2, 8, S, 128]`` bf16 (S = 2048 by
default), 3000 cases by default (well under a minute on an H100/H200). Without
CUDA the kernel runs under Triton's CPU interpreter (which cannot show races,
so this only checks the semantics there): the same cache shape with S = 320
and 4 cases by default; pass ``--cases`` to change it. ``--dry-run`` runs on the
CPU whatever the machine has: a small cache ``[2, 2, 2, 96, 16]``, a 24-node tree
and 6 cases (every call form twice), naming what it leaves out.

Each case draws a random tree (``--tree`` nodes, parents before children as
DDTree numbers them, chain-heavy) at a random prefix length, walks a random
root-to-node path (the accepted nodes: strictly increasing node ids) and
compacts the cache rows ``prefix + node`` to ``prefix + i``. Every few cases
the path is instead one of the patterns that exercise the race the kernel's
CTA barrier prevents: ``[0, 2, 3, ...]`` (every row after the first reads
the position the next row writes), a run then a skip, dense runs crossing the
16-row chunk boundary (15, 16, 17, 31, 32, 33 rows). Call forms rotate
through: CPU positions with ``check=True``; device positions with
``check=False``; a fixed ``A = max depth`` device buffer with garbage past
the real count and a device ``num_rows`` (the DDTree loop's call).

Kernel and reference (``dflash_kernels.reference.compact_kv_``) each compact
their own copy of the cache; the whole caches must be bit-identical, and the
moved rows must equal the original source rows. Both copies are then
restored from a pristine one (only the touched rows). Prints one line,
``compaction stress: N cases, M mismatches`` (plus timing), writes it as JSON to
``--json`` (or ``$OUT/gpu_compaction_stress.json``), and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from gpu_common import add_dry_run, default_json, skipped, write_json  # noqa: E402

PROG = "gpu_compaction_stress"
CUDA = torch.cuda.is_available()


def random_tree(rng: random.Random, n_nodes: int):
    """Parents of nodes 1..n_nodes-1 (node 0 = root); parent[i] < i. Mostly chains, some branching."""
    parent = [-1]
    for i in range(1, n_nodes):
        if rng.random() < 0.55:
            parent.append(i - 1)  # continue the latest chain
        else:
            parent.append(rng.randrange(0, i))
    return parent


def random_path(rng: random.Random, parent):
    """Root plus a random walk down the tree: strictly increasing node ids."""
    children = [[] for _ in parent]
    for i, p in enumerate(parent):
        if p >= 0:
            children[p].append(i)
    path = [0]
    while children[path[-1]] and rng.random() < 0.9:
        path.append(rng.choice(children[path[-1]]))
    return path


def adversarial_path(rng: random.Random, case: int, n_nodes: int):
    """Paths built to overlap sources and destinations in every way (within ``n_nodes`` nodes)."""
    kind = case % 4
    length = rng.choice([2, 3, 4, 8, 15, 16, 17, 31, 32, 33])
    length = min(length, n_nodes - 1)
    if kind == 0:  # [0, 2, 3, ..., length]
        return [0] + list(range(2, length + 1))
    if kind == 1:  # a run, one skip, a run
        k = rng.randrange(1, length)
        return list(range(k)) + list(range(k + 1, length + 1))
    if kind == 2:  # dense run from the root (identity moves) crossing the chunk boundary
        return list(range(length))
    gaps = [rng.choice([1, 1, 2]) for _ in range(length - 1)]  # skips of one scattered through a run
    path = [0]
    for g in gaps:
        if path[-1] + g >= n_nodes:
            break
        path.append(path[-1] + g)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=None, help="default 3000 on CUDA, 4 on the CPU, 6 in a dry run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="default 36; dry run 2")
    parser.add_argument("--kv-heads", type=int, default=None, help="default 8; dry run 2")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128; dry run 16")
    parser.add_argument("--smax", type=int, default=None, help="default 2048 on CUDA, 320 on the CPU; dry run 96")
    parser.add_argument("--tree", type=int, default=None, help="tree nodes per round, root included (default 64; "
                        "dry run 24)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--json", default=None)
    add_dry_run(parser)
    args = parser.parse_args(argv)
    cuda = CUDA and not args.dry_run
    if args.dry_run:
        print(f"{PROG}: dry run: a small cache on the CPU, every call form twice")
        skipped(PROG, "the compiled kernel (races show only on a GPU)", "it runs under Triton's CPU interpreter")
        # small sizes in place of the size arguments (still parsed: the GPU check passes the same ones)
        for key, value in (("cases", 6), ("layers", 2), ("kv_heads", 2), ("head_dim", 16), ("smax", 96), ("tree", 24)):
            setattr(args, key, value)
    for key, value in (("cases", 3000 if cuda else 4), ("layers", 36), ("kv_heads", 8), ("head_dim", 128),
                       ("smax", 2048 if cuda else 320), ("tree", 64)):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not cuda:  # before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from dflash_kernels import reference as ref
    from dflash_kernels.kv_compaction import compact_kv_triton

    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    rng = random.Random(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shape = (args.layers, 2, args.kv_heads, args.smax, args.head_dim)
    if args.smax <= args.tree + 1:
        parser.error(f"--smax {args.smax} must exceed --tree {args.tree} + 1")
    pristine = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    kv_kernel = pristine.clone()
    kv_ref = pristine.clone()
    buffer_len = 40  # fixed A of the device-count call form (max path length + slack)

    mismatches = 0
    first_bad = None
    start = time.perf_counter()
    for case in range(args.cases):
        parent = random_tree(rng, args.tree)
        nodes = adversarial_path(rng, case, args.tree) if case % 3 == 0 else random_path(rng, parent)
        prefix = rng.randrange(0, args.smax - args.tree)
        src = [prefix + n for n in nodes]
        n = len(src)
        form = case % 3
        if form == 0:  # host positions, debug checks
            positions, kw = torch.tensor(src, dtype=torch.int64), dict(check=True)
        elif form == 1:  # device positions, trusted
            positions, kw = torch.tensor(src, dtype=torch.int64, device=device), dict(check=False)
        else:  # fixed device buffer, real count on the device, garbage past it
            padded = src + [rng.choice([0, args.smax + 7, -3]) for _ in range(buffer_len - n)]
            positions = torch.tensor(padded[:buffer_len], dtype=torch.int64, device=device)
            kw = dict(check=False, num_rows=torch.tensor([n], device=device))
        compact_kv_triton(kv_kernel, positions, prefix, **kw)
        ref.compact_kv_(kv_ref, torch.tensor(src, dtype=torch.int64, device=device), prefix)
        moved_ok = torch.equal(kv_kernel[:, :, :, prefix:prefix + n], pristine[:, :, :, src])
        if not (moved_ok and torch.equal(kv_kernel, kv_ref)):
            mismatches += 1
            if first_bad is None:
                first_bad = (case, prefix, nodes, form)
        # restore the touched rows (destinations) of both copies
        kv_kernel[:, :, :, prefix:prefix + n].copy_(pristine[:, :, :, prefix:prefix + n])
        kv_ref[:, :, :, prefix:prefix + n].copy_(pristine[:, :, :, prefix:prefix + n])
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    where = f"cuda ({torch.cuda.get_device_name()})" if cuda else "cpu (Triton interpreter)"
    print(f"compaction stress: {args.cases} cases, {mismatches} mismatches "
          f"[cache {list(shape)} {args.dtype}, {where}, {elapsed:.1f} s]")
    report = dict(cases=args.cases, mismatches=mismatches, cache_shape=list(shape), dtype=args.dtype, device=where,
                  seconds=elapsed, seed=args.seed, tree=args.tree, dry_run=args.dry_run, first_mismatch=None)
    if first_bad is not None:
        case, prefix, nodes, form = first_bad
        print(f"first mismatch: case {case}, prefix {prefix}, accepted nodes {nodes}, call form {form}")
        report["first_mismatch"] = dict(case=case, prefix=prefix, accepted_nodes=nodes, call_form=form)
    write_json(default_json(args.json, "gpu_compaction_stress.json"), report)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
