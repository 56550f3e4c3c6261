"""The one round of every generation: draft and verify steps over device-resident state.

A :class:`Round` holds every value a round reads or writes as a device
tensor of fixed shape, so its two steps are functions of those tensors alone:
eager generation calls them directly; ``compile=True`` wraps the same two
methods in ``torch.compile(fullgraph=True)`` and, on CUDA, CUDA graphs
(:mod:`dflash.decoding.compiled`). A round runs ``b`` sequences at once (a
batch; ``b = 1`` is the same code), each with its own lengths, tree and
commit. Per generation (``B`` block size, ``N`` tree nodes, ``D = B - 1``):

==================  =====================  ===========================================================
tensor              shape                  meaning
==================  =====================  ===========================================================
``cache.length_t``  ``[b]`` int64          target rows committed per sequence (= committed tokens - 1)
``dcache.length_t`` ``[b]`` int64          drafter context rows committed
``ctx``             ``[b, B, n*H]``        captured features of the last verify's accepted rows
``ctx_count``       ``[b]`` int64          how many rows of ``ctx`` are real (``a + 1`` / path length)
``last``            ``[b]`` int64          the last committed token (the next block's anchor)
``alive``           ``[b]`` int64          1 for a sequence still generating, 0 once it stopped: a stopped
                                           sequence's rows are still computed (fixed shapes) but commit nothing
``seed``            ``[1]`` int64          sampling key: +1 per choice, so every draw (and a replayed
                                           graph) gets new noise; the rows of one choice draw apart
``proposals``       ``[b, D]`` int64       DFlash: the drafter's chain
``q_hidden``        ``[b, D, H]``          DFlash, rejection rule, dense q: the drafter's head rows the chain was
                                           sampled from (q = their processed distribution through the lm_head)
``q_ids/q_probs``   ``[b, D, k]``          DFlash2: each proposal's candidates and their selector probabilities
                                           (the rejection rule's sparse q)
``tokens/depths``   ``[b, N]`` int64       DDTree: the trees' nodes
``parents``         ``[b, N+1]`` int64     DDTree: parent of each verify row (-1 for the root)
``path``            ``[b, D+1]`` int64     DDTree: the accepted paths' rows (padded)
``path_mass``       ``[b, V]`` int64       DDTree, budget chosen per round: per sequence and budget bucket ``v``,
                                           the drafts the drafter expects the walk over the bucket's tree to
                                           accept (the sum of its nodes' path probabilities, :meth:`_take_trees`),
                                           in the payload's fixed point (times :data:`MASS_SCALE`, floored)
==================  =====================  ===========================================================

Steps (nothing in them reads a value on the host; each variant below is a
method of its own, bound once per round to :attr:`Round.draft_step` /
:attr:`Round.verify_step` by :meth:`Round._choose_steps`):

* :meth:`draft` -- the drafter over ``ctx`` (``ctx_count`` real rows) and the
  block ``[last, MASK x D]``; DFlash: ``proposals = argmax`` of the target's
  lm_head at block rows ``1..D`` (a sampled chain under the rejection rule:
  a draw from each row's processed distribution ``q``, :meth:`_draft_sampled_dense`),
  or, for a DFlash2 drafter, the candidate selector's chain over its top-k
  there (greedy or drawn at the temperature; ``q_ids / q_probs [D, k]`` the
  distribution each proposal came from);
  DDTree: top-K log-probs there and the best-first tree of ``N`` nodes (a
  DFlash2 drafter: the tree over its candidate selector's scores of each
  candidate given its parent's token);
* :meth:`verify` -- the target on the chain ``[last, proposals]`` at
  ``L + arange(B)`` or the tree ``[last, tokens]`` at ``L + [0, depths]``
  with its ancestor bits; the target's choice after every row
  (:meth:`choose`); the accepted prefix ``a`` (chain) or the walked path
  (tree); the commit: both caches' device lengths, the accepted rows' K/V
  compacted (tree), the hybrid layers' states replayed through them, ``ctx``
  = their captured features, ``last`` = the bonus token (each count times
  ``alive``, so a stopped sequence stays where it stopped). Returns the payload
  the host reads once, a row per sequence flattened: ``[choices (B), a]``
  (chain), ``[committed (D + 1, padded), path_len]`` (tree), ``[choice]`` (AR); its layout and the
  host's decoding are :class:`~dflash.decoding.payload.Payload`'s (:attr:`Round.payload`).

Token choice (:meth:`choose`, the only one): greedy argmax, or a sample of
the processed distribution (temperature, then top-k / top-p / min-p) keyed by
the device seed, so the same seed gives the same tokens eagerly and compiled.

Acceptance of a sampled chain (``shape.acceptance``): ``"match"`` keeps the
argmax drafts while they equal the target's samples (:meth:`choose` at every
row); ``"rejection"`` (the default) verifies drafts sampled from ``q`` with
:func:`dflash_kernels.rejection_sample` (accept ``x_k`` with probability
``min(1, p_k(x_k) / q_k(x_k))``, the first rejected row resampled from
``max(p - q, 0)``, the bonus from ``p``). Both commit tokens distributed as
the target's own samples; the payload is the same.

A budget chosen per round (``shape.budget_buckets``, ``tree_budget="auto"``):
the draft step builds the tree of the largest bucket. Its nodes are numbered
in the best-first search's pop order, by descending path score, so its first
``n`` nodes are exactly the best-first tree of budget ``n`` (a node's parent
precedes it, and no node past the ``n``-th can be among the top ``n``). The
verify of bucket ``v`` (:meth:`verify` ``(v)``, one fixed shape per bucket)
runs the target on that prefix only: the same tree, rows and walk as a round
of fixed budget ``n``, so it is as lossless. The draft step also writes
``path_mass`` for every bucket, which the payload carries to the host's
budget choice (:mod:`dflash.decoding.budget_policy`); the choice is made on the
host between rounds, so it costs no host read of its own.

On the CPU with the reference backend, eager DDTree rounds build and walk the
tree with the C++ host ops (:func:`dflash_kernels.build_tree` /
:func:`dflash_kernels.walk_tree`: the host is the device there, the walk
costs microseconds against the tensor walk's many small ops); they give the
same tree and path as the device ops a traced round runs, exact score ties
included (one tie rule, :func:`dflash_kernels.build_tree`).

Each cache is sized from the rows its own side writes (:func:`cache_rows`),
rounded up to :data:`ROW_BUCKET`; :meth:`Round.check_room` refuses, on the
host, a round that could write past either cache.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

import dflash_kernels
from dflash_kernels import tree_device

from ..cache import CacheFullError
from ..drafter.cache import DraftKVCache
from ..drafter.model import DFlash2DraftModel
from ..target.prefill import prefill
from .generation_config import SamplingSettings
from .options import RoundShape
from .payload import MASS_SCALE, Payload

__all__ = ["ROW_BUCKET", "Round", "bucket_rows", "cache_rows", "tree_branching"]

#: caches are allocated in multiples of this many rows, so prompts of similar length share one compiled step
ROW_BUCKET = 256

def bucket_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of :data:`ROW_BUCKET`."""
    return -(-int(rows) // ROW_BUCKET) * ROW_BUCKET


def verify_rows(shape: RoundShape) -> int:
    """Target rows one verify writes past the committed length: 1 (AR), ``B`` (chain), ``budget + 1`` (tree)."""
    return {"ar": 1, "dflash": shape.block_size, "ddtree": shape.tree_budget + 1}[shape.method]


def cache_rows(shape: RoundShape, total_tokens: int) -> Tuple[int, int]:
    """``(target rows, drafter rows)`` a generation of ``total_tokens`` (prompt + new tokens) needs, unrounded.

    A round starts with ``n <= total_tokens`` committed tokens; its verify
    writes target rows up to ``n - 2 + T`` (``T`` = :func:`verify_rows`), its
    draft drafter rows up to ``n - 2 + B`` (``B`` context rows from the
    drafter's length, then ``B`` block rows after the real ones), so
    ``total_tokens - 1 + T`` and ``total_tokens - 1 + B`` rows suffice; these
    keep two spare rows. The drafter count is 0 for AR.
    """
    total = int(total_tokens)
    target = total + verify_rows(shape) + 1
    draft = 0 if shape.method == "ar" else total + shape.block_size + 1
    return target, draft


def tree_branching(draft, budget: int, vocab: int) -> int:
    """Children per node of a DDTree round: a DFlash2 drafter's ``selector_top_k`` (its selector scores
    exactly those candidates per position), else ``min(budget, vocab)``."""
    if isinstance(draft, DFlash2DraftModel):
        return draft.candidate_selector.top_k
    return min(int(budget), int(vocab))


def _zeros(role, shape, dtype, device):
    return torch.zeros(shape, dtype=dtype, device=device)


class Round:
    """The state and the two steps of one generation's rounds (see the module docstring).

    ``target_rows`` / ``draft_rows``: the rows each sequence's cache needs
    (:func:`cache_rows`), rounded up to :data:`ROW_BUCKET`. ``batch``: the
    sequences ``b`` run at once. ``kv_alloc(role, shape, dtype, device) -> kv``
    (role ``"target"`` or ``"draft"``; ``shape`` one sequence's with the batch
    in front, ``[b, L, 2, Hkv, S, D]``) hands each cache its storage (a view of a buffer
    pooled rounds share); zeros when omitted. ``traced``: the steps will run
    traced (compiled), so they keep every shape fixed: the tree is built and
    walked with the device ops, and the passes attend over whole caches.
    ``host_tree``: False keeps an eager CPU round on the reference backend on
    the device tree ops too (the C++ host build and walk are its default).
    """

    def __init__(self, adapter, draft, shape: RoundShape, *, target_rows: int, draft_rows: int,
                 sampling: SamplingSettings, kv_alloc: Optional[Callable] = None, batch: int = 1,
                 traced: bool = False, host_tree: bool = True):
        self.adapter, self.draft_model, self.shape = adapter, draft, shape
        self.traced = bool(traced)
        method = self.method = shape.method
        self.sampling = sampling
        device = self.device = adapter.device
        self.backend = dflash_kernels.get_backend(device)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        self.b = b = batch
        self.B = B = shape.block_size
        self.D = B - 1
        self.budget = shape.tree_budget
        #: DDTree over a DFlash2 drafter: the tree grows from its candidate selector's conditional scores
        self.selector_tree = method == "ddtree" and isinstance(draft, DFlash2DraftModel)
        self.K = tree_branching(draft, self.budget, adapter.vocab_size) if method == "ddtree" else 0
        #: tree nodes per round (the budget, or fewer when D levels of K children hold fewer)
        self.N = dflash_kernels.tree_size(self.D, self.K, self.budget) if method == "ddtree" else 0
        #: target rows a verify writes (the tree verify writes N + 1 <= budget + 1); the largest bucket's when
        #: the budget is chosen per round
        self.T = self.N + 1 if method == "ddtree" else B
        #: the budget chosen per round among buckets (module docstring): their budgets and node counts (buckets
        #: that a tree of D levels of K children fills alike are one); a fixed budget is one bucket
        self.auto = method == "ddtree" and bool(shape.budget_buckets)
        self.bucket_budgets, self.bucket_nodes = [self.budget], [self.N]
        if self.auto:
            self.bucket_budgets, self.bucket_nodes = [], []
            for bb in shape.budget_buckets:
                n = dflash_kernels.tree_size(self.D, self.K, bb)
                if n not in self.bucket_nodes:
                    self.bucket_budgets.append(int(bb))
                    self.bucket_nodes.append(n)
        #: the layout of what :meth:`verify` returns and the host decodes
        self.payload = Payload(method, B, self.bucket_nodes if self.auto else ())
        #: a sampled DFlash chain verified by rejection sampling (else drafts at the argmax, matched)
        self.rejection = method == "dflash" and shape.acceptance == "rejection" and not sampling.greedy
        #: eager DDTree on the CPU reference backend: the C++ host tree build and walk (a traced round: False)
        self.host_tree = (bool(host_tree) and method == "ddtree" and device.type == "cpu"
                          and self.backend == "reference" and not self.traced)
        alloc = kv_alloc or _zeros
        S = bucket_rows(target_rows)
        self.cache = adapter.new_cache(S, kv=alloc("target", (b, *adapter.cache_shape(S)), adapter.dtype, device),
                                       batch=b)
        linear = getattr(self.cache, "linear", None)
        if linear is not None:  # hybrid targets: the verify's stash and tree scratch, made before any trace
            for n in (self.bucket_nodes if method == "ddtree" else [self.T - 1]):
                linear.stash(n + 1)
            linear.scratch(self.T)
        long = dict(dtype=torch.long, device=device)
        self.last = torch.zeros(b, **long)
        self.alive = torch.ones(b, **long)
        #: :meth:`stop`'s upload: a page-locked host buffer on CUDA (the copy never waits), and its device copy
        self._keep_host = torch.ones(b, dtype=torch.long, pin_memory=device.type == "cuda")
        self._keep = torch.ones(b, **long)
        self.seed = torch.zeros(1, **long)
        self.rows = torch.arange(max(B, self.N + 1) + 1, **long)
        #: row ``r``'s offset in the batch's flattened rows of a pass of ``T`` rows: ``r * T``
        self.sequence = torch.arange(b, **long)
        self.dcache = None
        self.batch_size = b
        if method == "ar":
            self._finish_setup()
            return
        draft_dtype = draft.fc.weight.dtype
        S_draft = bucket_rows(draft_rows)
        self.dcache = DraftKVCache(draft.config, S_draft, dtype=draft_dtype, device=device, batch=b,
                                   kv=alloc("draft", (b, *DraftKVCache.kv_shape(draft.config, S_draft)),
                                            draft_dtype, device))
        for layer in draft.layers:  # made before tracing: a traced step looks them up
            band = layer.round_window(self.rows[:B][None], B, shape.draft_window)[2]
            self.dcache.block_bits(B, layer.causal, band)
        width = len(adapter.capture_layer_ids) * adapter.hidden_size
        self.ctx = torch.zeros(b, B, width, dtype=adapter.dtype, device=device)
        self.ctx_count = torch.zeros(b, **long)
        self.mask_block = torch.full((b, self.D), shape.mask_token_id, **long)
        self.draft_rows = torch.arange(1, B, **long)
        #: the drafted rows of the batch's flattened ``[b * B]`` block rows (rows ``1..D`` of each block)
        self.draft_rows_flat = (self.sequence[:, None] * B + self.draft_rows).reshape(-1)
        #: DFlash2 drafters: the candidate selector's top-k per drafted position (0: no selector)
        selector = getattr(draft, "candidate_selector", None)
        self.selector_k = int(selector.top_k) if method == "dflash" and selector is not None else 0
        if method == "dflash":
            self.proposals = torch.zeros(b, self.D, **long)
            if self.selector_k:
                # the selector's re-scored distribution each proposal was drawn from (sparse q: its candidates'
                # ids and probabilities; zero outside them)
                self.q_ids = torch.zeros(b, self.D, self.selector_k, **long)
                self.q_probs = torch.zeros(b, self.D, self.selector_k, dtype=torch.float32, device=device)
            if self.rejection:
                self.q_form = self._draft_q_form()
                if self.q_form == "dense":
                    self.q_hidden = torch.zeros(b, self.D, adapter.hidden_size, dtype=draft_dtype, device=device)
        else:
            self.tokens = torch.zeros(b, self.N, **long)
            self.depths = torch.zeros(b, self.N, **long)
            self.parents = torch.zeros(b, self.N + 1, **long)
            self.path = torch.zeros(b, B, **long)
            # the tree build's index tables: the round's own, alive as long as the graphs that read them
            self.tree_tables = tree_device.tree_tables(self.D, self.K, self.budget, device)
            if self.auto:
                self.path_mass = torch.zeros(b, len(self.bucket_nodes), **long)
                self._bucket_last = torch.tensor(self.bucket_nodes, **long) - 1
        self._finish_setup()

    def _finish_setup(self) -> None:
        # an eager pass attends over the rows the host mirrors bound; a traced one, whose shapes may not change,
        # over whole caches (KVBuffer.key_bound)
        for cache in self._caches():
            cache.key_bound = not self.traced
        self._register_batched()
        self._choose_steps()

    #: state tensors with the batch in front (:meth:`narrow` views their first rows)
    _BATCHED = ("last", "alive", "sequence", "ctx", "ctx_count", "mask_block", "proposals", "q_ids", "q_probs",
                "q_hidden", "tokens", "depths", "parents", "path", "path_mass")

    def _register_batched(self) -> None:
        self._whole = {name: getattr(self, name) for name in self._BATCHED if hasattr(self, name)}
        if self.method != "ar":
            self._whole["draft_rows_flat"] = self.draft_rows_flat

    def narrow(self, n: int) -> None:
        """Run the first ``n`` sequences only: every batched state tensor and both caches become views of their
        first ``n`` rows (an eager round's shapes may change; a traced one keeps its batch and masks). The
        steps then run over those rows as a batch of ``n``."""
        for name, whole in self._whole.items():
            setattr(self, name, whole[: n * self.D] if name == "draft_rows_flat" else whole[:n])
        for cache in self._caches():
            cache.narrow(n)
        self.b = n

    def retire(self, row: int) -> None:
        """Sequence ``row`` (an index of the current batch) stopped: the last sequence's state and committed cache
        rows move into its place (a copy of that sequence's committed rows, once), and the batch narrows by
        one, so later eager rounds stop computing the stopped sequence at all. The caller renumbers its
        sequences the same way (the last takes ``row``'s index)."""
        last = self.b - 1
        if not 0 <= row <= last:
            raise IndexError(f"sequence {row} of a batch of {self.b}")
        if row != last:
            for cache in self._caches():
                cache.move_row(last, row)
            for name, whole in self._whole.items():
                if name in ("sequence", "draft_rows_flat", "mask_block"):  # the same in every row
                    continue
                whole[row].copy_(whole[last])
        self.narrow(last)

    # ---------------------------------------------------------------- set-up per generation (eager)
    def reset(self, seed: int) -> None:
        """Empty caches for the next prefill, a fresh sampling key, every sequence alive and in the batch; the
        buffers are kept."""
        if self.b != self.batch_size:
            for cache in self._caches():
                cache.widen()
            self.narrow(self.batch_size)
        self.thaw()
        self.last.zero_()
        self.alive.fill_(1)
        self.seed.fill_(int(seed) & ((1 << 62) - 1))
        if self.method != "ar":
            self.ctx_count.zero_()

    def start(self, prompts, chunk_size: Optional[int] = None) -> torch.Tensor:
        """Prefill each sequence's prompt (``prompts``: ``b`` int64 tensors ``[P_r]``, or one ``[P]`` when ``b ==
        1``; shapes vary), choose its first token, ingest its features into the drafter; then freeze both caches.
        Returns the first tokens ``[b]`` (also in ``last``). ``chunk_size``: rows per prefill pass (the
        generation's ``prefill_chunk_size``; None: the prefill's defaults).

        The prefill is the target side's (:func:`dflash.target.prefill.prefill`: one sequence, or a hybrid
        target's batch, row by row as ``generate()`` runs a prompt; other batches in shared padded passes);
        each sequence's features go to its drafter rows (:meth:`KVBuffer.row`), whose lengths the drafter
        cache then adopts."""
        if isinstance(prompts, torch.Tensor):
            prompts = [prompts]
        if len(prompts) != self.b:
            raise ValueError(f"this round runs {self.b} sequences, got {len(prompts)} prompts")
        ingest = drows = None
        if self.dcache is not None:
            drows = [self.dcache.row(r) for r in range(self.b)]
            ingest = lambda r, features: self.draft_model.ingest_context(features, drows[r])  # noqa: E731
        last_hidden = prefill(self.adapter, self.cache, list(prompts), chunk_size, ingest)
        if drows is not None:
            self.dcache.take_lengths(drows)
        self.last.copy_(self.choose(last_hidden))
        self.freeze()
        return self.last

    def check_room(self, committed) -> None:
        """Refuse (:class:`~dflash.cache.CacheFullError`) the next round when, with ``committed`` tokens (prompt
        included; an int, or one per sequence, None for a stopped one), its verify or its draft could write past
        a cache. Host ints only."""
        counts = [committed] if isinstance(committed, int) else [c for c in committed if c is not None]
        if not counts:
            return
        most = max(counts)
        sides = [("target", most - 1 + self.T, self.cache.max_len)]
        if self.method != "ar":
            sides.append(("drafter", most - 1 + self.B, self.dcache.max_len))
        for side, rows, capacity in sides:
            if rows > capacity:
                raise CacheFullError(
                    f"the {side} cache of this round holds {capacity} rows; the next round, after {most} "
                    f"committed tokens, would need {rows}: the caches were sized for fewer tokens (prompt + "
                    "max_new_tokens)")

    # ---------------------------------------------------------------- the target's choice
    def choose(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's token after each row of pre-norm ``hidden [..., H]`` (``[T, H]``, or ``[b, T, H]`` for a
        batch's pass, flattened to one set of rows): ``[...]`` int64.

        Greedy: the argmax of the logits in the lm_head's dtype (lowest id on
        ties). Sampling: a draw from the processed distribution (temperature,
        then top-k, top-p, min-p, as transformers' warpers) keyed by ``seed``,
        which moves on by one per call; the flattened rows draw apart. The
        family's final norm and final-logit softcap come from the adapter's
        head inputs.
        """
        lead = hidden.shape[:-1]
        rows, kw = self.adapter.head_inputs(hidden.reshape(-1, hidden.shape[-1]))
        if self.sampling.greedy:
            return self.adapter.head.argmax(rows, check_bounds=False, backend=self.backend, **kw).view(lead)
        return self._sample(rows, kw).view(lead)

    def _sample(self, rows: torch.Tensor, kw: dict) -> torch.Tensor:
        """One draw per row of ``rows`` from the processed distribution of ``W rows`` (``kw``: the head's norm /
        softcap), keyed by ``seed`` after moving it on by one."""
        head = self.adapter.head
        s = self.sampling
        self.seed.add_(1)
        if s.active():
            return head.sample_processed(rows, s.temperature, seed=self.seed, top_k=s.top_k, top_p=s.top_p,
                                         min_p=s.min_p, check_bounds=False, backend=self.backend, **kw)
        return head.sample(rows, s.temperature, seed=self.seed, check_bounds=False, backend=self.backend, **kw)

    # ---------------------------------------------------------------- steps, chosen once (:meth:`_choose_steps`)
    def _choose_steps(self) -> None:
        """Bind :attr:`draft_step` and :attr:`verify_step` to this round's variants, once per round: what they
        depend on (method, drafter kind, acceptance rule, host or device tree) is fixed at construction. The
        steps the loop runs (:attr:`draft` / :attr:`verify`) are these, until a compiled runner wraps them
        (:meth:`run_by`)."""
        if self.method == "ar":
            draft, verify = self._draft_nothing, self._verify_ar
        elif self.method == "dflash":
            draft = (self._draft_selector if self.selector_k else
                     self._draft_sampled_dense if self.rejection else self._draft_chain)
            verify = self._verify_chain
        else:
            draft = (self._draft_selector_tree if self.selector_tree else
                     self._draft_tree_host if self.host_tree else self._draft_tree)
            verify = self._verify_tree
        #: the draft step ``() -> None`` and the verify step ``(bucket) -> payload``: functions of the state alone
        self.draft_step, self.verify_step = draft, verify
        #: how the chain's drafts are accepted: equality with the target's choices, or the rejection rule
        self._accept = self._accept_by_rejection if self.rejection else self._accept_by_match
        #: how a tree is walked: the C++ walk (eager CPU reference rounds) or the device walk
        self._walk = self._walk_on_host if self.host_tree else self._walk_on_device
        self.run_by(draft, verify)

    def run_by(self, draft: Callable[[], None], verify: Callable[[int], torch.Tensor]) -> None:
        """What :meth:`draft` and :meth:`verify`, the calls the host loop makes, run: the steps themselves
        (eager), or what a compiled runner made of them (:class:`~dflash.decoding.compiled.RoundSteps`)."""
        #: the draft step as run (nothing for AR)
        self.draft = draft
        #: the verify step of budget bucket ``bucket`` as run (:attr:`bucket_nodes`; -1, the largest, by default);
        #: returns the payload (:attr:`payload`)
        self.verify = verify

    def _drafter_pass(self):
        """The drafter over ``ctx`` and the block ``[last, MASK x D]``: ``(out, head)``, its final block states
        ``[b, B, H]`` and the same scaled for the lm_head (the drafter's logits are ``softcap(output_multiplier *
        W h)``: :meth:`~dflash.drafter.model.DFlashDraftModel.head_hidden`)."""
        draft = self.draft_model
        ids = torch.cat([self.last[:, None], self.mask_block], 1)  # [b, B]
        embeds = self.adapter.embed(ids, raw_scale=draft.input_embedding_scale)
        window = {} if self.shape.draft_window is None else {"draft_window": self.shape.draft_window}
        out = draft.draft_block(embeds, self.ctx, self.ctx_count, self.dcache, **window)  # [b, B, H]
        return out, draft.head_hidden(out)

    def _draft_nothing(self) -> None:
        """AR: no draft."""

    def _draft_chain(self) -> None:
        """DFlash, drafts at the argmax: ``proposals`` = the argmax of the drafter's logits (the target's lm_head,
        fused or as its module: :mod:`dflash.target.head`) at block rows ``1..D``."""
        _, head = self._drafter_pass()
        proposals = self.adapter.head.argmax(head.reshape(-1, head.shape[-1]), positions=self.draft_rows_flat,
                                             check_bounds=False, softcap=self.draft_model.logit_softcap,
                                             backend=self.backend)
        self.proposals.copy_(proposals.view(self.b, self.D))

    def _tree_candidates(self, head: torch.Tensor):
        """The top-``K`` ids of the drafter's logits at block rows ``1..D`` and their log-probs: ``(logprobs, ids)``,
        each ``[b, D, K]``."""
        logprobs, ids = self.adapter.head.topk(head.reshape(-1, head.shape[-1]), self.K,
                                               positions=self.draft_rows_flat, check_bounds=False,
                                               softcap=self.draft_model.logit_softcap, backend=self.backend)
        return logprobs.view(self.b, self.D, self.K), ids.view(self.b, self.D, self.K)

    def _draft_tree_host(self) -> None:
        """DDTree, eager on the CPU reference backend: the ``b`` trees in one C++ call (the host is the device
        there), with their node scores, into the state (:meth:`_take_trees`)."""
        logprobs, ids = self._tree_candidates(self._drafter_pass()[1])
        self._take_trees(dflash_kernels.build_tree(logprobs, ids, self.budget))

    def _draft_tree(self) -> None:
        """DDTree with the device ops: the ``b`` trees in one fixed-shape build (:func:`dflash_kernels.build_tree`
        with ``on_device=True``, over the round's index tables), with their node scores, into the state."""
        logprobs, ids = self._tree_candidates(self._drafter_pass()[1])
        self._take_trees(dflash_kernels.build_tree(logprobs, ids, self.budget, on_device=True,
                                                   tables=self.tree_tables, backend=self.backend))

    def _take_trees(self, tree) -> None:
        """The batch's trees ``(tokens [b, N], depths [b, N], parents [b, N + 1], scores [b, N])`` of a build into
        the state, and with a budget chosen per round the path masses from the scores.

        A node's score is its path log-prob (the sum of its own and its ancestors' log-probs, given their
        parents: :func:`dflash_kernels.build_tree`), so ``pi_i = exp(score_i)`` is the drafter's probability
        that the target's choices follow the path to ``i``, i.e. that the walk accepts node ``i``. The walk's
        accepted drafts are the number of accepted nodes, so their expectation over bucket ``v``'s tree is
        ``path_mass[r, v] = sum of pi_i over its first N_v nodes``: a cumulative sum read at each bucket's last
        node, in the payload's fixed point (times :data:`MASS_SCALE`, a power of two: exact, then floored).
        Fixed shapes, no host read.
        """
        for state, t in zip((self.tokens, self.depths, self.parents), tree[:3]):
            state.copy_(t)
        if self.auto:
            mass = torch.cumsum(tree[3].exp(), 1).index_select(1, self._bucket_last)  # [b, V]
            self.path_mass.copy_((mass * MASS_SCALE).long())

    def _draft_selector(self) -> None:
        """DFlash2's proposals: the candidate selector's chain over the drafter's top-k at block rows ``1..D``.

        Over the drafter pass's ``out`` and ``head`` (:meth:`_drafter_pass`). Per drafted row ``j`` the unary
        scores are the top ``k`` log-probabilities of the drafter's logits (their ids the candidates);
        the reference package scores with the logits themselves, which differ from these by one constant per
        row: the same argmax and the same ``softmax(scores / T)``. The selector re-scores them from
        ``prev`` = the token chosen before (the anchor ``last`` for row 1) and takes the best (greedy), or
        draws from ``q_j = filtered(softmax(scores_j / T))`` (the target's top-k / top-p / min-p applied to the
        candidates' distribution, as the target's ``p`` is processed: fewer proposals the target's filters
        remove) with uniforms of the device seed (moved on by one, as :meth:`choose` does; each sequence its
        own uniforms); ``q_ids`` / ``q_probs`` keep that ``q`` (the candidates' ids and probabilities, also
        written when greedy), the distribution each proposal was drawn from. The ``b`` sequences in one
        launch.
        """
        out, head = self._drafter_pass()
        draft, s, lm_head = self.draft_model, self.sampling, self.adapter.head
        selector = draft.candidate_selector
        k = self.selector_k
        logprobs, cand = lm_head.topk(head.reshape(-1, head.shape[-1]), k, positions=self.draft_rows_flat,
                                      check_bounds=False, softcap=draft.logit_softcap, backend=self.backend)
        logprobs, cand = logprobs.view(self.b, self.D, k), cand.view(self.b, self.D, k)
        projected = selector.hidden_projection(out[:, 1:])
        temperature, seed, filters = 0.0, None, {}
        if not s.greedy:
            self.seed.add_(1)
            temperature, seed = float(s.temperature), self.seed
            filters = dict(top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
        tokens, _, q = dflash_kernels.select_candidates(
            logprobs, cand, projected, selector.predecessor_codebook.weight, selector.successor_codebook.weight,
            self.last, temperature, seed, backend=self.backend, **filters)
        self.proposals.copy_(tokens)
        self.q_ids.copy_(cand)
        self.q_probs.copy_(q)

    def _draft_selector_tree(self) -> None:
        """The DDTrees of a DFlash2 drafter, into ``tokens / depths / parents``.

        Over the drafter pass's ``out`` and ``head`` (:meth:`_drafter_pass`), the whole batch in each call. Per
        sequence: the selector's ``k`` candidates per drafted row (the top-k of
        the drafter's logits at rows ``1..D``, their log-probs the unary scores) and their log-probs given each
        possible predecessor, ``[D, k, k]`` (:func:`dflash_kernels.selector_child_logprobs`: the anchor
        ``last`` before row 1, candidate ``i`` of row ``d - 1`` before row ``d``); the best-first tree over
        that lattice (:func:`dflash_kernels.build_selector_tree_device`), whose first path is the
        selector's greedy chain. Fixed shapes, no host read; the tree layout of every DDTree round, so the
        verify and the walk are unchanged (the walk commits the target's own choices: no ``q`` is kept).
        """
        out, head = self._drafter_pass()
        draft, lm_head = self.draft_model, self.adapter.head
        selector = draft.candidate_selector
        unary, candidates = lm_head.topk(head.reshape(-1, head.shape[-1]), self.K, positions=self.draft_rows_flat,
                                         check_bounds=False, softcap=draft.logit_softcap, backend=self.backend)
        unary, candidates = unary.view(self.b, self.D, self.K), candidates.view(self.b, self.D, self.K)
        projected = selector.hidden_projection(out[:, 1:])
        child = dflash_kernels.selector_child_logprobs(unary, candidates, projected,
                                                       selector.predecessor_codebook.weight,
                                                       selector.successor_codebook.weight, self.last)  # [b, D, k, k]
        self._take_trees(dflash_kernels.build_selector_tree_device(child, candidates, self.budget,
                                                                   backend=self.backend))

    def _draft_q_form(self) -> str:
        """How this round's drafter gives ``q`` to the rejection rule: ``"dense"`` (its rows through the
        lm_head: :meth:`_draft_sampled_dense`) or ``"sparse"`` (a distribution over candidate ids in ``q_ids`` /
        ``q_probs``: a DFlash2 drafter, whose selector draws its chain itself, :meth:`_draft_selector`)."""
        return "sparse" if self.selector_k else "dense"

    def _draft_sampled_dense(self) -> None:
        """Rejection rule, dense ``q``: ``q_hidden`` = the block rows ``1..D`` of the drafter's head rows ``[b, B,
        H]`` (its final states scaled for the lm_head, :meth:`_drafter_pass`),
        ``proposals`` = one draw from each row's processed distribution through the target's lm_head (the same
        temperature, top-k, top-p, min-p as the target; no final norm or softcap: the rows are normed), keyed by
        the seed. Verify recomputes ``q`` from the same rows with the same op, so it is the proposals' law."""
        self.q_hidden.copy_(self._drafter_pass()[1][:, 1:])
        self.proposals.copy_(self._sample(self.q_hidden.reshape(-1, self.q_hidden.shape[-1]), {}).view(self.b,
                                                                                                          self.D))

    def _verify_chain(self, bucket: int = -1) -> torch.Tensor:
        """The target on the chains ``[last, proposals]`` at ``L + arange(B)``, their acceptance (:attr:`_accept`)
        and the commit; ``bucket`` is the tree's only (a chain has one shape)."""
        length, rows = self.cache.length_t, self.rows[: self.B]
        block = torch.cat([self.last[:, None], self.proposals], 1)  # [b, B]
        hidden, captured = self.adapter.run_pass(block, length[:, None] + rows, self.cache)
        choices, accepted = self._accept(hidden)
        kept = (accepted + 1) * self.alive  # a stopped sequence keeps nothing
        self.ctx.copy_(torch.cat(captured, dim=-1))
        self.ctx_count.copy_(kept)
        self.cache.advance(rows, kept)
        self.last.copy_(choices.gather(1, accepted[:, None])[:, 0])
        return self.payload.pack(choices, accepted)

    def _accept_by_match(self, hidden: torch.Tensor):
        """``(choices [b, B], accepted [b])``: the target's choice after each verify row of ``hidden [b, B, H]``
        (:meth:`choose`) and how many drafts in a row equal it."""
        choices = self.choose(hidden)  # [b, B]
        return choices, torch.cumprod((self.proposals == choices[:, :-1]).long(), 1).sum(1)

    def _accept_by_rejection(self, hidden: torch.Tensor):
        """``(choices [b, B], accepted [b])`` of the rejection rule over the verify rows ``hidden [b, B, H]``:
        ``choices[r, :a]`` the accepted proposals, ``choices[r, a]`` the resampled (or bonus) token. The noise is
        keyed by the seed after moving it on by one; sequence ``r`` draws with that seed plus ``r << 40`` (apart
        from the others; sequence 0 as one sequence does)."""
        s = self.sampling
        self.seed.add_(1)
        choices, accepted = [], []
        for r in range(self.b):
            rows, kw = self.adapter.head_inputs(hidden[r])
            if self.q_form == "dense":
                q = dict(q_hidden=self.q_hidden[r])
            else:
                q = dict(q_ids=self.q_ids[r], q_probs=self.q_probs[r])
            seed = self.seed + (r << 40)
            c, a = self.adapter.head.rejection_sample(rows, self.proposals[r], s.temperature, top_k=s.top_k,
                                                      top_p=s.top_p, min_p=s.min_p, seed=seed, check_bounds=False,
                                                      backend=self.backend, **q, **kw)
            choices.append(c)
            accepted.append(a)
        return torch.stack(choices), torch.cat(accepted)

    def _verify_tree(self, bucket: int = -1) -> torch.Tensor:
        """The verify of each tree's first ``n`` nodes, ``n`` the node count of budget bucket ``bucket`` (all of
        them at a fixed budget), walked by :attr:`_walk`."""
        n = self.bucket_nodes[bucket]
        length = self.cache.length_t
        tokens, depths, parents = self.tokens[:, :n], self.depths[:, :n], self.parents[:, : n + 1]
        ids = torch.cat([self.last[:, None], tokens], 1)  # [b, n + 1]
        positions = length[:, None] + torch.cat([depths.new_zeros(self.b, 1), depths], 1)  # the root at depth 0
        bits = dflash_kernels.ancestor_bits(parents, check=False, backend=self.backend)  # [b, n + 1, W]
        hidden, captured = self.adapter.run_pass(ids, positions, self.cache, tree_bits=bits, tree_parents=parents)
        choices = self.choose(hidden)  # [b, n + 1]
        path, path_len, committed = self._walk(parents, tokens, choices, bits)  # [b, D + 1], [b], [b, D + 1]
        kept = path_len * self.alive  # a stopped sequence keeps nothing
        self.path.copy_(path)
        self.cache.compact_advance(path, kept)
        # every captured layer's rows in one gather of their concatenation: three launches for any layer count
        # (a gather per layer, their cat and the copy were n + 2)
        features = torch.cat(captured, dim=-1)  # [b, n + 1, layers * H]
        self.ctx.copy_(features.gather(1, path[:, :, None].expand(-1, -1, features.shape[-1])))
        self.ctx_count.copy_(kept)
        self.last.copy_(committed.gather(1, (path_len - 1)[:, None])[:, 0])
        # a per-round budget adds, for its choice, the paths' node ids and the path masses
        return self.payload.pack(committed, path_len, path, self.path_mass if self.auto else None)

    def _walk_on_device(self, parents: torch.Tensor, tokens: torch.Tensor, choices: torch.Tensor,
                        bits: torch.Tensor):
        """The walk of the batch's trees with the device op (:func:`dflash_kernels.walk_tree_device`, one call):
        ``(path [b, D+1], path_len [b], committed [b, D+1])``, padded."""
        return dflash_kernels.walk_tree_device(parents, tokens, choices, self.D, bits, backend=self.backend)

    def _walk_on_host(self, parents: torch.Tensor, tokens: torch.Tensor, choices: torch.Tensor,
                      bits: torch.Tensor = None):
        """The C++ walk of the batch's trees (:func:`dflash_kernels.walk_tree` with ``max_depth``, one call):
        ``(path [b, D+1], path_len [b], committed [b, D+1])``, padded as :func:`dflash_kernels.walk_tree_device`
        pads them (unused slots 0; ``bits`` unused)."""
        return dflash_kernels.walk_tree(parents, tokens, choices, self.D)

    def _verify_ar(self, bucket: int = -1) -> torch.Tensor:
        """AR: the target on ``last`` alone, its choice committed."""
        rows = self.rows[:1]
        hidden, _ = self.adapter.run_pass(self.last[:, None], self.cache.length_t[:, None] + rows, self.cache)
        choice = self.choose(hidden)[:, 0]  # [b]
        self.cache.advance(rows, self.alive)
        self.last.copy_(choice)
        return self.payload.pack(choice)

    def mirror(self, committed_before, new) -> None:
        """Refresh the caches' host lengths after a round that found ``committed_before`` tokens and committed
        ``new`` (host ints from the payload, one per sequence or one int; no device read)."""
        before = [committed_before] if isinstance(committed_before, int) else list(committed_before)
        added = [new] if isinstance(new, int) else list(new)
        self.cache.mirror([c - 1 + n for c, n in zip(before, added)])
        if self.dcache is not None:
            self.dcache.mirror([c - 1 for c in before])

    def tree_record(self, length: int, bucket: int = -1, row: int = 0) -> dict:
        """Sequence ``row``'s last DDTree round: its tree (the verified bucket's) and accepted path (host copies,
        for ``return_trees``)."""
        host = lambda t: t.to("cpu", copy=True)  # noqa: E731  (a copy on the CPU too: the state is reused)
        n = self.bucket_nodes[bucket]
        return dict(tokens=host(self.tokens[row, :n]), depths=host(self.depths[row, :n]),
                    parents=host(self.parents[row, : n + 1]), accepted=host(self.path[row, :length]))

    def stop(self, rows) -> None:
        """Sequences ``rows`` (host ints) stopped: from the next round on they commit nothing. One small upload
        (the host decided it), not a read; a round without a newly stopped sequence makes none."""
        keep = self._keep_host  # the previous upload finished: the round's read since waited for the stream
        keep.fill_(1)
        keep[list(rows)] = 0
        self._keep.copy_(keep, non_blocking=True)
        self.alive.mul_(self._keep)

    # ---------------------------------------------------------------- compile / capture support
    def _caches(self):
        return (self.cache,) if self.dcache is None else (self.cache, self.dcache)

    def freeze(self) -> None:
        """Both caches in their round form (at their current, eager lengths)."""
        for cache in self._caches():
            cache.freeze()

    def thaw(self) -> None:
        """Both caches back to empty eager caches (their device tensors kept)."""
        for cache in self._caches():
            cache.thaw()
        if getattr(self.cache, "linear", None) is not None:
            self.cache.linear.reset()

    def _mutable(self) -> dict:
        """The small tensors a step changes, besides cache rows past the committed lengths."""
        names = ["last", "seed", "alive"] + ([] if self.method == "ar" else ["ctx", "ctx_count"])
        state = {n: getattr(self, n) for n in names}
        for i, cache in enumerate(self._caches()):
            state[f"length_{i}"] = cache.length_t
        linear = getattr(self.cache, "linear", None)
        if linear is not None:  # hybrid targets: the committed conv windows and recurrent states
            state["conv"], state["state"] = linear.conv, linear.state
        return state

    def snapshot(self) -> None:
        """Remember the small state, so warm-up and capture rounds can be undone (:meth:`restore`)."""
        self._saved = {name: t.clone() for name, t in self._mutable().items()}

    def restore(self) -> None:
        for name, t in self._mutable().items():
            t.copy_(self._saved[name])

    def move_snapshot(self, rows: int) -> None:
        """Move the snapshot's committed lengths and the caches' host mirrors on by ``rows`` (back when negative):
        the rounds :meth:`restore` starts then run as if ``rows`` more tokens were committed, over whatever the
        caches hold there (a cost measurement at a longer prefix)."""
        for i, cache in enumerate(self._caches()):
            self._saved[f"length_{i}"] += int(rows)
            cache.lengths = [n + int(rows) for n in cache.lengths]
