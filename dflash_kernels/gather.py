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

Launch: grid ``(cdiv(R, BLOCK_R), layers in this launch, cdiv(H, BLOCK_H))``; every program copies
a ``[BLOCK_R, BLOCK_H]`` tile of one layer. The copy is pure data movement (no
arithmetic), so it is exact in every dtype. The row count ``R`` (``a + 1``
accepted rows per DFlash round) is ``do_not_specialize``: no recompiles as it
varies.

Loads and stores never overlap: the kernel reads the layers and ``rows``,
writes only ``out``, and the launcher refuses an ``out`` that shares memory
with a layer (``check_gather_args``); each output element is written by the
one program owning its (row tile, layer, column tile), once.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from torch import Tensor

from ._declare import declare, dispatch
from .reference import gather as _reference
from .reference.gather import RowsLike, check_gather_args

__all__ = ["gather_concat"]


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


def runtime_int_specialization(values: Dict[str, int], do_not_specialize: Iterable[str] = ()
                               ) -> Tuple[Dict[str, str], List[str], Dict[str, int]]:
    """What the Triton runtime makes of integer kernel arguments with these values.

    Returns ``(types, divisible, ones)``: ``types`` maps each name to
    ``"i32"`` or ``"i64"`` (by range), ``divisible`` lists the names whose
    value is a multiple of 16 (marked ``tt.divisibility = 16``), ``ones`` maps
    the names whose value is 1 to 1 (the runtime compiles those as
    constexprs). Names in ``do_not_specialize`` get neither mark. The GPU
    compile tests build exactly that binary: the one that runs.
    """
    dns = set(do_not_specialize)
    types, divisible, ones = {}, [], {}
    for name, value in values.items():
        value = int(value)
        if name not in dns and value == 1:
            ones[name] = 1
            continue
        types[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        if name not in dns and value % 16 == 0:
            divisible.append(name)
    return types, divisible, ones


#: Integer kernel arguments that vary per call: never specialized.
DO_NOT_SPECIALIZE = ("R",)

#: Layers one launch reads (address + row stride arguments each).
MAX_LAYERS_PER_LAUNCH = 8



# R (rows gathered: a + 1 accepted rows in DFlash, a varies per round) must not recompile
@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def _gather_concat_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7,  # int64 data_ptr of the launch's layers (unused slots repeat p0)
    s0, s1, s2, s3, s4, s5, s6, s7,  # their row strides in elements
    rows_ptr,  # int64 [R] source row of every output row (unused without HAS_ROWS)
    out_ptr,  # [R, n*H] (this launch's first column block), unit stride in the last dim
    R,
    H,
    stride_out,
    HAS_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address 16-byte aligned and every row stride a multiple of 16 bytes
):
    pid_r = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    pid_h = tl.program_id(2).to(tl.int64)
    address = tl.where(layer == 0, p0, tl.where(layer == 1, p1, tl.where(layer == 2, p2, tl.where(
        layer == 3, p3, tl.where(layer == 4, p4, tl.where(layer == 5, p5, tl.where(layer == 6, p6, p7)))))))
    src_stride = tl.where(layer == 0, s0, tl.where(layer == 1, s1, tl.where(layer == 2, s2, tl.where(
        layer == 3, s3, tl.where(layer == 4, s4, tl.where(layer == 5, s5, tl.where(layer == 6, s6, s7)))))))
    src_base = address.to(tl.int64).to(tl.pointer_type(out_ptr.dtype.element_ty))
    if ALIGNED:  # the hints a pointer argument would carry: 16-byte vectors on every row
        src_base = tl.multiple_of(src_base, 16)
        src_stride = tl.multiple_of(src_stride, 128 // out_ptr.dtype.element_ty.primitive_bitwidth)

    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    r_mask = r < R
    if HAS_ROWS:
        src_row = tl.load(rows_ptr + r, mask=r_mask, other=0)
    else:
        src_row = r
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = r_mask[:, None] & (h < H)[None, :]
    vals = tl.load(src_base + src_row[:, None] * src_stride.to(tl.int64) + h[None, :], mask=mask)
    tl.store(out_ptr + r[:, None] * stride_out + layer.to(tl.int64) * H + h[None, :], vals, mask=mask)


#: (hidden size, captured layers) of real targets: the tiny test pair, Qwen3-4B, Qwen3-8B.
REAL_GATHER_SHAPES = ((48, 2), (2560, 5), (4096, 5))


def launch_configs(shapes=REAL_GATHER_SHAPES, dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> List[dict]:
    """Every distinct launch of this module's kernel for the given model shapes.

    ``shapes`` holds ``(H, n layers)`` pairs (a bare int is ``(H, 5)``). Each
    entry: ``kernel``, ``signature`` (Triton type strings by arg name),
    ``constexprs``, ``num_warps``, ``num_stages``, ``divisible_by_16``,
    ``name``: what ``tests/gpu_compile.compile_for_gpu`` takes. Built from
    :func:`gather_config`, the same function the launcher uses, and from the
    integer arguments' values at that shape as the Triton runtime specializes
    them (:func:`runtime_int_specialization`): ``H`` and ``stride_out =
    n * H`` get ``divisible_by_16`` when they are multiples of 16; ``R`` is
    ``do_not_specialize`` (its value here is only a stand-in).
    """
    seen, out = set(), []
    for shape in shapes:
        hidden, n_layers = (shape, 5) if isinstance(shape, int) else shape
        cfg = gather_config(hidden)
        # addresses: aligned activations (multiples of 16); strides: H (captured [T, H] outputs)
        ints = {"R": 16, "H": hidden, "stride_out": n_layers * hidden}
        ints.update({f"p{i}": 1 << 20 for i in range(MAX_LAYERS_PER_LAUNCH)})
        ints.update({f"s{i}": hidden for i in range(MAX_LAYERS_PER_LAUNCH)})
        types, divisible, ones = runtime_int_specialization(ints, DO_NOT_SPECIALIZE)
        slots = range(MAX_LAYERS_PER_LAUNCH)
        stride_types = {f"s{i}": types.pop(f"s{i}") for i in slots}
        for i in slots:
            types.pop(f"p{i}")
        for dtype in dtypes:
            for has_rows in (False, True):
                key = (cfg["BLOCK_R"], cfg["BLOCK_H"], dtype, has_rows, tuple(divisible), tuple(sorted(ones)))
                if key in seen:
                    continue
                seen.add(key)
                div_tag = ",".join(divisible) or "none"
                out.append({
                    "name": (f"gather_concat[{_triton_type(dtype)} rows={has_rows} R{cfg['BLOCK_R']}xH{cfg['BLOCK_H']}"
                             f" div16={div_tag}]"),
                    "kernel": _gather_concat_kernel,
                    "signature": dict({f"p{i}": "i64" for i in range(MAX_LAYERS_PER_LAUNCH)},
                                      **{f"s{i}": stride_types[f"s{i}"] for i in range(MAX_LAYERS_PER_LAUNCH)},
                                      **{"rows_ptr": "*i64", "out_ptr": "*" + _triton_type(dtype)}, **types),
                    "constexprs": dict({"HAS_ROWS": has_rows, "BLOCK_R": cfg["BLOCK_R"], "BLOCK_H": cfg["BLOCK_H"],
                                        "ALIGNED": hidden * dtype.itemsize % 16 == 0}, **ones),
                    "num_warps": cfg["num_warps"],
                    "num_stages": 1,
                    "divisible_by_16": divisible,
                    "do_not_specialize": list(DO_NOT_SPECIALIZE),
                })
    return out


def _triton_type(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
            torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
            torch.bool: "i1"}[dtype]


def _gather_concat_triton(layers: list, rows: Optional[torch.Tensor], out: torch.Tensor, R: int) -> torch.Tensor:
    n = len(layers)
    T, H = layers[0].shape
    if R == 0:
        return out
    cfg = gather_config(H)
    rows_arg = rows if rows is not None else out  # any pointer; never read without HAS_ROWS
    for first in range(0, n, MAX_LAYERS_PER_LAUNCH):
        group = layers[first:first + MAX_LAYERS_PER_LAUNCH]
        addresses = [layer.data_ptr() for layer in group]
        strides = [layer.stride(0) for layer in group]
        pad = MAX_LAYERS_PER_LAUNCH - len(group)
        item = group[0].element_size()
        aligned = all(a % 16 == 0 for a in addresses) and all((st * item) % 16 == 0 for st in strides)
        grid = (triton.cdiv(R, cfg["BLOCK_R"]), len(group), triton.cdiv(H, cfg["BLOCK_H"]))
        _gather_concat_kernel[grid](
            *addresses, *[addresses[0]] * pad, *strides, *[strides[0]] * pad,
            rows_arg, out[:, first * H:], R, H, out.stride(0),
            HAS_ROWS=rows is not None, BLOCK_R=cfg["BLOCK_R"], BLOCK_H=cfg["BLOCK_H"], ALIGNED=aligned,
            num_warps=cfg["num_warps"],
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
            With False no tensor value is read on the host at all.

    Returns:
        ``out[r] = cat_i layers[i][rows[r]]``. One Triton launch for all layers
        and rows on the Triton backend; the reference otherwise.
    """
    layers, rows, R = check_gather_args(layers, rows, out, check_bounds=check_bounds)

    def traced():  # one opaque node (the launcher reads the layers' data pointers on the host)
        if out is None:
            return torch.ops.dflash.gather_concat.default(layers, rows, False)
        torch.ops.dflash.gather_concat.into(layers, out, rows, False)
        return out

    def triton_path():
        H = layers[0].shape[1]
        buffer = out if out is not None else torch.empty(R, len(layers) * H, dtype=layers[0].dtype,
                                                         device=layers[0].device)
        return _gather_concat_triton(layers, rows, buffer, R)

    return dispatch(None, layers[0].device, traced=traced, triton=triton_path,
                    reference=lambda: _reference.gather_concat(layers, rows, out, check_bounds=False))


@declare("gather_concat", fake=lambda a: a.layers[0].new_empty(
    a.layers[0].shape[0] if a.rows is None else a.rows.shape[0], len(a.layers) * a.layers[0].shape[1]))
def _gather_concat_op(layers: List[Tensor], rows: Optional[Tensor] = None, check_bounds: bool = True) -> Tensor:
    """:func:`gather_concat` into a new ``[R, n*H]`` tensor."""
    return gather_concat(layers, rows, None, check_bounds=check_bounds)


@declare("gather_concat.into", mutates={"out"}, fake=lambda a: None)
def _gather_concat_into_op(layers: List[Tensor], out: Tensor, rows: Optional[Tensor] = None,
                           check_bounds: bool = True) -> None:
    """:func:`gather_concat` with ``out=``: writes the ``[R, n*H]`` buffer ``out`` (any row stride) in place;
    returns nothing (the caller holds ``out``)."""
    gather_concat(layers, rows, out, check_bounds=check_bounds)
