"""The host loop of every generation (AR, DFlash, DDTree; eager or compiled): one screen.

::

    adapter opens (patches on) -> options resolved -> steps leased (a fresh round, or the pooled compiled one)
    round.start(prompt): prefill, first token, drafter ingests the prompt, caches frozen
    while not done:   check room -> [budget bucket chosen] -> steps.draft() -> payload = steps.verify(bucket)
                      -> ONE host read -> committed tokens -> stop rules, streamer, stats, host mirrors of
                      the lengths -> [the budget policy told what the round accepted]

Nothing here touches the round's device state: the round's two steps own it
(:mod:`dflash.decoding.round`); ``compile`` only changes what runs them
(:mod:`dflash.decoding.compiled`).
"""

from __future__ import annotations

import time

import torch

from ..target import TargetAdapter
from .compiled import lease_steps
from .options import LoopOptions, check_pair, prepare_prompt
from .output import CommittedOutput, HostReader, SeedSource, StageClock
from .result import GenerationResult

__all__ = ["generate_rounds"]


@torch.inference_mode()
def generate_rounds(target, draft, input_ids, method: str, options: LoopOptions, compile=False) -> GenerationResult:
    """Generate with ``method`` under ``options``; ``compile`` as :data:`~dflash.decoding.compiled.COMPILE_MODES`."""
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
        prompt = prepare_prompt(input_ids, adapter.vocab_size, adapter.device)
        seeds = SeedSource(options.seed)
        total = prompt.numel() + options.max_new_tokens
        with lease_steps(target, adapter, draft, shape, options.sampling, total, compile) as (steps, setup):
            result = _run(steps, prompt, options, seeds.next())
            result.compile_time = setup
            return result
    finally:
        adapter.close()


def _run(steps, prompt: torch.Tensor, options: LoopOptions, seed: int) -> GenerationResult:
    rnd = steps.rnd
    policy = steps.policy
    if policy is not None:
        policy.start()
    rnd.reset(seed)
    out = CommittedOutput(prompt, options.max_new_tokens, options.stop_ids,
                          stopping_criteria=options.stopping_criteria, streamer=options.streamer)
    try:
        result = GenerationResult(output_ids=prompt[None], num_prompt_tokens=prompt.numel(), method=rnd.method,
                                  block_size=rnd.B)
        reader = HostReader(rnd.device, rnd.payload_size)
        start = time.perf_counter()
        out.extend(reader.read(rnd.start(prompt)))
        result.time_to_first_token = time.perf_counter() - start
        clock = StageClock(rnd.device, options.stage_timing)
        while not out.done:
            before = out.committed
            rnd.check_room(before)  # host ints: a round never writes past either cache
            bucket = policy.choose(before) if policy is not None else -1
            began = time.perf_counter()
            steps.draft()
            clock.mark("draft")
            payload = steps.verify(bucket)
            clock.mark("verify")
            host = reader.read(payload)
            new = rnd.committed_tokens(host)
            if policy is not None:
                policy.observe(bucket, rnd.bucket_acceptance(host), rnd.path_masses(host),
                               time.perf_counter() - began, before)
            rnd.mirror(before, len(new))
            out.extend(new)
            result.acceptance_lengths.append(out.committed - before)  # after the stop rules
            if rnd.method != "ar":
                result.accepted_depths.append(len(new) - 1)  # as verified: the drafts before the bonus token
            if rnd.method == "ddtree":
                result.tree_sizes.append(rnd.bucket_nodes[bucket])
                if options.return_trees:
                    result.trees.append(rnd.tree_record(len(new), bucket))
            clock.mark("commit")
        result.total_time = time.perf_counter() - start
        stages = clock.totals()
        result.draft_time = stages.get("draft", 0.0)
        result.verify_time = stages.get("verify", 0.0)
        result.commit_time = stages.get("commit", 0.0)
        result.output_ids = torch.tensor([out.tokens], device=rnd.device)
        return result
    finally:
        out.close()
        rnd.thaw()
