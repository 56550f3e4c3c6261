"""Rolling a Gated-DeltaNet layer back after a chain verify: per-step checkpoints vs replay.

Run: ``python bench/gated_delta_rollback.py`` (one CPU thread; ``--repeat N`` for more rounds).

After a DFlash verify of a block of ``B`` tokens accepts ``a`` drafts, each
linear-attention layer must hold the state after exactly ``a + 1`` tokens.
Two ways:

* (a) **checkpoints**: the verify writes the state after every block position
  (``gated_delta_tree(..., scratch=buf)``), the commit selects ``buf[a]``
  (a device-indexed copy, no host read);
* (b) **replay**: the verify writes no state (``parents=None``, no scratch:
  the state stays in registers), the commit replays rows ``0..a`` from the
  pre-verify state (``gated_delta_replay_``, the count on the device).

Timed here on the CPU with the pure-torch reference backend (Triton has only
its interpreter on a CPU: not a speed path), one thread, a tiny and a mid
shape, for a few accepted counts. The reference replay runs all ``B`` steps
(fixed shapes, the count applied with ``torch.where``), where the Triton
kernel loops only ``a + 1`` rows. The bytes each way moves per layer at
Qwen3.5-27B shapes (Hv = 48, Dk = Dv = 128, fp32 state, bf16 activations;
block 16; tree budget 64; 48 linear layers) are computed analytically and
printed below the timings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import dflash_kernels as dk

SHAPES = {  # name: (Hk, Hv, Dk, Dv)
    "tiny": (2, 4, 32, 32),
    "mid": (4, 12, 128, 128),
}
BLOCK = 16


def make_inputs(hk, hv, dk_, dv, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hk, dk_, generator=gen).bfloat16()
    k = torch.randn(n, hk, dk_, generator=gen).bfloat16()
    v = torch.randn(n, hv, dv, generator=gen).bfloat16()
    g = -F.softplus(torch.randn(n, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(n, hv, generator=gen)).bfloat16()
    state = torch.randn(hv, dk_, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


def checkpoints(inp, accepted, buf):
    """(a): verify storing every position's state, then select the one after ``accepted + 1`` tokens."""
    q, k, v, g, beta, state = inp
    dk.gated_delta_tree(q, k, v, g, beta, state, None, scratch=buf)
    state.copy_(buf.index_select(0, accepted)[0])


def replay(inp, accepted, rows):
    """(b): verify without states, then replay rows 0..accepted from the pre-verify state."""
    q, k, v, g, beta, state = inp
    dk.gated_delta_tree(q, k, v, g, beta, state, None)
    dk.gated_delta_replay_(state, q, k, v, g, beta, rows, accepted + 1)


def timed(fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_cpu(repeat):
    print(f"CPU timings, torch {torch.__version__}, {torch.get_num_threads()} thread, reference backend, "
          f"block {BLOCK}, median of {repeat} (ms per layer per round)")
    print(f"{'shape':<6} {'Hk,Hv,Dk,Dv':<14} {'a':>3} {'(a) checkpoints':>16} {'(b) replay':>11} {'b/a':>6}")
    rows = torch.arange(BLOCK)
    with dk.force_backend("reference"):
        for name, (hk, hv, dk_, dv) in SHAPES.items():
            inp = make_inputs(hk, hv, dk_, dv, BLOCK)
            buf = torch.empty(BLOCK, hv, dk_, dv)
            base = inp[-1].clone()
            for a in (0, 7, 15):
                acc = torch.tensor([a])

                def run_a():
                    inp[-1].copy_(base)
                    checkpoints(inp, acc, buf)

                def run_b():
                    inp[-1].copy_(base)
                    replay(inp, acc, rows)

                ta, tb = timed(run_a, repeat), timed(run_b, repeat)
                print(f"{name:<6} {f'{hk},{hv},{dk_},{dv}':<14} {a:>3} {ta * 1e3:>16.3f} {tb * 1e3:>11.3f} "
                      f"{tb / ta:>6.2f}")


def ddtree_tree_stats(budget=64, depth=BLOCK - 1, k=8, seed=0, sharpness=3.0):
    """A DDTree-shaped tree (root + ``budget`` nodes from the C++ builder, random draft logits):
    ``(reload sources, reloads, nodes, path rows at most)``. A reload is a node ``i > 0`` whose parent is
    not ``i - 1`` (the kernel reads its parent's slice back); its parent is a reload source (stored)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, 256, generator=gen) * sharpness
    top = torch.log_softmax(logits, -1).topk(k, dim=-1)
    _, _, parents, _ = dk.build_tree(top.values, top.indices, budget)
    par = parents.tolist()
    sources = {p for i, p in enumerate(par) if p >= 0 and p != i - 1}
    reloads = sum(1 for i, p in enumerate(par) if i > 0 and p != i - 1)
    return len(sources), reloads, len(par), max(_depths(par)) + 1


def _depths(par):
    depth = []
    for p in par:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def bytes_table():
    hk, hv, dk_, dv, layers, budget = 16, 48, 128, 128, 48, 64
    state = hv * dk_ * dv * 4
    row = hk * dk_ * 2 + hv * dv * 2 + hv * 4 + hv * 2  # k, v (bf16), g (fp32), beta (bf16) of one row
    mib = lambda b: b / 2 ** 20  # noqa: E731
    print()
    print(f"Bytes per linear layer at Qwen3.5-27B shapes (Hk={hk}, Hv={hv}, Dk=Dv={dk_}, fp32 state = "
          f"{mib(state):.0f} MiB; one accepted row of k/v/g/beta = {row / 1024:.1f} KiB); "
          f"x{layers} layers per round")
    print("state traffic only (q/k/v/g/beta reads of the verify itself are the same for both):")
    lines = []
    # chain, block 16: (a) verify reads S, writes B states; commit copies one (read + write)
    a_chain = state + BLOCK * state + 2 * state
    # (b) verify reads S (kept in registers, nothing written); replay reads S, writes S, reads a+1 rows
    b_chain = lambda a: state + 2 * state + (a + 1) * row  # noqa: E731
    lines.append(("chain B=16, (a) checkpoints, any a", a_chain))
    lines.append(("chain B=16, (b) replay, a=0", b_chain(0)))
    lines.append(("chain B=16, (b) replay, a=15", b_chain(15)))
    notes = []
    for label, sharpness in (("flat", 3.0), ("peaked", 12.0)):
        sources, reloads, n_nodes, max_depth = ddtree_tree_stats(budget, sharpness=sharpness)
        # (a): every node's state stored, every reload read back, the walk's last node selected (copy)
        a_tree = state + n_nodes * state + reloads * state + 2 * state
        # (b): only the reload sources stored ("branches"), the same reloads, the path replayed
        b_tree = state + sources * state + reloads * state + 2 * state + max_depth * row
        lines.append((f"tree N={n_nodes} {label}, (a) all {n_nodes} states stored + select", a_tree))
        lines.append((f"tree N={n_nodes} {label}, (b) {sources} reload sources stored + replay", b_tree))
        notes.append(f"{label} (logits x{sharpness:g}): {reloads} nodes reload their parent, {sources} distinct "
                     f"parents, paths <= {max_depth} rows")
    print(f"  {'way':<58} {'MiB/layer':>10} {'MiB/round':>10}")
    for what, b in lines:
        print(f"  {what:<58} {mib(b):>10.1f} {mib(b) * layers:>10.0f}")
    print(f"  trees: DDTree (C++ builder) of budget {budget}, depth <= {BLOCK - 1}, top-8 of random draft logits, "
          "seed 0; " + "; ".join(notes) + ".")
    print("  Every reload is counted as a full state read (an upper bound: the parent's slice was just written\n"
          "  by the same CTA and may still be in L2).")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench_cpu(args.repeat)
    bytes_table()


if __name__ == "__main__":
    main()
