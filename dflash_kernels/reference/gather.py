"""Reference gather + concat of captured layer hidden states (pure torch).

The context feature of token ``t`` is the concatenation, along the hidden
dimension, of its hidden states at the selected target layers::

    out[r] = concat_i layers[i][rows[r]]          out: [R, n * H]

``layers`` is a sequence of ``n`` tensors ``[T, H]`` (same T, H, dtype and
device); ``rows`` selects R of the T rows (``None``: all of them, in order).

The argument checks live here too (:func:`check_gather_args`), so that the
reference and the Triton launcher accept exactly the same inputs and fail with
the same messages.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["gather_concat"]

RowsLike = Union[None, torch.Tensor, Sequence[int]]


def check_rows(rows: RowsLike, num_rows: int, device: torch.device, *, what: str = "rows",
               check_bounds: bool = True) -> Optional[torch.Tensor]:
    """Validate row indices and return them as a 1-D int64 tensor on ``device``.

    ``rows`` may be None (meaning all rows), a Python sequence of ints or an
    integer tensor of any shape that flattens to 1-D. Every index must satisfy
    ``0 <= index < num_rows`` (negative indices are rejected, not wrapped);
    the error names the first bad index and its value. ``check_bounds=False``
    skips that range check (it costs one device->host sync on CUDA).
    """
    if rows is None:
        return None
    if not isinstance(rows, torch.Tensor):
        try:
            rows = torch.as_tensor(list(rows), dtype=torch.int64)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{what} must be None, an integer tensor or a sequence of ints; "
                            f"got {type(rows).__name__}") from exc
        if rows.numel() == 0:
            rows = rows.reshape(0)
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
        raise TypeError(f"{what} must hold integers (int64 preferred), got dtype {rows.dtype}")
    if rows.dim() != 1:
        raise ValueError(f"{what} must be a 1-D tensor of row indices, got shape {tuple(rows.shape)}")
    if rows.device != device:
        if rows.device.type == "cpu":
            rows = rows.to(device)
        else:
            raise ValueError(f"{what} is on {rows.device} but the data is on {device}")
    rows = rows.to(torch.int64)
    if check_bounds and rows.numel() > 0:
        bad = (rows < 0) | (rows >= num_rows)
        if bool(bad.any()):
            where = int(bad.nonzero()[0, 0])
            raise IndexError(
                f"{what}[{where}] = {int(rows[where])} is out of range: valid row indices are 0..{num_rows - 1} "
                f"({num_rows} rows)"
            )
    return rows.contiguous()


def _byte_ranges_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the memory spans of ``a`` and ``b`` (first to last element, same storage) intersect.

    Metadata only (storage pointers, offsets, strides): no tensor value is read.
    """
    if a.device != b.device or a.device.type == "meta":  # meta tensors have no memory to share
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        start = t.data_ptr()
        last = start + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size()
        return start, last + t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def check_gather_args(layers, rows: RowsLike, out: Optional[torch.Tensor], *,
                      check_bounds: bool = True) -> Tuple[list, Optional[torch.Tensor], int]:
    """Validate the arguments of :func:`gather_concat`.

    Returns ``(layers as a list, rows as int64 tensor or None, R)``.
    """
    if isinstance(layers, torch.Tensor):
        raise TypeError("layers must be a sequence of [T, H] tensors (a list or tuple), not a single tensor; "
                        "for a stacked [n, T, H] tensor pass list(stacked)")
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty: gather_concat needs at least one [T, H] tensor")
    first = layers[0]
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.Tensor):
            raise TypeError(f"layers[{i}] is a {type(layer).__name__}, expected a torch.Tensor")
        if layer.dim() != 2:
            raise ValueError(f"layers[{i}] must be 2-D [T, H], got shape {tuple(layer.shape)}")
        if layer.shape != first.shape:
            raise ValueError(f"layers[{i}] has shape {tuple(layer.shape)} but layers[0] has {tuple(first.shape)}; "
                             "all layers must share [T, H]")
        if layer.dtype != first.dtype:
            raise TypeError(f"layers[{i}] has dtype {layer.dtype} but layers[0] has {first.dtype}; all must match")
        if layer.device != first.device:
            raise ValueError(f"layers[{i}] is on {layer.device} but layers[0] is on {first.device}")
        if layer.shape[1] > 1 and layer.stride(1) != 1:
            raise ValueError(f"layers[{i}] must have unit stride in its last dim (got strides "
                             f"{tuple(layer.stride())}); row-strided views are fine, otherwise call .contiguous()")
    T, H = first.shape
    if H == 0:
        raise ValueError("layers have hidden size 0; nothing to concatenate")
    rows = check_rows(rows, T, first.device, check_bounds=check_bounds)
    R = T if rows is None else rows.numel()
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        want = (R, len(layers) * H)
        if tuple(out.shape) != want:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected [R, n*H] = {list(want)}")
        if out.dtype != first.dtype:
            raise TypeError(f"out has dtype {out.dtype}, expected the layers' dtype {first.dtype}")
        if out.device != first.device:
            raise ValueError(f"out is on {out.device} but the layers are on {first.device}")
        if R > 0 and out.stride(1) != 1:
            raise ValueError(f"out must have unit stride in its last dim (a row slice of a buffer is fine); "
                             f"got strides {tuple(out.stride())}")
        for i, layer in enumerate(layers):
            if R > 0 and _byte_ranges_meet(out, layer):
                raise ValueError(f"out shares memory with layers[{i}]: the gather would read what it writes; "
                                 "pass an out buffer of its own")
    return layers, rows, R


def gather_concat(layers, rows: RowsLike = None, out: Optional[torch.Tensor] = None, *,
                  check_bounds: bool = True) -> torch.Tensor:
    """``out[r] = cat([layer[rows[r]] for layer in layers])``; shape ``[R, n * H]``.

    Reference semantics: ``torch.cat`` of the (row-selected) layers along the
    last dim, written into ``out`` when given (any row stride) and returned.
    """
    layers, rows, R = check_gather_args(layers, rows, out, check_bounds=check_bounds)
    H = layers[0].shape[1]
    if out is None:
        out = torch.empty(R, len(layers) * H, dtype=layers[0].dtype, device=layers[0].device)
    for i, layer in enumerate(layers):
        out[:, i * H:(i + 1) * H].copy_(layer if rows is None else layer.index_select(0, rows))
    return out
