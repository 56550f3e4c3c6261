"""What the target side changes on a model while it is in use, and how every change is undone.

A :class:`Patch` sets one attribute of one object (``config._attn_implementation``,
``config._experts_implementation``, a Gated-DeltaNet module's ``forward``, a model's
``generate``). Patches are held, never applied bare: :func:`hold` applies a list of them
and returns a :class:`Held`, whose :meth:`Held.release` gives them back.

The registry counts holders per ``(object, attribute)``:

* the first holder applies the patch and keeps the value it replaced;
* later holders of the same patch only add a count (nested or overlapping
  adapters on one model: the second one sees the value already in place);
* the last release restores the value the first holder replaced, so after
  every holder is released the object is exactly as it was.

A holder asking for a different value than the one in place is refused
(:class:`PatchConflict`): two open adapters never disagree silently. A
failure part-way through :func:`hold` (a conflict, or an error while
applying) releases what that call had taken before re-raising, so a failed
open leaves nothing behind.

Two kinds of attribute:

* plain (``shadow=False``): read with ``getattr``, written with ``setattr``
  (transformers' config properties propagate to sub-configs), restored with
  ``setattr`` of the old value where the object held it (its ``__dict__`` or
  a property), else by removing the instance entry the patch made;
* shadowing (``shadow=True``): the value goes into the instance's
  ``__dict__``, in front of the class's attribute (a method such as
  ``forward`` or ``generate``); the restore puts the instance's own entry
  back, or removes ours when it had none, so the class's method shows
  through again.

A patch's value is either fixed (``value=``) or computed at apply time from
the value it replaces (``wrap=``: ``wrap(obj, previous) -> new``), for a
dispatcher that calls what it replaced. Two holders of a wrapping patch
agree when their ``wrap`` callables compare equal (the same function, or
bound methods of the same object).

Which patches a model needs is the family table's call
(:attr:`dflash.target.families.Family.patches`); each patch is built next to
the code it installs (:func:`dflash.target.attention.attention_patches`,
:func:`dflash.target.families.experts_patches`,
:func:`dflash.target.hybrid.linear_patches`) and the drop-in's ``generate``
in :mod:`dflash.decoding.hf`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["Held", "Patch", "PatchConflict", "hold", "is_patched", "original", "patched"]

_ABSENT = object()


class PatchConflict(RuntimeError):
    """A holder asked for a value other than the one another open holder put in place."""


@dataclass(frozen=True, eq=False)
class Patch:
    """Set ``obj.<attr>`` while held: to ``value``, or to ``wrap(obj, previous)`` when ``wrap`` is given.

    ``shadow``: the value lives in ``obj.__dict__`` in front of the class's
    attribute (see the module docstring). ``label``: a short name for error
    messages and :func:`patched` (defaults to ``attr``).
    """

    obj: Any
    attr: str
    value: Any = None
    wrap: Optional[Callable[[Any, Any], Any]] = None
    shadow: bool = False
    label: str = ""

    @property
    def key(self) -> Tuple[int, str]:
        return id(self.obj), self.attr

    @property
    def name(self) -> str:
        return self.label or self.attr

    def wants(self) -> Any:
        """What this patch puts in place, for the agreement check (the ``wrap`` itself when it wraps)."""
        return self.wrap if self.wrap is not None else self.value

    def read(self) -> Tuple[Any, Any]:
        """``(value before, what the restore writes back)``, read before the patch is applied.

        The value before is what a read of the attribute gives (``_ABSENT``:
        none). The restore writes it back where the object held it itself (its
        ``__dict__``, or a property of its class); where the object had no entry
        of its own (a class attribute or method shows through, or nothing) the
        restore is ``_ABSENT``: remove the entry the patch made."""
        before = getattr(self.obj, self.attr, _ABSENT)
        own = vars(self.obj)
        if self.shadow:
            return before, own.get(self.attr, _ABSENT)
        if self.attr in own or _is_data_descriptor(type(self.obj), self.attr):
            return before, before
        return before, _ABSENT

    def write(self, value: Any) -> None:
        """Put ``value`` in place (``_ABSENT``: remove the instance's entry)."""
        if self.shadow:
            if value is _ABSENT:
                self.obj.__dict__.pop(self.attr, None)
            else:
                self.obj.__dict__[self.attr] = value
        elif value is _ABSENT:
            if self.attr in vars(self.obj):
                delattr(self.obj, self.attr)
        else:
            setattr(self.obj, self.attr, value)


def _is_data_descriptor(cls, attr: str) -> bool:
    """Whether ``cls`` defines ``attr`` as a data descriptor (a property with a setter: the value is the
    object's own even though its ``__dict__`` has no such key)."""
    for klass in cls.__mro__:
        if attr in vars(klass):
            found = vars(klass)[attr]
            return hasattr(type(found), "__set__")
    return False


@dataclass
class _Entry:
    """One applied patch: the first holder's patch, the value it replaced, what the last release writes back,
    and how many hold it."""

    patch: Patch
    previous: Any
    restore: Any
    count: int = 1


#: (id(obj), attr) -> the applied patch. An entry keeps its object alive, so its id cannot be reused.
_applied: Dict[Tuple[int, str], _Entry] = {}
_lock = threading.RLock()


def _take(patch: Patch) -> None:
    """Hold one patch: apply it (first holder) or count one more holder of the same value."""
    entry = _applied.get(patch.key)
    if entry is not None:
        held, wanted = entry.patch.wants(), patch.wants()
        if not (held is wanted or held == wanted):
            raise PatchConflict(f"{type(patch.obj).__name__}.{patch.attr} is already set to {held!r} by an open "
                                f"{entry.patch.name} patch; this one needs {wanted!r}. Close the other adapter "
                                "(or undo the other drop-in) first")
        entry.count += 1
        return
    previous, restore = patch.read()
    if patch.wrap is not None:
        if previous is _ABSENT:
            raise AttributeError(f"{type(patch.obj).__name__} has no {patch.attr!r} for the {patch.name} patch to "
                                 "wrap")
        new = patch.wrap(patch.obj, previous)  # what calls reached (the class's method when not shadowed)
    else:
        new = patch.value
    patch.write(new)
    _applied[patch.key] = _Entry(patch, previous, restore)


def _give(patch: Patch) -> None:
    """Release one hold of ``patch``; the last one restores the value the first holder replaced."""
    entry = _applied.get(patch.key)
    if entry is None:
        return
    entry.count -= 1
    if entry.count == 0:
        del _applied[patch.key]
        entry.patch.write(entry.restore)


class Held:
    """Patches held by one owner (an open adapter, an applied drop-in); :meth:`release` gives them back once."""

    def __init__(self, patches: Sequence[Patch]):
        self._patches: List[Patch] = list(patches)

    @property
    def patches(self) -> Tuple[Patch, ...]:
        return tuple(self._patches)

    @property
    def released(self) -> bool:
        return not self._patches

    def release(self) -> None:
        """Give every patch back, last taken first (a second call does nothing).

        Every restore is attempted; the first error, if any, is raised after the others ran."""
        with _lock:
            patches, self._patches = self._patches, []
            error = None
            for patch in reversed(patches):
                try:
                    _give(patch)
                except Exception as exc:  # noqa: BLE001 -- keep restoring, report the first failure
                    error = error or exc
            if error is not None:
                raise error

    def __enter__(self) -> "Held":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Held({', '.join(p.name for p in self._patches) or 'released'})"


def hold(patches: Sequence[Patch]) -> Held:
    """Apply ``patches`` in order (counting holders, see the module docstring); returns their :class:`Held`.

    On any error part-way, the patches this call already took are given back
    (last first) and the error is raised: nothing of a failed call stays."""
    taken: List[Patch] = []
    with _lock:
        try:
            for patch in patches:
                _take(patch)
                taken.append(patch)
        except BaseException:
            Held(taken).release()
            raise
    return Held(taken)


def original(obj, attr: str, default: Any = None) -> Any:
    """``obj.<attr>`` as it read before the registry changed it (its current value when not patched;
    ``default`` when there was none)."""
    entry = _applied.get((id(obj), attr))
    if entry is None:
        return getattr(obj, attr, default)
    return default if entry.previous is _ABSENT else entry.previous


def is_patched(obj, attr: str) -> bool:
    """Whether an open holder has ``obj.<attr>`` patched."""
    return (id(obj), attr) in _applied


def patched(obj=None) -> List[Tuple[str, str, int]]:
    """``(object type, attribute, holders)`` of every applied patch (on ``obj`` only when given)."""
    with _lock:
        return [(type(e.patch.obj).__name__, e.patch.attr, e.count) for e in _applied.values()
                if obj is None or e.patch.obj is obj]
