"""The measured seconds per budget bucket behind ``tree_budget="auto"``, and the key they are kept under.

A round whose budget is chosen per round (:class:`~dflash.decoding.budget_policy.BudgetPolicy`)
needs ``c_v(L)``: the seconds of a round of bucket ``v`` (draft + verify + the
payload's read) with ``L`` tokens committed. :func:`measure_round_costs` times
the round's own steps at two committed lengths, ``L_0`` (the set-up's prompt)
and ``L_1`` (the most the caches hold for a round of the largest bucket), giving
two ``[V]`` vectors the policy interpolates linearly in ``L``.
:func:`attach_budget_policy` makes that policy once per :func:`costs_key` and
keeps it on the target, so later generations with the same settings (any prompt
length, any cache size) measure nothing.

It times the round's :meth:`~dflash.decoding.round.Round.draft` and
:meth:`~dflash.decoding.round.Round.verify` as the generation runs them (the
steps themselves, or a compiled runner's), so this module sits below the
runner.
"""

from __future__ import annotations

import time

from .budget_policy import BudgetPolicy
from .options import RoundShape

__all__ = ["attach_budget_policy", "costs_key", "measure_round_costs"]


def measure_round_costs(rnd, repeats: int = 5):
    """Seconds of a round (draft + verify + the payload's read) per budget bucket, at two cache lengths:
    ``(lengths, short [V], long [V])``. ``lengths[0]``: the committed tokens now (the set-up's prompt);
    ``lengths[1]``: the most the caches hold for a round of the largest bucket (both caches moved on by the
    same count). Each value the median of ``repeats`` after one untimed round (on a GPU its kernels' first
    launches compile), the buckets taking turns repeat by repeat. The state is put back
    (:meth:`Round.snapshot`, and the caches' host lengths), as :meth:`RoundSteps.prepare` does."""
    buckets = len(rnd.bucket_nodes)
    rnd.freeze()
    rnd.snapshot()
    committed = rnd.cache.length + 1
    caches = [(rnd.cache, rnd.T)] + ([] if rnd.dcache is None else [(rnd.dcache, rnd.B)])
    grow = max(0, min(cache.max_len - cache.length - rows for cache, rows in caches) - 1)
    results, moved = [], 0
    try:
        for extra in (0, grow):
            rnd.move_snapshot(extra - moved)
            moved = extra
            times = [[] for _ in range(buckets)]
            for i in range(repeats + 1):  # the buckets take turns, so a slow phase of the machine hits all
                for bucket in range(buckets):
                    rnd.restore()
                    t0 = time.perf_counter()
                    rnd.draft()
                    rnd.verify(bucket).to("cpu")
                    if i:
                        times[bucket].append(time.perf_counter() - t0)
            results.append([sorted(t)[len(t) // 2] for t in times])
    finally:
        rnd.move_snapshot(-moved)
        rnd.restore()
        rnd.thaw()
    return (committed, committed + max(grow, 1)), results[0], results[1]


def attach_budget_policy(target, key, rnd):
    """``(policy, seconds)``: for a round whose budget is chosen per round, the target's :class:`BudgetPolicy` for
    ``key`` (:func:`costs_key`: the settings that decide what a round costs, not the prompt's length nor the
    cache rows), made on first use from the round's measured seconds per bucket
    (:func:`measure_round_costs`, at the empty cache and at the longest prefix this
    round's caches hold, interpolated in the committed length) and kept on the target, so the measurement and
    the estimates it learns carry over to every later generation with those settings, at any prompt length;
    and the seconds the measurement took (0 when known). ``(None, 0.0)`` for a fixed budget."""
    if not rnd.auto:
        return None, 0.0
    known = getattr(target, "_dflash_budget_policies", None)
    if not isinstance(known, dict):
        known = {}
        try:
            setattr(target, "_dflash_budget_policies", known)
        except AttributeError:  # pragma: no cover - a target that refuses attributes: measured every call
            pass
    if key in known:
        return known[key], 0.0
    t0 = time.perf_counter()
    lengths, short, long = measure_round_costs(rnd)
    known[key] = policy = BudgetPolicy(short, long, lengths)
    return policy, time.perf_counter() - t0


def costs_key(shape: RoundShape, draft, sampling, adapter, mode, compile_options: str, batch_bucket: int) -> tuple:
    """What a round's measured costs (:func:`attach_budget_policy`) are kept under: the round's shape (method,
    block, budget buckets, acceptance), the drafter, greedy or sampled and which filters (not their values), both
    dtypes, the device, what runs the steps (``mode`` and ``compile_options``, the repr of the compile keywords)
    and ``batch_bucket``, the batch-size bucket as compiled rounds round it (1, 2, 4, 8, ...:
    :func:`~dflash.decoding.compiled.batch_bucket`). Not the prompt's length nor the cache rows: the costs are
    measured as a function of the committed length (the policy interpolates them), and a compiled round's other
    cache sizes are corrected by the rounds' own seconds (the residuals), as any other error of the set-up
    measurement. So one measurement serves every prompt length, and every batch size of its bucket (an eager
    batch of 3 is measured as 3 and serves 4, and the other way round); the first generation of a new batch-size
    bucket measures that bucket once."""
    draft_dtype = str(draft.fc.weight.dtype) if shape.method != "ar" else None
    kind = (sampling.greedy, tuple(sorted(sampling.active())))
    return (shape, id(draft) if shape.method != "ar" else None, kind, str(adapter.dtype), draft_dtype,
            str(adapter.device), mode, compile_options, batch_bucket)
