"""Gather + concat of captured layer hidden states in one Triton launch.

Math (shapes: n layers of ``[T, H]``, R selected rows)::

    out[r, i*H:(i+1)*H] = layers[i][rows[r], :]          out: [R, n*H]

The kernel reads every layer through a small int64 *pointer table* of
``(data_ptr, row_stride)`` pairs, one per layer, so a single launch covers all
layers and rows whatever their count, and each layer may be a view with its
own row stride (unit stride in the last dim). The table is plain memory, so
this works both compiled and under Triton's CPU interpreter (which runs CPU
tensors at their real addresses). ``out`` may be a row slice of a larger
preallocated buffer: its row stride is honoured.

Launch: grid ``(cdiv(R, BLOCK_R), n, cdiv(H, BLOCK_H))``; every program copies
a ``[BLOCK_R, BLOCK_H]`` tile of one layer. The copy is pure data movement (no
arithmetic), so it is exact in every dtype.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ._dispatch import get_backend
from .reference import gather as _reference
from .reference.gather import RowsLike, check_gather_args

__all__ = ["gather_concat"]

try:  # triton is optional: without it every op runs the reference
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


# Elements copied by one program: a few KB keeps many programs in flight and
# gives every thread 16-byte vectors (4 warps x 32 lanes x 8 bf16 = 1024).
_TILE_ELEMENTS = 2048
_MAX_BLOCK_H = 1024
_MIN_BLOCK_H = 16


def gather_config(hidden: int) -> dict:
    """Launch config for hidden size ``hidden``: BLOCK_R, BLOCK_H, num_warps."""
    block_h = min(_MAX_BLOCK_H, max(_MIN_BLOCK_H, next_power_of_2(hidden)))
    block_r = max(1, _TILE_ELEMENTS // block_h)
    return {"BLOCK_R": block_r, "BLOCK_H": block_h, "num_warps": 4}


if triton is not None:

    @triton.jit
    def _gather_concat_kernel(
        table_ptr,  # int64 [n, 2]: (data_ptr, row stride in elements) per layer
        rows_ptr,  # int64 [R] source row of every output row (unused without HAS_ROWS)
        out_ptr,  # [R, n*H], unit stride in the last dim
        R,
        H,
        stride_out,
        HAS_ROWS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        pid_r = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1).to(tl.int64)
        pid_h = tl.program_id(2).to(tl.int64)
        src_base = tl.load(table_ptr + 2 * layer).to(tl.pointer_type(out_ptr.dtype.element_ty))
        src_stride = tl.load(table_ptr + 2 * layer + 1)

        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        r_mask = r < R
        if HAS_ROWS:
            src_row = tl.load(rows_ptr + r, mask=r_mask, other=0)
        else:
            src_row = r
        h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = r_mask[:, None] & (h < H)[None, :]
        vals = tl.load(src_base + src_row[:, None] * src_stride + h[None, :], mask=mask)
        tl.store(out_ptr + r[:, None] * stride_out + layer * H + h[None, :], vals, mask=mask)


def launch_configs(hidden_sizes=(48, 2560, 4096), dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> List[dict]:
    """Every distinct launch of this module's kernel for the given model shapes.

    Each entry: ``kernel``, ``signature`` (Triton type strings by arg name),
    ``constexprs``, ``num_warps``, ``num_stages``, ``name``: what
    ``tests/gpu_compile.compile_for_gpu`` takes. Built from :func:`gather_config`,
    the same function the launcher uses.
    """
    if triton is None:
        return []
    seen, out = set(), []
    for hidden in hidden_sizes:
        cfg = gather_config(hidden)
        for dtype in dtypes:
            for has_rows in (False, True):
                key = (cfg["BLOCK_R"], cfg["BLOCK_H"], dtype, has_rows)
                if key in seen:
                    continue
                seen.add(key)
                out.append({
                    "name": f"gather_concat[{_triton_type(dtype)} rows={has_rows} R{cfg['BLOCK_R']}xH{cfg['BLOCK_H']}]",
                    "kernel": _gather_concat_kernel,
                    "signature": {"table_ptr": "*i64", "rows_ptr": "*i64", "out_ptr": "*" + _triton_type(dtype),
                                  "R": "i32", "H": "i32", "stride_out": "i32"},
                    "constexprs": {"HAS_ROWS": has_rows, "BLOCK_R": cfg["BLOCK_R"], "BLOCK_H": cfg["BLOCK_H"]},
                    "num_warps": cfg["num_warps"],
                    "num_stages": 1,
                })
    return out


def _triton_type(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
            torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
            torch.bool: "i1"}[dtype]


def _gather_concat_triton(layers: list, rows: Optional[torch.Tensor], out: torch.Tensor, R: int) -> torch.Tensor:
    n = len(layers)
    T, H = layers[0].shape
    device = layers[0].device
    if R == 0:
        return out
    table = torch.tensor([[layer.data_ptr(), layer.stride(0)] for layer in layers], dtype=torch.int64)
    table = table.to(device, non_blocking=True)
    cfg = gather_config(H)
    grid = (triton.cdiv(R, cfg["BLOCK_R"]), n, triton.cdiv(H, cfg["BLOCK_H"]))
    rows_arg = rows if rows is not None else table  # any int64 pointer; never read without HAS_ROWS
    _gather_concat_kernel[grid](
        table, rows_arg, out, R, H, out.stride(0),
        HAS_ROWS=rows is not None, BLOCK_R=cfg["BLOCK_R"], BLOCK_H=cfg["BLOCK_H"], num_warps=cfg["num_warps"],
    )
    return out


def gather_concat(layers, rows: RowsLike = None, out: Optional[torch.Tensor] = None, *,
                  check_bounds: bool = True) -> torch.Tensor:
    """Concatenate the selected rows of ``n`` layers: ``[R, n*H]``.

    Args:
        layers: sequence of ``n`` tensors ``[T, H]``, same shape, dtype and
            device; views are fine if the last dim has unit stride.
        rows: None (all T rows, in order), or ``R`` row indices (int tensor or
            list) with ``0 <= rows[r] < T``; a bad index is an ``IndexError``
            that names it.
        out: optional ``[R, n*H]`` buffer of the layers' dtype (any row
            stride, e.g. a row slice of a preallocated buffer); written and
            returned.
        check_bounds: set False in a hot loop to skip the range check of
            ``rows`` (one device->host sync); indices must then be valid.

    Returns:
        ``out[r] = cat_i layers[i][rows[r]]``. One Triton launch for all layers
        and rows on the Triton backend; the reference otherwise.
    """
    layers, rows, R = check_gather_args(layers, rows, out, check_bounds=check_bounds)
    if get_backend(layers[0].device) == "reference":
        return _reference.gather_concat(layers, rows, out, check_bounds=False)
    H = layers[0].shape[1]
    if out is None:
        out = torch.empty(R, len(layers) * H, dtype=layers[0].dtype, device=layers[0].device)
    return _gather_concat_triton(layers, rows, out, R)
