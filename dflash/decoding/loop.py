"""The host loop of every generation (AR, DFlash, DDTree; eager or compiled): one screen.

::

    adapter opens (patches on) -> options resolved -> round leased (a fresh one, or the pooled compiled one)
                      with its budget policy
    rnd.start(prompts): each row prefilled, its first token, drafter ingests it, caches frozen
    while a row is live: check room -> [budget bucket chosen] -> rnd.draft() -> payload = rnd.verify(bucket)
                      -> ONE host read (every row) -> rnd.payload decodes each live row's committed tokens ->
                      its stop rules, streamer, stats; host mirrors of the lengths -> [the budget policy told
                      what the round accepted] -> rows that just ended leave the batch (eager) or stop
                      committing (traced: one small upload)

Nothing here touches the round's device state: the round's two steps own it
(:mod:`dflash.decoding.round`: ``draft`` / ``verify`` are its steps, chosen once per round); ``compile`` only
changes what runs them (:mod:`dflash.decoding.compiled` wraps exactly those two callables).
"""

from __future__ import annotations

import time

import torch

from ..target import TargetAdapter
from .compiled import batch_bucket, lease_round
from .options import LoopOptions, check_pair, prepare_prompts
from .output import CommittedOutput, HostReader, SeedSource, StageClock
from .result import GenerationResult

__all__ = ["generate_rounds"]


@torch.inference_mode()
def generate_rounds(target, draft, input_ids, method: str, options: LoopOptions, compile=False,
                    max_cache_len=None) -> GenerationResult:
    """Generate with ``method`` under ``options``; ``compile`` as :data:`~dflash.decoding.compiled.COMPILE_MODES`;
    ``max_cache_len``: the tokens a new compiled round's caches are sized for at least
    (:func:`~dflash.decoding.compiled.reserved_rows`; eager rounds ignore it).

    ``input_ids``: one prompt, or a left-padded batch with ``options.attention_mask``: every row runs in the same
    rounds, each with its own lengths and commit (:mod:`dflash.decoding.round`)."""
    if compile is None:
        compile = False
    if compile is not False and options.return_trees:
        raise ValueError("return_trees=True keeps each round's tree on the host, which compiled rounds do not do; "
                         "use compile=False to get the trees")
    adapter = TargetAdapter(target, draft.target_layer_ids if method != "ar" else ())
    try:
        if method != "ar":
            check_pair(adapter, draft)
        shape = options.resolve(method, draft, adapter.vocab_size)
        prompts, padded = prepare_prompts(input_ids, adapter.vocab_size, adapter.device, options.attention_mask)
        batch = batch_bucket(len(prompts), compile)
        seeds = SeedSource(options.seed)
        total = max(p.numel() for p in prompts) + options.max_new_tokens
        with lease_round(target, adapter, draft, shape, options.sampling, total, compile, batch,
                         max_cache_len=max_cache_len) as (rnd, policy, setup):
            result = _run(rnd, policy, prompts, padded, options, seeds.next())
            result.compile_time = setup
            for one in [result, *result.rows]:
                one.head_path = adapter.head.path
            return result
    finally:
        adapter.close()


def _run(rnd, policy, prompts, padded: torch.Tensor, options: LoopOptions, seed: int) -> GenerationResult:
    n, b = len(prompts), rnd.b
    timed = True
    if policy is not None:
        policy.start()
        if not rnd.sampling.greedy:  # reproducible under a seed (BudgetPolicy.fresh)
            policy, timed = policy.fresh(), False
    rnd.reset(seed)
    # a compiled round's batch bucket may hold more sequences than prompts: the extra ones run the first prompt's
    # first token, stopped from the start (computed, never committed)
    filler = [prompts[0][:1]] * (b - n)
    outs = [CommittedOutput(p, options.max_new_tokens, options.stop_ids, stopping_criteria=options.stopping_criteria,
                            streamer=options.streamer) for p in prompts]
    rows = [GenerationResult(output_ids=p[None], num_prompt_tokens=p.numel(), method=rnd.method, block_size=rnd.B)
            for p in prompts]
    try:
        reader = HostReader(rnd.device, rnd.payload.size * b)
        start = time.perf_counter()
        firsts = reader.read(rnd.start(list(prompts) + filler, chunk_size=options.prefill_chunk_size))
        for out, first in zip(outs, firsts):
            out.extend([first])
        first_time = time.perf_counter() - start
        # the round's sequences in batch order: the prompt index of each (None: a filler); what each one's caches
        # hold. An eager round drops a sequence that stopped (Round.retire: the last one takes its index); a
        # traced one keeps its fixed batch and masks it (Round.stop).
        order = list(range(n)) + [None] * (b - n)
        device_committed = [out.committed for out in outs] + [1] * (b - n)
        _leave(rnd, order, device_committed, [i for i in range(b) if order[i] is None or outs[order[i]].done])
        clock = StageClock(rnd.device, options.stage_timing)
        while not all(out.done for out in outs):
            live = [i for i, r in enumerate(order) if r is not None and not outs[r].done]
            before = [outs[order[i]].committed for i in live]
            rnd.check_room([device_committed[i] for i in live])  # host ints: no round writes past a cache
            bucket = policy.choose(max(before)) if policy is not None else -1
            began = time.perf_counter()
            rnd.draft()
            clock.mark("draft")
            payload = rnd.verify(bucket)
            clock.mark("verify")
            host = rnd.payload.rows(reader.read(payload))
            news = [rnd.payload.committed(host[i]) if i in live else [] for i in range(rnd.b)]
            if policy is not None:
                _observe(policy, rnd, bucket, [host[i] for i in live], time.perf_counter() - began if timed else 0.0,
                         max(before))
            rnd.mirror(device_committed, [len(new) for new in news])
            ended = []
            for i, committed in zip(live, before):
                new, r = news[i], order[i]
                row, out = rows[r], outs[r]
                device_committed[i] += len(new)
                out.extend(new)
                row.acceptance_lengths.append(out.committed - committed)  # after the stop rules
                if rnd.method != "ar":
                    row.accepted_depths.append(len(new) - 1)  # as verified: the drafts before the bonus token
                if rnd.method == "ddtree":
                    row.tree_sizes.append(rnd.bucket_nodes[bucket])
                    if options.return_trees:
                        row.trees.append(rnd.tree_record(len(new), bucket, i))
                if out.done:
                    ended.append(i)
            if ended:
                _leave(rnd, order, device_committed, ended)
            clock.mark("commit")
        total = time.perf_counter() - start
        stages = clock.totals()
        for out, row in zip(outs, rows):
            row.output_ids = torch.tensor([out.tokens], device=rnd.device)
            row.time_to_first_token, row.total_time = first_time, total
            row.draft_time = stages.get("draft", 0.0)
            row.verify_time = stages.get("verify", 0.0)
            row.commit_time = stages.get("commit", 0.0)
        if n == 1 and padded.shape[1] == prompts[0].numel():
            return rows[0]
        return _batch_result(rows, padded, options.pad_token_id)
    finally:
        for out in outs:
            out.close()
        rnd.thaw()


def _leave(rnd, order: list, device_committed: list, ended) -> None:
    """Sequences ``ended`` (indices of the round's batch) stop: an eager round drops them (the batch narrows;
    ``order`` and ``device_committed`` follow the moves), a traced one keeps them, masked. Never the last
    sequence of an eager round (the loop ends with it)."""
    if not ended:
        return
    if rnd.traced:
        rnd.stop(ended)
        return
    for i in sorted(ended, reverse=True):  # from the back: each move takes the batch's last sequence
        if rnd.b == 1:
            break
        rnd.retire(i)
        order[i], device_committed[i] = order[-1], device_committed[-1]
        order.pop()
        device_committed.pop()


def _observe(policy, rnd, bucket: int, live_rows, seconds: float, length: int) -> None:
    """Tell the budget policy what a round of several sequences did: each bucket's acceptance and mass averaged
    over the live sequences (the batch's expected committed tokens are the live count times one sequence's, so
    the best bucket per second is the same)."""
    accepted = [rnd.payload.bucket_acceptance(row) for row in live_rows]
    masses = [rnd.payload.path_masses(row) for row in live_rows]
    k = len(live_rows)
    policy.observe(bucket, [sum(a[v] for a in accepted) / k for v in range(len(accepted[0]))],
                   [sum(m[v] for m in masses) / k for v in range(len(masses[0]))], seconds, length)


def _batch_result(rows, padded: torch.Tensor, pad_token_id) -> GenerationResult:
    """One result for a batch (or a left-padded prompt): ``output_ids [b, T + n]`` = the input as given, then each
    row's new tokens padded to the longest with ``pad_token_id`` (transformers' layout); the rows' results in
    ``rows``; the pooled statistics (every row's rounds) in the result's own lists."""
    width = max(row.num_new_tokens for row in rows)
    if pad_token_id is None and any(row.num_new_tokens < width for row in rows):
        raise ValueError("rows of this batch ended at different lengths and no pad_token_id (nor eos) is set to "
                         "pad them: pass pad_token_id=")
    new = torch.full((len(rows), width), -1 if pad_token_id is None else int(pad_token_id), dtype=torch.long,
                     device=padded.device)
    for r, row in enumerate(rows):
        new[r, : row.num_new_tokens] = row.generated_ids[0]
    first = rows[0]
    result = GenerationResult(output_ids=torch.cat([padded, new], 1), num_prompt_tokens=padded.shape[1],
                              method=first.method, block_size=first.block_size, rows=list(rows),
                              time_to_first_token=first.time_to_first_token, total_time=first.total_time,
                              draft_time=first.draft_time, verify_time=first.verify_time,
                              commit_time=first.commit_time)
    for row in rows:
        result.acceptance_lengths += row.acceptance_lengths
        result.accepted_depths += row.accepted_depths
        result.tree_sizes += row.tree_sizes
        result.trees += row.trees
    return result
