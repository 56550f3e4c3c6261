"""``generate(..., compile=True)``: the rounds' fixed-shape steps compiled as whole graphs (CUDA graphs on a GPU).

At batch 1 an eager round is launch- and Python-bound: every layer is tens of
small ops. Here the draft and verify steps of :class:`~dflash.decoding.round.Round`
(functions of fixed-shape device tensors only, the same steps eager
generation calls) are traced once by
``torch.compile(fullgraph=True, dynamic=False)``; on CUDA each compiled step
is then captured in a ``torch.cuda.CUDAGraph`` (the verify step once per budget bucket) and a round is two
graph replays plus the one host read of its payload.

Set-up, all before the generation's clock starts (its seconds go to
``result.compile_time``, never into ``total_time`` or tokens/s):

1. a :class:`~dflash.decoding.round.Round` for the settings (method, block size, budget,
   sampling mode, dtypes, device, batch) comes from a pool on the target
   model: the smallest pooled round of these settings whose caches hold the
   call's rows, so a later generation that fits reuses its buffers, its
   compiled code and its graphs; else a new one whose two caches hold the
   next power of two of rows (:func:`compiled_rows`: at least 256, one bucket
   for both sides), or the rows reserved by ``max_cache_len``
   (:func:`reserved_rows`; the drop-in's ``"auto"`` on CUDA: the target's
   ``max_position_embeddings``, capped by a quarter of the free memory) if
   more. A growing sequence of calls thus compiles once with a reservation,
   at most ``log2`` of its growth times without. Cost of the rows: memory
   (at most twice the need without a reservation); on CUDA the Triton
   attention reads only the committed rows, but the reference attention (the
   CPU) attends over every row of the cache, so its rounds cost as if the
   cache were full (hence no reservation by default there);
2. a new entry is warmed up: its caches are frozen at length 0, each step
   runs twice (the first call compiles), on CUDA the steps are captured, then
   the state is put back and the caches thawed for the eager prefill.

The pool is an LRU of at most :data:`POOL_CAPACITY` entries per target (4,
or ``DFLASH_COMPILED_POOL_SIZE`` in the environment at import): an entry
holds two caches, its compiled code and, on CUDA, two captured graphs and
their memory pool. The entry used least recently is evicted when a new one
would exceed it: its graphs are reset, its compiled code dropped and its
buffers released (to torch's caching allocator). The caches of all entries
on a target share storage where the shapes allow: one flat buffer per side
(target / drafter), layer count, head count, head dim, dtype and device,
allocated at the largest bucket asked for so far, which every smaller
bucket views (a larger bucket allocates a new buffer; the old one goes with
the last entry that views it). Entries that share a buffer never run at
once: a generation holds its entry (and its buffers) until it ends, and a
compiled generation that would need an entry or a buffer another running
generation holds is refused (one compiled generation at a time per target
and buffer).

A budget chosen per round (``tree_budget="auto"``) adds the measurement of
each bucket's seconds to the set-up, once per settings
(:mod:`dflash.decoding.bucket_costs`).

A target that cannot be traced as one graph raises :class:`CompileUnsupported`
naming the cause (run it with ``compile=False``, the default and the
reference; the class and the toolchain diagnosis live in
:mod:`dflash.decoding.compile_diagnosis`). Hybrid targets compile too: their linear-attention layers' verify
and replay are ops with fake implementations, their states device tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
import types
import warnings
import weakref
from collections import OrderedDict
from typing import List, Optional

import torch

from ..drafter.cache import DraftKVCache
from ..target.output_hooks import inert_output_hooks
from .bucket_costs import attach_budget_policy, costs_key
from .compile_diagnosis import CompileUnsupported, unsupported
from .options import RoundShape
from .round import Round, bucket_rows, cache_rows

__all__ = ["COMPILE_MODES", "CompileUnsupported", "MIN_ROWS", "POOL_CAPACITY", "RoundSteps", "batch_bucket",
           "check_max_cache_len", "compiled_rows", "lease_round", "reserved_rows"]

#: ``compile=`` values: False (the round's steps called eagerly, a fresh round per generation: the default),
#: True / "compile" (torch.compile; CUDA graphs on CUDA), "static" (the pooled round of a compiled generation,
#: its steps called eagerly: what the compiled graphs compute, for tests and comparisons)
COMPILE_MODES = (False, True, "compile", "static")


def _capacity_from_env(default: int = 4) -> int:
    text = os.environ.get("DFLASH_COMPILED_POOL_SIZE")
    if text is None:
        return default
    try:
        value = int(text)
        if value < 1:
            raise ValueError
    except ValueError:
        warnings.warn(f"DFLASH_COMPILED_POOL_SIZE must be an int >= 1, got {text!r}; using {default}")
        return default
    return value


#: the most compiled-round settings pooled per target model (an LRU; each entry holds its caches, compiled
#: code and, on CUDA, two graphs); ``DFLASH_COMPILED_POOL_SIZE`` in the environment at import, else 4.
#: Read at each insertion, so it may also be set at run time.
POOL_CAPACITY = _capacity_from_env()


#: ``torch.compile`` keywords of the steps (tests trace with ``backend="eager"`` to count graph breaks cheaply).
#: On the CPU inductor's C++ wrapper replaces the Python one: a round's graph is ~100 kernel and GEMM calls, and
#: calling them from Python costs as much as the tiny pair's arithmetic.
COMPILE_OPTIONS = dict(backend="inductor")

def _compile_kwargs(device: torch.device) -> dict:
    kw = dict(COMPILE_OPTIONS)
    if kw.get("backend") == "inductor" and device.type == "cpu":
        kw["options"] = {"cpp_wrapper": True, **kw.get("options", {})}
    kw["options"] = {**kw.get("options", {}), "guard_filter_fn": _round_guards}
    return kw


#: the guards a compiled step keeps: its non-parameter tensors' (the round's state and caches: dtype, device,
#: shape, strides), the symbolic sizes' and the global state's
_KEPT_GUARDS = frozenset({"TENSOR_MATCH", "SHAPE_ENV", "GRAD_MODE", "GLOBAL_STATE", "DEFAULT_DEVICE",
                          "DETERMINISTIC_ALGORITHMS", "TORCH_FUNCTION_STATE", "AUTOGRAD_SAVED_TENSORS_HOOKS"})


def _round_guards(entries) -> list:
    """Dynamo's guard filter for the steps: which guards each call checks before running the graph.

    A step is compiled once per pool entry, whose key holds everything its Python state is made of (the
    settings, and :func:`structure_stamp` of the target and the drafter: every module's and parameter's
    identity, dtype and shape), so the guards on that state (hundreds: module types, attribute presence,
    constants, hooks dicts, each checked on every call) can only ever pass; a change they would have caught
    makes a new entry instead. Parameters are graph inputs read
    from the modules each call, so new values (a reload) run in the same graph."""
    return [e.guard_type in _KEPT_GUARDS and not (e.guard_type == "TENSOR_MATCH"
                                                   and isinstance(e.value, torch.nn.Parameter)) for e in entries]


def structure_stamp(*module_lists) -> int:
    """A hash of what a compiled round's graphs assume of the models whose ``modules()`` are given (None
    entries skipped): each module's identity and type, each parameter's and buffer's identity, dtype, shape
    and device. A module replaced (a quantizer, an adapter), a parameter re-made or moved changes it."""
    parts = []
    for modules in module_lists:
        if modules is None:
            continue
        for module in modules:
            parts.append((id(module), type(module)))
            for t in itertools.chain(module._parameters.values(), module._buffers.values()):
                if t is not None:
                    parts.append((id(t), t.dtype, tuple(t.shape), t.device))
    return hash(tuple(parts))


_copies = itertools.count()


def _compiled(fn, device: torch.device):
    """``torch.compile`` of a private copy of step ``fn`` (a round's bound step): its own code object, so its own
    dynamo cache.

    Dynamo keeps compiled graphs per code object, at most ``recompile_limit``
    (8) of them, and checks their guards in turn on every call: one shared
    step function would fail (fullgraph) once a process has compiled rounds
    for 8 models or settings, and pay every entry's guards. Each pooled
    :class:`RoundSteps` compiles its own copy: one graph, one guard set.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name)
    if getattr(fn, "__self__", None) is not None:  # a bound step: the copy bound to the same round
        copy = types.MethodType(copy, fn.__self__)
    compiled = torch.compile(copy, fullgraph=True, dynamic=False, **_compile_kwargs(device))
    compiled._dflash_code = code  # its dynamo cache lives on this code object (dropped on release)
    return compiled


def _forget_code(fn) -> None:
    """Drop dynamo's compiled entries of a step copy (:func:`_compiled`): its graphs and their guards."""
    code = getattr(fn, "_dflash_code", None)
    reset_code = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    reset_code = getattr(reset_code, "reset_code", None)
    if code is not None and reset_code is not None:
        reset_code(code)


class RoundSteps:
    """A pooled :class:`Round` and what runs its steps: the round's own steps as they are (``mode``
    ``"static"``), or, for a traced round, ``torch.compile`` of exactly those two callables
    (:attr:`Round.draft_step`, :attr:`Round.verify_step`; a copy per budget bucket), captured in CUDA graphs
    on CUDA; the round's :meth:`~Round.draft` / :meth:`~Round.verify` then run these (:meth:`Round.run_by`)."""

    def __init__(self, rnd: Round, mode, blocks=()):
        self.rnd, self.mode = rnd, mode
        self.traced = rnd.traced
        self.cuda = rnd.device.type == "cuda" and self.traced
        self.graphs = None
        self.payload = None
        self.ready = False
        #: the shared cache buffers this entry's caches view (:class:`_SharedKV`)
        self.blocks: List[_Block] = list(blocks)
        #: a generation runs on this entry now; evicted while it ran: released when it ends
        self.busy = False
        self.evicted = False
        self._draft = self._verify = None
        if self.traced:
            # on the reference attention without CUDA graphs one graph attends over the rows the host mirrors
            # bound, through a size it traces as a symbol (KVBuffer.bind_key_extent)
            self.bound_keys = not self.cuda and rnd.backend != "triton"
            # one compiled copy per budget bucket: each its own graph and guards, so switching buckets between
            # rounds never recompiles
            self._draft = _compiled(rnd.draft_step, rnd.device)
            self._verify = [_compiled(rnd.verify_step, rnd.device) for _ in range(self.buckets)]
            rnd.run_by(self.draft, self.verify)

    @property
    def buckets(self) -> int:
        """How many verify shapes the round has: its budget buckets (1 unless the budget is chosen per round)."""
        return len(self.rnd.bucket_nodes)

    def _run_draft(self):
        self._bind_keys()
        with inert_output_hooks():
            return self._draft()

    def _bind_keys(self) -> None:
        if self.bound_keys:
            for cache in self.rnd._caches():
                cache.bind_key_extent()

    def _run_verify(self, bucket: int):
        linear = getattr(self.rnd.cache, "linear", None)
        if linear is not None:  # a hybrid target's stash of this bucket's rows, picked outside the traced code
            linear.stash(self.rnd.bucket_nodes[bucket] + 1 if self.rnd.method == "ddtree" else self.rnd.T)
        self._bind_keys()
        # transformers' output-capturing hooks (left on a model by an ``output_hidden_states`` call) made
        # traceable
        with inert_output_hooks():
            return self._verify[bucket](bucket)

    def _round(self, bucket: int = -1) -> torch.Tensor:
        if self.rnd.method != "ar":
            self._run_draft()
        return self._run_verify(bucket % self.buckets)

    def _capture(self) -> None:
        """Warm up on a side stream (the first calls compile), then capture each step in a CUDA graph (a verify
        graph per budget bucket, all in the draft graph's memory pool: they replay one at a time)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for bucket in range(self.buckets):
                    self.rnd.restore()
                    self._round(bucket)
        torch.cuda.current_stream().wait_stream(side)
        self.rnd.restore()
        draft_graph = None
        if self.rnd.method != "ar":
            draft_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(draft_graph):
                self._run_draft()
        pool = draft_graph.pool() if draft_graph is not None else None
        verify_graphs, self.payload = [], []
        for bucket in range(self.buckets):
            self.rnd.restore()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.payload.append(self._run_verify(bucket))
            verify_graphs.append(graph)
            pool = graph.pool()
        self.graphs = (draft_graph, verify_graphs)

    def prepare(self) -> float:
        """Compile (and capture) the steps once; returns the seconds it took (0 when already done).

        Runs on the frozen, empty caches; the rounds it runs write only scratch rows past the committed
        length, and the small state they change is put back (:meth:`Round.snapshot`)."""
        if self.ready or not self.traced:
            self.ready = True
            return 0.0
        t0 = time.perf_counter()
        rnd = self.rnd
        rnd.freeze()
        rnd.snapshot()
        try:
            if self.cuda:
                self._capture()
            else:
                for _ in range(2):
                    for bucket in range(self.buckets):
                        rnd.restore()
                        self._round(bucket)
        except Exception as exc:  # dynamo / inductor / capture failures: say what and what to do
            raise unsupported(type(rnd.adapter.model).__name__, exc) from exc
        finally:
            rnd.restore()
            rnd.thaw()
        self.ready = True
        return time.perf_counter() - t0

    def draft(self) -> None:
        """The round's draft step, compiled: its graph replayed on CUDA (nothing for AR)."""
        if self.rnd.method == "ar":
            return
        if self.graphs is not None:
            self.graphs[0].replay()
        else:
            self._run_draft()

    def verify(self, bucket: int = -1) -> torch.Tensor:
        """The round's verify step of budget bucket ``bucket`` (:attr:`Round.bucket_nodes`; the only one at a
        fixed budget), compiled: its graph replayed on CUDA; returns the payload."""
        bucket %= self.buckets
        if self.graphs is not None:
            self.graphs[1][bucket].replay()
            return self.payload[bucket]
        return self._run_verify(bucket)

    def release(self) -> None:
        """Free what the entry holds: CUDA graphs reset (their memory pool goes back), compiled code dropped,
        the round's caches and buffers unreferenced. The entry cannot run afterwards."""
        graphs, self.graphs = self.graphs, None
        if graphs is not None:
            draft_graph, verify_graphs = graphs
            for graph in [draft_graph, *verify_graphs]:
                if graph is not None:
                    graph.reset()
        self.payload = None
        for fn in [self._draft, *(self._verify or ())]:
            _forget_code(fn)
        self._draft = self._verify = None
        self.rnd = None
        self.blocks = []
        self.ready = False


class _Block:
    """One flat, zero-initialized buffer whose leading elements pooled rounds' caches view."""

    __slots__ = ("flat", "busy", "__weakref__")

    def __init__(self, flat: torch.Tensor):
        self.flat = flat
        self.busy = False


class _SharedKV:
    """Cache storage of a target's pooled rounds, shared across buckets (see the module docstring).

    Keyed by (side, layers, kv heads, head dim, dtype, device); the registry
    holds its buffers weakly, the entries that view them strongly.
    """

    def __init__(self):
        self._blocks = {}

    def view(self, role: str, shape, dtype, device):
        """``(kv, block)``: a ``shape`` view of the side's buffer (one sequence's ``[L, 2, Hkv, S, D]``, or a batch's
        ``[b, L, 2, Hkv, S, D]``), a new buffer when none is big enough or free."""
        shape = tuple(int(x) for x in shape)
        L, two, heads, rows, head_dim = shape[-5:]
        key = (role, L, heads, head_dim, dtype, str(device))
        numel = math.prod(shape)
        ref = self._blocks.get(key)
        block = ref() if ref is not None else None
        if block is None or block.flat.numel() < numel or block.busy:
            block = _Block(torch.zeros(numel, dtype=dtype, device=device))
            self._blocks[key] = weakref.ref(block)
        return block.flat[:numel].view(shape), block


class _RoundPool:
    """A target's compiled rounds: an LRU of :class:`RoundSteps` by settings, at most :data:`POOL_CAPACITY`."""

    def __init__(self):
        self._entries: "OrderedDict[tuple, RoundSteps]" = OrderedDict()
        self.kv = _SharedKV()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def keys(self):
        return self._entries.keys()

    def values(self):
        return self._entries.values()

    def items(self):
        return self._entries.items()

    def fitting(self, settings: tuple, rows: int) -> Optional[tuple]:
        """The key of the smallest entry for ``settings`` (a key less its last item, the caches' rows) whose
        caches hold ``rows`` rows; None when none does. Looks only (the LRU order moves on :meth:`get`)."""
        fits = [key for key in self._entries if key[:-1] == settings and key[-1] >= rows]
        return min(fits, key=lambda key: key[-1]) if fits else None

    def get(self, key) -> Optional[RoundSteps]:
        steps = self._entries.get(key)
        if steps is not None:
            self._entries.move_to_end(key)
        return steps

    def add(self, key, steps: RoundSteps) -> None:
        self._entries[key] = steps
        self._entries.move_to_end(key)
        while len(self._entries) > max(1, int(POOL_CAPACITY)):
            self._drop(next(iter(self._entries)))

    def discard(self, key) -> None:
        if key in self._entries:
            self._drop(key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key) -> None:
        steps = self._entries.pop(key)
        steps.evicted = True
        if not steps.busy:
            steps.release()

    def lease(self, steps: RoundSteps) -> None:
        """Mark ``steps`` (and the buffers it views) as in use by a generation, or refuse when in use."""
        if steps.busy or any(block.busy for block in steps.blocks):
            raise RuntimeError(
                "another compiled generation on this target is running on this round's caches; compiled "
                "generations on one target run one at a time (let it finish, or run this one with compile=False)")
        steps.busy = True
        for block in steps.blocks:
            block.busy = True

    def finish(self, steps: RoundSteps) -> None:
        with self.lock:
            steps.busy = False
            for block in steps.blocks:
                block.busy = False
            if steps.evicted:
                steps.release()


def _pool(target) -> _RoundPool:
    pool = getattr(target, "_dflash_compiled_rounds", None)
    if not isinstance(pool, _RoundPool):
        pool = _RoundPool()
        try:
            setattr(target, "_dflash_compiled_rounds", pool)
        except AttributeError:  # pragma: no cover - a target that refuses attributes: no pooling
            pass
    return pool


def _sampling_key(sampling):
    return (sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)


def batch_bucket(batch: int, mode) -> int:
    """The sequences a round holds for ``batch`` prompts: ``batch`` itself eagerly; compiled (``mode`` not False),
    the next power of two, so a few fixed batch shapes serve every batch size (the extra sequences are stopped
    from the start: computed, never committed)."""
    if mode is False or batch <= 1:
        return batch
    return 1 << (batch - 1).bit_length()


#: the fewest rows a compiled round's caches hold (both sides; then the next powers of two)
MIN_ROWS = 256

#: the share of the device's free memory the drop-in's default reservation (``max_cache_len="auto"``) may take
#: for the two caches of its compiled round, at its first call (CUDA only; the CPU reserves nothing by default)
RESERVE_MEMORY_FRACTION = 0.25


def compiled_rows(rows: int) -> int:
    """The rows of a compiled round's caches for ``rows`` needed: the next power of two, at least :data:`MIN_ROWS`.

    Powers of two, not multiples of 256: prompts that grow over a chat compile at most ``log2`` of their growth
    new rounds (256, 512, 1024, ...), not one per 256 rows; a cache holds at most twice the rows it needs (plus
    the 256-row floor). Both sides (target and drafter) take the bucket of the larger need, so one growth step
    is one new round, never two."""
    rows = max(int(rows), MIN_ROWS)
    return 1 << (rows - 1).bit_length()


def _free_bytes(device: torch.device) -> Optional[int]:
    """The device's free memory in bytes, None where the drop-in reserves nothing by default (the CPU: its
    compiled reference attention runs over every row of the cache, so a reservation costs time there)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def _row_bytes(adapter, draft, shape: RoundShape, batch: int) -> int:
    """Bytes one cache row costs the round, both sides, every sequence of the batch."""
    size = math.prod(adapter.cache_shape(1)) * torch.empty((), dtype=adapter.dtype).element_size()
    if shape.method != "ar":
        dtype = draft.fc.weight.dtype
        size += math.prod(DraftKVCache.kv_shape(draft.config, 1)) * torch.empty((), dtype=dtype).element_size()
    return int(size) * int(batch)


def reserved_rows(adapter, draft, shape: RoundShape, max_cache_len, batch: int = 1) -> int:
    """The rows a compiled round reserves up front (0: none) for ``max_cache_len``:

    * None or 0: none (each call's own need, :func:`compiled_rows`);
    * an int ``N``: the rows a generation of ``N`` tokens (prompt + new) needs, rounded up to 256: every
      later call that fits runs on the same compiled round;
    * ``"auto"`` (the drop-in's default): on CUDA the rows of the target's ``max_position_embeddings`` tokens
      (rounded up to 256), or where the two caches would take more than :data:`RESERVE_MEMORY_FRACTION` of the
      free device memory the largest power of two of rows that does not (never under :data:`MIN_ROWS`);
      elsewhere none.
    """
    if not max_cache_len:
        return 0
    if max_cache_len != "auto":
        return max(MIN_ROWS, bucket_rows(max(cache_rows(shape, int(max_cache_len)))))
    free = _free_bytes(adapter.device)
    config = getattr(adapter.config, "get_text_config", lambda: adapter.config)()
    positions = getattr(config, "max_position_embeddings", None)
    if free is None or not positions:
        return 0
    rows = max(MIN_ROWS, bucket_rows(max(cache_rows(shape, int(positions)))))
    per_row = _row_bytes(adapter, draft, shape, batch)
    if rows * per_row > RESERVE_MEMORY_FRACTION * free:  # the largest power of two that fits (or the floor)
        rows = compiled_rows(rows) // 2
        while rows > MIN_ROWS and rows * per_row > RESERVE_MEMORY_FRACTION * free:
            rows //= 2
    return rows


def check_max_cache_len(value):
    """``max_cache_len`` as given: None, ``"auto"`` or an int >= 1 (else ``ValueError``)."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_cache_len must be None, 'auto' or an int >= 1 (tokens: prompt + new), got {value!r}")
    return value


@contextlib.contextmanager
def lease_round(target, adapter, draft, shape: RoundShape, sampling, total_tokens: int, mode, batch: int = 1,
                max_cache_len=None):
    """The round a generation runs, held for the ``with`` block: ``(rnd, policy, setup_seconds)``, ``policy``
    the :class:`~dflash.decoding.budget_policy.BudgetPolicy` of a budget chosen per round (None otherwise:
    :func:`~dflash.decoding.bucket_costs.attach_budget_policy`), ``setup_seconds`` the compile and cost
    measurement this call made.

    ``mode`` False: a fresh :class:`Round` whose steps run as they are, its caches sized for
    this call. Otherwise a pooled entry of the target's for these settings
    whose caches hold this call's rows (the smallest one that does), else a
    new one (created, compiled and captured here: ``compile_time`` is its
    set-up, 0 when reused) of :func:`compiled_rows` rows for both sides, or of
    the :func:`reserved_rows` of ``max_cache_len`` if more; leased so no other
    generation runs on its caches meanwhile. ``batch``: the round's sequences
    (:func:`batch_bucket` of the prompts); ``total_tokens``: the longest
    prompt plus the new tokens.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(map(repr, COMPILE_MODES))}, got {mode!r}")
    target_rows, draft_rows = cache_rows(shape, total_tokens)
    draft_dtype = str(draft.fc.weight.dtype) if shape.method != "ar" else None
    costs = costs_key(shape, draft, sampling, adapter, mode, repr(sorted(_compile_kwargs(adapter.device).items())),
                      batch_bucket(batch, True))
    if mode is False:
        rnd = Round(adapter, draft, shape, target_rows=target_rows, draft_rows=draft_rows, sampling=sampling,
                    batch=batch)
        yield (rnd, *attach_budget_policy(target, costs, rnd))
        return
    # the pool key: the settings, then the rows of both caches (one bucket; 0 for an AR round's drafter)
    settings = (shape, id(draft) if shape.method != "ar" else None, _sampling_key(sampling), str(adapter.dtype),
                draft_dtype, str(adapter.device), mode, repr(sorted(_compile_kwargs(adapter.device).items())), batch,
                structure_stamp(adapter.modules, draft.modules() if shape.method != "ar" else None))
    need = max(target_rows, draft_rows)
    pool = _pool(target)
    with pool.lock:
        key = pool.fitting(settings, need)
        steps = pool.get(key) if key is not None else None
        if steps is None:
            rows = max(compiled_rows(need), reserved_rows(adapter, draft, shape, max_cache_len, batch))
            key = (*settings, rows)
            blocks = []

            def kv_alloc(role, kv_shape, dtype, dev):
                kv, block = pool.kv.view(role, kv_shape, dtype, dev)
                blocks.append(block)
                return kv

            rnd = Round(adapter, draft, shape, target_rows=rows, draft_rows=rows if shape.method != "ar" else 0,
                        sampling=sampling, kv_alloc=kv_alloc, batch=batch, traced=mode != "static")
            steps = RoundSteps(rnd, mode, blocks)
            pool.add(key, steps)
        pool.lease(steps)
    try:
        steps.rnd.adapter = adapter  # this call's adapter (its patches are open); the same model
        try:
            compile_time = steps.prepare()
        except BaseException:
            if not steps.ready:  # a set-up that failed is not kept
                with pool.lock:
                    pool.discard(key)
            raise
        policy, measured = attach_budget_policy(target, costs, steps.rnd)
        yield steps.rnd, policy, compile_time + measured
    finally:
        pool.finish(steps)
