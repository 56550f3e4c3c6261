"""Count the host reads of a piece of code: every call that would make the host wait for a GPU.

:class:`HostReadCounter` is a ``TorchFunctionMode`` that sees every torch call
made from Python (ours and transformers' alike) and counts the ones that
bring device data to the host or block on a host-to-device copy, on tensors
of any device, so that the count taken on CPU tensors is the count the same
code makes on a GPU:

* value reads: ``tolist``, ``item``, ``__bool__``, ``__int__``, ``__float__``,
  ``__index__``, ``cpu``, ``numpy``, ``equal``, ``nonzero`` / ``argwhere``,
  ``unique``, ``masked_select``, ``repeat_interleave`` without ``output_size``,
  indexing with a boolean tensor (its shape depends on the values);
* blocking uploads: ``torch.tensor`` / ``as_tensor`` from Python data
  (a pageable host-to-device copy on a GPU), and ``t[i] = x`` with ``x`` a
  Python number or bool and ``t[i]`` one element (torch copies the value up
  from a CPU scalar tensor: a pageable copy, which a CUDA graph capture
  refuses outright; a slice of several elements is filled on the device).

``reads`` lists ``(name, stack summary)`` per counted call.
"""

from __future__ import annotations

import contextlib
import traceback
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from dflash.decoding.output import StageClock

_VALUE_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "equal",
                "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"}
_UPLOADS = {"tensor", "as_tensor"}


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReadCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = []
        self._depth = 0

    @property
    def count(self) -> int:
        return len(self.reads)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self._depth == 0:
            counted = name in _VALUE_READS or name in _UPLOADS
            if name == "repeat_interleave" and kwargs.get("output_size") is None and isinstance(
                    args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor):
                counted = True
            if name == "__getitem__" and len(args) > 1 and _is_bool_index(args[1]):
                counted = True
            if name == "__setitem__" and len(args) > 2 and not isinstance(args[2], torch.Tensor):
                self._depth += 1
                try:
                    counted = args[0][args[1]].dim() == 0
                finally:
                    self._depth -= 1
            if counted:
                where = [f"{f.filename.rsplit('/', 2)[-2:]}:{f.lineno}" for f in traceback.extract_stack(limit=8)[:-1]]
                self.reads.append((name, where))
        # calls made inside a counted op (e.g. tolist's own element reads) are not counted again
        self._depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._depth -= 1


def reads_per_round(fn, round_end: str):
    """Run ``fn`` under the counter; the reads made between consecutive ends of rounds (and the reads list)."""
    counter = HostReadCounter()
    marks = []
    real_mark = StageClock.mark

    def mark(self, stage):
        real_mark(self, stage)
        if stage == round_end:
            marks.append(counter.count)

    with mock.patch.object(StageClock, "mark", mark), counter:
        fn()
    per_round = [b - a for a, b in zip(marks, marks[1:])]
    worst = max(range(len(per_round)), key=per_round.__getitem__) if per_round else 0
    worst_reads = [(name, where[-3:]) for name, where in counter.reads[marks[worst]:marks[worst + 1]]] if per_round else []
    return per_round, worst_reads, marks


def _check_index(index):
    for i in index if isinstance(index, tuple) else (index,):
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            raise AssertionError("boolean-mask indexing (a data-dependent shape)")


class _NoBoolIndex(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            _check_index(args[1])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Make every way of reading a tensor value on the host raise."""

    def forbid(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"host read of a tensor value: {name}")

        return raiser

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                 "nonzero_static", "masked_select", "unique", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name), raising=False)
    monkeypatch.setattr(torch, "nonzero", forbid("torch.nonzero"))
    monkeypatch.setattr(torch, "masked_select", forbid("torch.masked_select"))
    # indexing is watched through a TorchFunctionMode, not by patching torch.Tensor.__getitem__: setting and
    # deleting __getitem__ on the class leaves CPython's generic sequence slot behind, after which
    # torch.as_tensor([0-d tensor]) takes tensors for sequences (and fails) for the rest of the process
    try:
        with _NoBoolIndex():
            yield
    finally:
        monkeypatch.undo()
