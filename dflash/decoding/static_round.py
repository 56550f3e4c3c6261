"""Fixed-shape draft and verify steps of the AR, DFlash and DDTree rounds (compiled / CUDA-graph rounds).

A :class:`StaticRound` holds every value a round reads or writes as a device
tensor of fixed shape, so its steps are functions of those tensors alone:
``torch.compile(fullgraph=True)`` traces each once, and on CUDA a captured
graph replays it every round. Per generation (``B`` block size, ``N`` tree
budget, ``D = B - 1``):

==================  =====================  ===========================================================
tensor              shape                  meaning
==================  =====================  ===========================================================
``cache.length_t``  ``[1]`` int64          target rows committed (= committed tokens - 1)
``dcache.length_t`` ``[1]`` int64          drafter context rows committed
``ctx``             ``[B, n*H]``           captured features of the last verify's accepted rows
``ctx_count``       ``[1]`` int64          how many rows of ``ctx`` are real (``a + 1`` / path length)
``last``            ``[1]`` int64          the last committed token (the next block's anchor)
``seed``            ``[1]`` int64          sampling key: +1 per verify, so a replayed graph draws new noise
``proposals``       ``[D]`` int64          DFlash: the drafter's chain
``tokens/depths``   ``[N]`` int64          DDTree: the tree's nodes (``build_tree_device``)
``parents``         ``[N+1]`` int64        DDTree: parent of each verify row (-1 for the root)
``tree_tables``     (index tables)         DDTree: the tree build's index tables, made once here and
                                           held as long as the round (its graphs read their addresses)
==================  =====================  ===========================================================

Each cache is sized from the rows its own side writes (:func:`cache_rows`):
a verify writes ``T`` target rows past the committed length (``B`` for the
chain, ``budget + 1`` for the tree, 1 for AR), a draft ``B`` context rows and
then ``B`` block rows past the drafter's; both rounded up to
:data:`ROW_BUCKET`. :meth:`StaticRound.check_room` refuses a round that
could write past either cache, on the host, before it runs.

Steps (nothing in them reads a value on the host):

* :meth:`draft` -- the drafter over ``ctx`` (``ctx_count`` real rows) and the
  block ``[last, MASK x D]``; DFlash: ``proposals = argmax`` at block rows
  ``1..D``; DDTree: top-K log-probs there and the tree;
* :meth:`verify_chain` -- the target on ``[last, proposals]`` at ``L + arange(B)``;
  ``a`` = matching prefix length; commits ``a + 1`` rows, ``ctx`` = all ``B``
  rows' features (``ctx_count = a + 1``), ``last = choice[a]``; returns the
  payload ``[choices (B), a]``;
* :meth:`verify_tree` -- the target on ``[last, tokens]`` at ``L + [0, depths]``
  with the ancestor bits; the device walk; the path's K/V rows compacted to
  ``L ..`` (device count); ``ctx`` = the path rows' features; returns
  ``[committed (D + 1, padded), path_len]``;
* :meth:`verify_ar` -- one target row; returns ``[choice]``.

The host loop reads the payload once per round (the round's one read) and
applies the stop rules; it never writes the state.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

import dflash_kernels
from dflash_kernels import tree_device

from ..drafter.model import all_visible_bits
from ..drafter.static_cache import StaticDraftKVCache
from ..kv_buffer import CacheFullError
from ..target.static import StaticTargetKVCache, static_forward
from .generation_config import SamplingSettings

__all__ = ["StaticRound", "bucket_rows", "cache_rows"]

#: static caches are allocated in multiples of this many rows, so prompts of similar length share one compiled step
ROW_BUCKET = 256


def bucket_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of :data:`ROW_BUCKET`."""
    return -(-int(rows) // ROW_BUCKET) * ROW_BUCKET


def verify_rows(method: str, block_size: int, tree_budget: int) -> int:
    """Target rows one verify writes past the committed length: 1 (AR), ``B`` (chain), ``budget + 1`` (tree)."""
    return {"ar": 1, "dflash": int(block_size), "ddtree": int(tree_budget) + 1}[method]


def cache_rows(method: str, block_size: int, tree_budget: int, total_tokens: int) -> Tuple[int, int]:
    """``(target rows, drafter rows)`` a generation of ``total_tokens`` (prompt + new tokens) needs, unrounded.

    A round starts with ``n <= total_tokens`` committed tokens; its verify
    writes target rows up to ``n - 2 + T`` (``T`` = :func:`verify_rows`), its
    draft drafter rows up to ``n - 2 + B`` (``B`` context rows from the
    drafter's length, then ``B`` block rows after the real ones), so
    ``total_tokens - 1 + T`` and ``total_tokens - 1 + B`` rows suffice; these
    keep two spare rows. The drafter count is 0 for AR.
    """
    total = int(total_tokens)
    target = total + verify_rows(method, block_size, tree_budget) + 1
    draft = 0 if method == "ar" else total + int(block_size) + 1
    return target, draft


class StaticRound:
    """The fixed-shape state and steps of one generation (see the module docstring).

    ``target_rows`` / ``draft_rows``: the rows each cache needs (:func:`cache_rows`), rounded up to
    :data:`ROW_BUCKET`. ``kv_alloc(role, shape, dtype, device) -> kv`` (role ``"target"`` or
    ``"draft"``) hands each cache its storage (e.g. a view of a buffer pooled rounds share); zeros
    when omitted.
    """

    def __init__(self, adapter, draft, *, method: str, block_size: int, tree_budget: int, target_rows: int,
                 draft_rows: int, sampling: SamplingSettings, seed: int, mask_token_id: int,
                 kv_alloc: Optional[Callable] = None):
        self.adapter, self.draft_model, self.method = adapter, draft, method
        self.sampling = sampling
        device = self.device = adapter.device
        self.backend = dflash_kernels.get_backend(device)
        self.B = B = int(block_size) if method != "ar" else 1
        self.D = B - 1
        self.budget = int(tree_budget) if method == "ddtree" else 0
        self.K = min(self.budget, adapter.vocab_size) if method == "ddtree" else 0
        #: tree nodes per round (the budget, or fewer when D levels of K children hold fewer)
        self.N = dflash_kernels.tree_size(self.D, self.K, self.budget) if method == "ddtree" else 0
        #: target rows a verify writes (the tree verify writes N + 1 <= budget + 1)
        self.T = self.N + 1 if method == "ddtree" else B
        alloc = kv_alloc or (lambda role, shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
        self.S = bucket_rows(target_rows)
        self.cache = StaticTargetKVCache(
            adapter.config, self.S, dtype=adapter.dtype, device=device,
            kv=alloc("target", StaticTargetKVCache.kv_shape(adapter.config, self.S), adapter.dtype, device))
        long = dict(dtype=torch.long, device=device)
        self.last = torch.zeros(1, **long)
        self.seed = torch.full((1,), int(seed), **long)
        self.rows = torch.arange(max(B, self.N + 1), **long)
        if method == "ar":
            return
        all_visible_bits(B, device)  # made before tracing: a traced step only looks it up (no recompile)
        draft_dtype = draft.fc.weight.dtype
        self.S_draft = bucket_rows(draft_rows)
        self.dcache = StaticDraftKVCache(
            draft.config, self.S_draft, dtype=draft_dtype, device=device,
            kv=alloc("draft", StaticDraftKVCache.kv_shape(draft.config, self.S_draft), draft_dtype, device))
        width = len(adapter.capture_layer_ids) * adapter.hidden_size
        self.ctx = torch.zeros(B, width, dtype=adapter.dtype, device=device)
        self.ctx_count = torch.zeros(1, **long)
        self.mask_block = torch.full((self.D,), int(mask_token_id), **long)
        self.draft_rows = torch.arange(1, B, **long)
        if method == "dflash":
            self.proposals = torch.zeros(self.D, **long)
        else:
            self.tokens = torch.zeros(self.N, **long)
            self.depths = torch.zeros(self.N, **long)
            self.parents = torch.zeros(self.N + 1, **long)
            # the tree build's index tables: the round's own, alive as long as the graphs that read them
            self.tree_tables = tree_device.tree_tables(self.D, self.K, self.budget, device)

    def reset(self, seed: int) -> None:
        """Empty caches (eager again, for the next prefill), a fresh sampling key; the buffers are kept."""
        self.thaw()
        self.last.zero_()
        self.seed.fill_(int(seed) & ((1 << 62) - 1))
        if self.method != "ar":
            self.ctx_count.zero_()

    def check_room(self, committed: int) -> None:
        """Refuse (:class:`~dflash.kv_buffer.CacheFullError`) the next round when, with ``committed`` tokens
        (prompt included), its verify or its draft could write past its cache. Host ints only."""
        sides = [("target", committed - 1 + self.T, self.cache.max_len)]
        if self.method != "ar":
            sides.append(("drafter", committed - 1 + self.B, self.dcache.max_len))
        for side, rows, capacity in sides:
            if rows > capacity:
                raise CacheFullError(
                    f"the {side} cache of this compiled round holds {capacity} rows; the next round, after "
                    f"{committed} committed tokens, would need {rows}: the round's caches were sized for fewer "
                    "tokens (prompt + max_new_tokens)")

    # ---------------------------------------------------------------- eager set-up (prompt shapes vary)
    def start(self, prompt: torch.Tensor, first_hidden_fn) -> torch.Tensor:
        """Prefill ``prompt [P]`` eagerly, ingest its features into the drafter, freeze both caches.

        ``first_hidden_fn(last_hidden) -> token [1]`` picks the first token
        (the eager sampler). Returns that token (also stored in ``last``).
        """
        last_hidden, features = self.adapter.prefill(prompt, self.cache)
        first = first_hidden_fn(last_hidden)
        self.last.copy_(first.reshape(1))
        if self.method != "ar":
            self.draft_model.ingest_context(features, self.dcache)
        self.freeze()
        return first

    # ---------------------------------------------------------------- the target's choice
    def _choose(self, hidden: torch.Tensor) -> torch.Tensor:
        rows, kw = self.adapter.head_inputs(hidden)
        W = self.adapter.lm_head.weight
        s = self.sampling
        if s.greedy:
            return dflash_kernels.lm_head_argmax(rows, W, check_bounds=False, backend=self.backend, **kw)
        self.seed.add_(1)
        if s.active():
            return dflash_kernels.lm_head_sample_processed(rows, W, s.temperature, seed=self.seed, top_k=s.top_k,
                                                           top_p=s.top_p, min_p=s.min_p, check_bounds=False,
                                                           backend=self.backend, **kw)
        return dflash_kernels.lm_head_sample(rows, W, s.temperature, seed=self.seed, check_bounds=False,
                                             backend=self.backend, **kw)

    # ---------------------------------------------------------------- steps
    def draft(self) -> None:
        """The drafter pass and its proposals (chain) or tree, into the state tensors."""
        ids = torch.cat([self.last, self.mask_block])
        out = self.draft_model.forward_static(self.adapter.embed(ids), self.ctx, self.ctx_count, self.dcache)
        W = self.adapter.lm_head.weight
        if self.method == "dflash":
            self.proposals.copy_(dflash_kernels.lm_head_argmax(out, W, positions=self.draft_rows,
                                                               check_bounds=False, backend=self.backend))
            return
        logprobs, ids = dflash_kernels.lm_head_topk(out, W, self.K, positions=self.draft_rows, check_bounds=False,
                                                    backend=self.backend)
        tokens, depths, parents = dflash_kernels.build_tree_device(logprobs, ids, self.budget,
                                                                   tables=self.tree_tables, backend=self.backend)
        self.tokens.copy_(tokens)
        self.depths.copy_(depths)
        self.parents.copy_(parents)

    def verify_chain(self) -> torch.Tensor:
        """DFlash verify + commit; returns ``[choices (B), a]`` int64."""
        length = self.cache.length_t
        block = torch.cat([self.last, self.proposals])
        hidden, captured = static_forward(self.adapter, block, length + self.rows[: self.B], self.cache,
                                          backend=self.backend)
        choices = self._choose(hidden)
        accepted = torch.cumprod((self.proposals == choices[:-1]).long(), 0).sum().reshape(1)
        self.ctx.copy_(torch.cat(captured, dim=1))
        self.ctx_count.copy_(accepted + 1)
        length.add_(accepted + 1)
        self.last.copy_(choices.gather(0, accepted))
        return torch.cat([choices, accepted])

    def verify_tree(self) -> torch.Tensor:
        """DDTree verify + walk + compaction + commit; returns ``[committed (D + 1), path_len]`` int64."""
        length = self.cache.length_t
        ids = torch.cat([self.last, self.tokens])
        positions = length + torch.cat([self.depths.new_zeros(1), self.depths])  # the root at depth 0
        bits = dflash_kernels.ancestor_bits(self.parents, check=False, backend=self.backend)
        hidden, captured = static_forward(self.adapter, ids, positions, self.cache, tree_bits=bits,
                                          backend=self.backend)
        choices = self._choose(hidden)
        path, path_len, committed = dflash_kernels.walk_tree_device(self.parents, self.tokens, choices, self.D, bits,
                                                                    backend=self.backend)
        dflash_kernels.compact_kv_(self.cache.kv, path + length, length, num_rows=path_len, check=False,
                                   backend=self.backend)
        self.ctx.copy_(torch.cat([c.index_select(0, path) for c in captured], dim=1))
        self.ctx_count.copy_(path_len)
        self.last.copy_(committed.gather(0, path_len - 1))
        length.add_(path_len)
        return torch.cat([committed, path_len])

    def verify_ar(self) -> torch.Tensor:
        """One AR step; returns ``[choice]``."""
        length = self.cache.length_t
        hidden, _ = static_forward(self.adapter, self.last, length + self.rows[:1], self.cache, backend=self.backend)
        choice = self._choose(hidden)
        length.add_(1)
        self.last.copy_(choice)
        return choice

    def verify(self) -> torch.Tensor:
        return {"ar": self.verify_ar, "dflash": self.verify_chain, "ddtree": self.verify_tree}[self.method]()

    # ---------------------------------------------------------------- compile / capture support
    def _caches(self):
        return (self.cache,) if self.method == "ar" else (self.cache, self.dcache)

    def freeze(self) -> None:
        """Both caches in their device-length form (at their current, eager lengths)."""
        for cache in self._caches():
            cache.freeze()

    def thaw(self) -> None:
        """Both caches back to empty eager caches (their device tensors kept)."""
        for cache in self._caches():
            cache.thaw()

    def _mutable(self) -> dict:
        """The small tensors a step changes, besides cache rows past the committed lengths."""
        names = ["last", "seed"] + ([] if self.method == "ar" else ["ctx", "ctx_count"])
        state = {n: getattr(self, n) for n in names}
        for i, cache in enumerate(self._caches()):
            state[f"length_{i}"] = cache.length_t
        return state

    def snapshot(self) -> None:
        """Remember the small state, so warm-up and capture rounds can be undone (:meth:`restore`)."""
        self._saved = {name: t.clone() for name, t in self._mutable().items()}

    def restore(self) -> None:
        for name, t in self._mutable().items():
            t.copy_(self._saved[name])
