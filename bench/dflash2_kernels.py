"""DFlash2 drafter kernels: launches per drafter layer / per draft, and (on CUDA) time, reference vs fused.

Run: ``python bench/dflash2_kernels.py`` (CPU: launch counts only; Triton runs under its interpreter) or
``python bench/dflash2_kernels.py --device cuda`` (counts and times at drafter shapes).

Workloads (``H`` hidden, ``B`` block, ``K`` taps, ``g`` channels per group):

* ``layer convs``: one DFlash2 drafter layer's conv work around its two sublayers, each
  ``x, d1 = prepare(h); out = finish(f(x), d1, residual)`` with ``f`` the identity (the sublayers
  are the same on both paths and left out); the kernel projection GEMM is in both counts;
  ``train``: the same forward plus the backward of a loss on its output (parameter gradients
  accumulate; the loss ops are in both counts);
* ``selector``: the candidate selector's chain over ``D = B - 1`` positions (greedy and sampling at T = 0.7).

Counts: device kernels a path launches, as torch's dispatcher sees them (every aten op that is not a view
or a metadata op: a kernel launch on a GPU) plus the Triton launches (counted at ``JITFunction.run``,
``InterpretedFunction.run`` under the interpreter). Times: CUDA events around ``--iters`` calls after
warm-up, median of ``--repeats``; speed claims are the ratios of one run.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the Triton path's launches
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import dflash_kernels as dk  # noqa: E402
from dflash.benchmark.launches import LaunchCounter  # noqa: E402
from dflash.drafter.dflash2 import GroupedDynamicCausalConv  # noqa: E402


def _shapes(device: str):
    if device == "cuda":  # a Qwen3-8B-sized drafter: hidden 4096, block 16, 4 taps, 64 channels per group
        return dict(H=4096, B=16, K=4, g=64, V=151936, r=128, k=16, blocks=(1, 64), dtype=torch.bfloat16)
    return dict(H=256, B=16, K=4, g=32, V=1024, r=32, k=8, blocks=(1,), dtype=torch.float32)


def _layer_convs(convs, h, residual):
    out = residual
    for conv in convs:  # attention_conv, mlp_conv
        x, d1 = conv.prepare(h)
        out = conv.finish(x, d1, residual=out)
    return out


def _time(fn, iters: int, repeats: int) -> float:
    """Median microseconds per call (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / iters)
    return sorted(times)[len(times) // 2]


def main(args) -> None:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    s = _shapes(device.type)
    H, B, K, g, dtype = s["H"], s["B"], s["K"], s["g"], s["dtype"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    convs = []
    for _ in range(2):
        conv = GroupedDynamicCausalConv(H, K, g)
        with torch.no_grad():
            conv.base_kernel.normal_(generator=gen)
            conv.kernel_projection.weight.normal_(0, 0.02, generator=gen)
        convs.append(conv.to(device=device, dtype=dtype))
    D, k, r, V = B - 1, s["k"], s["r"], s["V"]
    sel = (torch.randn(D, k, generator=gen).to(device), torch.randint(0, V, (D, k), generator=gen).to(device),
           torch.randn(D, r, generator=gen).to(device, dtype), torch.randn(V, r, generator=gen).to(device, dtype),
           torch.randn(V, r, generator=gen).to(device, dtype), torch.tensor([5], device=device))
    seed = torch.tensor([123], device=device)

    rows = []
    for nb in s["blocks"]:
        h = torch.randn(nb, B, H, generator=gen).to(device, dtype)
        residual = torch.randn(nb, B, H, generator=gen).to(device, dtype)
        rows.append((f"layer convs nb={nb}", lambda h=h, res=residual: _layer_convs(convs, h, res)))
    nb = s["blocks"][-1]
    h_train = torch.randn(nb, B, H, generator=gen).to(device, dtype).requires_grad_()
    res_train = torch.randn(nb, B, H, generator=gen).to(device, dtype).requires_grad_()

    def train_step():
        with torch.enable_grad():
            _layer_convs(convs, h_train, res_train).float().square().sum().backward()

    rows.append((f"layer convs train nb={nb}", train_step))
    rows.append(("selector greedy", lambda: dk.select_candidates(*sel)))
    rows.append(("selector T=0.7", lambda: dk.select_candidates(*sel, 0.7, seed)))

    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU, Triton interpreter'}), "
          f"H={H} B={B} K={K} g={g} D={D} k={k} r={r} V={V} {str(dtype).replace('torch.', '')}")
    header = f"{'workload':<22} {'ref launches':>12} {'fused launches':>15}"
    if device.type == "cuda":
        header += f" {'ref us':>9} {'fused us':>9} {'ref/fused':>9}"
    print(header)
    with torch.no_grad():
        for name, fn in rows:
            counts = {}
            for backend in ("reference", "triton"):
                with dk.force_backend(backend):
                    fn()  # warm (compiles / caches) outside the count
                    with LaunchCounter() as c:
                        fn()
                    counts[backend] = c
            line = (f"{name:<22} {counts['reference'].total:>12} "
                    f"{counts['triton'].total:>9} ({counts['triton'].triton} triton)")
            if device.type == "cuda":
                t = {}
                for backend in ("reference", "triton"):
                    with dk.force_backend(backend):
                        t[backend] = _time(fn, args.iters, args.repeats)
                line += f" {t['reference']:>9.1f} {t['triton']:>9.1f} {t['reference'] / t['triton']:>9.2f}"
            print(line)


if __name__ == "__main__":
    main(ARGS)
