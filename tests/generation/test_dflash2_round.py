"""DFlash2 chain rounds: the candidate selector drafts, the output stays the target's own.

* greedy generation with a random DFlash2 drafter (selector codebooks large enough to re-rank the
  drafter's top-k) equals ``target.generate()``, eagerly, as fixed-shape steps and traced;
* the round's proposals are the selector's chain over the drafter's top-k (:func:`select_reference` on
  torch logits), not the lm_head argmax, and ``q_ids / q_probs`` hold the distribution they came from;
* z-lab's drafter scalars (``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping``)
  change the proposals and keep the output lossless;
* sampled rounds draw the selector from the device seed: reproducible, one host read per round.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import dflash
import dflash_kernels
from dflash.decoding import compiled
from dflash.drafter.dflash2 import select_reference
from prompts import PROMPT, greedy
from tiny_models import tiny_dflash2_draft, tiny_target

PROMPTS = [PROMPT, [88, 4]]
N = 24


@pytest.fixture(autouse=True)
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", layers=4)


@pytest.fixture(scope="module")
def draft(target):
    return tiny_dflash2_draft(target, block_size=6, target_layer_ids=[0, 2])


def test_greedy_dflash2_is_lossless(target, draft):
    for prompt in PROMPTS:
        ref = greedy(target, N, prompt)
        out = dflash.generate(target, draft, prompt, max_new_tokens=N)
        assert torch.equal(out.output_ids, ref)
        static = dflash.generate(target, draft, prompt, max_new_tokens=N, compile="static")
        assert torch.equal(static.output_ids, ref)
        assert static.acceptance_lengths == out.acceptance_lengths


@pytest.mark.parametrize("block_size", [3, 4])
def test_a_smaller_block_than_the_drafters_is_lossless(target, draft, block_size):
    """The convolutions run along the round's own block (here shorter than the drafter's block size of 6), not
    the config's: the drafter's pass takes any block size >= 2, as a DFlash drafter's does."""
    prompt = PROMPTS[0]
    out = dflash.generate(target, draft, prompt, max_new_tokens=N, block_size=block_size)
    assert torch.equal(out.output_ids, greedy(target, N, prompt))
    assert max(out.acceptance_lengths) <= block_size


def test_a_block_shorter_than_the_convolutions_is_refused(target, draft):
    with pytest.raises(ValueError, match="block_size must be >= 3 for this DFlash2 drafter"):
        dflash.generate(target, draft, PROMPTS[0], max_new_tokens=4, block_size=2)


def _first_round(target, draft, prompt, **kw):
    """The pooled round of a one-round static generation (its proposals and q are the first round's; its
    state of one sequence: row 0 of the batch dimension)."""
    dflash.generate(target, draft, prompt, max_new_tokens=2, compile="static", **kw)
    steps = [s for k, s in target._dflash_compiled_rounds.items() if k[1] == id(draft) and "static" in k]
    return steps[-1].rnd


def _expected_chain(target, draft, prompt):
    """The first round's proposals by hand: the drafter's block states, torch logits, top-k, the chain."""
    from dflash.target.adapter import TargetAdapter

    # a twin: transformers leaves output-capturing hooks on a model asked for hidden states, which dynamo
    # cannot trace in a later compiled generation of the same model
    twin = tiny_target("qwen3", layers=4)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), target.state_dict().values()))
    target = twin
    with TargetAdapter(target, draft.target_layer_ids) as adapter, torch.no_grad():
        ids = torch.tensor(prompt)
        full = target(ids[None], output_hidden_states=True)
        hs, first = full.hidden_states, full.logits[0, -1].argmax()
        ctx = torch.cat([hs[i + 1][0] for i in draft.target_layer_ids], -1)
        block = torch.cat([first[None], torch.full((draft.block_size - 1,), draft.mask_token_id)])
        embeds = adapter.embed(block, raw_scale=draft.input_embedding_scale)
        out = draft(embeds, ctx, torch.arange(len(prompt) + draft.block_size))[1:]
        logits = target.lm_head(draft.head_hidden(out)).float()
        if draft.logit_softcap:
            logits = draft.logit_softcap * torch.tanh(logits / draft.logit_softcap)
        sel = draft.candidate_selector
        unary, cand = logits.topk(sel.top_k, -1)
        tokens, _, q = select_reference(unary, cand, sel.hidden_projection(out), sel.predecessor_codebook.weight,
                                        sel.successor_codebook.weight, first[None])
        return tokens, cand, q, logits.argmax(-1)


@pytest.mark.parametrize("extra", [{}, dict(input_embedding_scale=1.5, output_multiplier=0.75,
                                            final_logit_softcapping=4.0)])
def test_proposals_are_the_selector_chain(target, extra):
    draft = tiny_dflash2_draft(target, block_size=6, target_layer_ids=[0, 2], seed=2, **extra)
    tokens, cand, q, argmax = _expected_chain(target, draft, PROMPTS[0])
    rnd = _first_round(target, draft, PROMPTS[0])
    assert torch.equal(rnd.proposals[0], tokens)
    assert not torch.equal(tokens, argmax), "the selector's codebooks are too small to change the chain"
    assert rnd.q_ids.shape == rnd.q_probs.shape == (1, 5, draft.candidate_selector.top_k)
    assert rnd.q_ids.dtype == torch.int64 and rnd.q_probs.dtype == torch.float32
    assert torch.equal(rnd.q_ids[0], cand)
    torch.testing.assert_close(rnd.q_probs[0], q)
    for ref in PROMPTS:
        assert torch.equal(dflash.generate(target, draft, ref, max_new_tokens=N).output_ids, greedy(target, N, ref))


def test_zlab_scalars_change_the_drafter(target):
    plain = tiny_dflash2_draft(target, block_size=6, target_layer_ids=[0, 2], seed=2)
    scaled = tiny_dflash2_draft(target, block_size=6, target_layer_ids=[0, 2], seed=2, output_multiplier=0.25,
                                final_logit_softcapping=2.0, input_embedding_scale=3.0)
    assert (scaled.input_embedding_scale, scaled.output_multiplier, scaled.logit_softcap) == (3.0, 0.25, 2.0)
    assert (plain.input_embedding_scale, plain.output_multiplier, plain.logit_softcap) == (None, 1.0, None)
    a = _expected_chain(target, plain, PROMPTS[0])[0]
    b = _expected_chain(target, scaled, PROMPTS[0])[0]
    assert not torch.equal(a, b)


def test_sampled_selector_rounds(target, draft):
    kw = dict(max_new_tokens=N, do_sample=True, temperature=0.9)
    a = dflash.generate(target, draft, PROMPTS[0], seed=5, **kw)
    b = dflash.generate(target, draft, PROMPTS[0], seed=5, compile="static", **kw)
    c = dflash.generate(target, draft, PROMPTS[0], seed=6, **kw)
    assert torch.equal(a.output_ids, b.output_ids) and a.acceptance_lengths == b.acceptance_lengths
    assert not torch.equal(a.output_ids, c.output_ids)
    rnd = _first_round(target, draft, PROMPTS[0], do_sample=True, temperature=0.9, seed=5)
    hit = rnd.q_ids[0] == rnd.proposals[0, :, None]
    assert torch.equal(hit.sum(-1), torch.ones(5, dtype=torch.long))  # each proposal is one of its candidates
    assert bool((rnd.q_probs[0][hit] > 0).all())
    torch.testing.assert_close(rnd.q_probs[0].sum(-1), torch.ones(5))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_one_host_read_per_round(target, draft, temperature):
    from host_reads import reads_per_round

    result = {}

    def run():
        result["r"] = dflash.generate(target, draft, PROMPTS[0], max_new_tokens=14, temperature=temperature, seed=1,
                                      do_sample=temperature > 0, stage_timing=True)

    per_round, reads, marks = reads_per_round(run, "commit")
    assert len(marks) == result["r"].num_rounds >= 3
    assert max(per_round) <= 1, reads


def test_traced_rounds(monkeypatch, target, draft):
    monkeypatch.setattr(compiled, "COMPILE_OPTIONS", dict(backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    try:
        for kw in (dict(), dict(do_sample=True, temperature=0.7, seed=3)):
            eager = dflash.generate(target, draft, PROMPTS[0], max_new_tokens=N, **kw)
            fast = dflash.generate(target, draft, PROMPTS[0], max_new_tokens=N, compile=True, **kw)
            assert torch.equal(fast.output_ids, eager.output_ids)
            assert fast.acceptance_lengths == eager.acceptance_lengths
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 4  # draft + verify, greedy and sampled
        assert torch.equal(dflash.generate(target, draft, PROMPTS[1], max_new_tokens=N, compile=True).output_ids,
                           greedy(target, N, PROMPTS[1]))
    finally:
        torch._dynamo.reset()
