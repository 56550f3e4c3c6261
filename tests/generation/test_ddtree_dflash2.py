"""DDTree rounds over a DFlash2 drafter: the tree grows from the candidate selector's conditional scores.

* the round builds its tree with ``build_selector_tree_device`` (once per round) from the selector's child
  log-probs, and that tree is the heap reference's;
* generation is lossless against ``target.generate`` (greedy), for budgets below ``D``, above what ``D`` levels
  of ``selector_top_k`` children hold, and with a drafter whose drafts are often right (branches accepted);
* sampling is reproducible under a seed; compiled steps give the eager tokens, greedy and sampled;
* one host read per round.
"""

from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

import dflash
import dflash_kernels
from dflash import DFlash2DraftModel
from dflash.decoding import compiled
from dflash.drafter.config import make_draft_config
from dflash_kernels import reference as ref
from prompts import PROMPT, greedy
from host_reads import reads_per_round
from tiny_models import TableDraft2, tiny_target

@pytest.fixture(autouse=True)
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


def dflash2_draft(target, *, block_size=4, top_k=3, selector_std=1.0, seed=3):
    """A random tiny DFlash2 drafter; selector weights of ``selector_std`` so its bilinear term matters."""
    cfg = target.config
    config = make_draft_config(hidden_size=cfg.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=2 * cfg.hidden_size,
                               vocab_size=cfg.vocab_size, num_target_layers=cfg.num_hidden_layers,
                               block_size=block_size, mask_token_id=cfg.vocab_size - 1, max_position_embeddings=512,
                               target_layer_ids=[0, cfg.num_hidden_layers - 1], conv_kernel_size=2,
                               conv_group_size=8, selector_rank=8, selector_top_k=top_k)
    torch.manual_seed(seed)
    draft = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith("candidate_selector."):
                p.normal_(0.0, selector_std)
    return draft


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", layers=3, hidden=32)


@pytest.fixture(scope="module")
def rigged(target):
    reference = greedy(target, 48)
    base = dflash2_draft(target, block_size=4, top_k=3, selector_std=0.3)
    return TableDraft2(base, target.lm_head.weight, reference), reference


def spy_selector_tree():
    """Wrap ``dflash_kernels.selector_child_logprobs`` and ``build_selector_tree_device``: per round, the
    selector's inputs and ``(child, candidates, budget, tree)``."""
    inputs, calls = [], []
    real_child, real_build = dflash_kernels.selector_child_logprobs, dflash_kernels.build_selector_tree_device

    def child_logprobs(*args):
        inputs.append(tuple(a.clone() for a in args))  # the anchor is the round's `last`, rewritten by the verify
        return real_child(*args)

    def build(child, candidates, budget, **kw):
        tree = real_build(child, candidates, budget, **kw)
        calls.append((child, candidates, budget, tree))
        return tree

    patches = [mock.patch.object(dflash_kernels, "selector_child_logprobs", child_logprobs),
               mock.patch.object(dflash_kernels, "build_selector_tree_device", build)]
    return inputs, calls, patches


def first_path(tree):
    tokens, _, parents = tree[:3]
    path, node = [], 0
    while True:
        children = [i for i in range(1, parents.numel()) if parents[i] == node]
        if not children:
            return path
        node = children[0]
        path.append(int(tokens[node - 1]))


@pytest.mark.parametrize("block_size,top_k,budget", [(4, 3, 2), (4, 3, 8), (4, 2, 20), (6, 4, 16)])
def test_greedy_is_lossless_and_the_tree_is_the_selectors(target, block_size, top_k, budget):
    draft = dflash2_draft(target, block_size=block_size, top_k=top_k)
    inputs, calls, patches = spy_selector_tree()
    with patches[0], patches[1]:
        res = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=20, tree_budget=budget,
                              return_trees=True)
    assert torch.equal(res.output_ids, greedy(target, 20))
    n = dflash_kernels.tree_size(block_size - 1, top_k, budget)
    assert len(calls) == res.num_rounds and res.tree_sizes == [n] * res.num_rounds
    assert len(inputs) == res.num_rounds
    for args, (child, candidates, b, tree), record in zip(inputs, calls, res.trees):
        assert child.shape == (1, block_size - 1, top_k, top_k) and b == budget  # a batch of one sequence
        child, candidates, tree = child[0], candidates[0], [t[0] for t in tree]
        want = ref.build_selector_tree(child, candidates, budget)
        assert all(torch.equal(x, y) for x, y in zip(tree, want))
        assert torch.equal(record["tokens"], tree[0]) and torch.equal(record["parents"], tree[2])
        # the tree's first path is the DFlash2 chain of the same selector inputs
        unary, cand, projected, predecessor, successor, anchor = args  # of the batch of one sequence
        assert unary.shape == (1, block_size - 1, top_k) and anchor.shape == (1,)
        with torch.inference_mode():  # the round's tensors are inference tensors; the codebooks need grads
            chain = dflash_kernels.select_candidates(unary[0], cand[0], projected[0], predecessor, successor,
                                                     anchor, 0.0)[0].tolist()
        path = first_path(tree)
        assert len(path) >= 1 and path == chain[: len(path)]


def test_accepted_branches_stay_lossless(target, rigged):
    draft, reference = rigged
    res = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=40, tree_budget=8,
                          return_trees=True)
    assert torch.equal(res.output_ids, reference[:, : len(PROMPT) + 40])
    assert res.tau > 1.5 and len(set(res.acceptance_lengths)) > 1
    # some accepted node is not its parent's first child: the walk took a branch of the tree
    branched = False
    for t in res.trees:
        parents = t["parents"].tolist()
        for node in t["accepted"].tolist()[1:]:
            branched |= node != min(i for i in range(1, len(parents)) if parents[i] == parents[node])
    assert branched


def test_sampling_is_reproducible(target):
    draft = dflash2_draft(target, block_size=4, top_k=3)
    kw = dict(method="ddtree", max_new_tokens=16, temperature=0.9, tree_budget=6)
    a = dflash.generate(target, draft, PROMPT, seed=5, **kw)
    b = dflash.generate(target, draft, PROMPT, seed=5, **kw)
    c = dflash.generate(target, draft, PROMPT, seed=6, **kw)
    assert torch.equal(a.output_ids, b.output_ids) and not torch.equal(a.output_ids, c.output_ids)


@pytest.fixture
def trace_only(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE_OPTIONS", dict(backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_steps_trace_as_one_graph_each(trace_only, target, rigged):
    draft, reference = rigged
    res = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=24, tree_budget=8, compile=True)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2  # the draft step and the verify step
    assert torch.equal(res.output_ids, reference[:, : len(PROMPT) + 24])


def test_inductor_compiled_equals_eager_sampled(target, rigged):
    """inductor's steps (one compile, ~1 min here: the greedy tokens are checked traced, above) give the eager
    round's sampled tokens and acceptance under one seed."""
    torch._dynamo.reset()
    draft, _ = rigged
    kw = dict(method="ddtree", max_new_tokens=16, tree_budget=8, temperature=0.8, seed=7)
    eager = dflash.generate(target, draft, PROMPT, **kw)
    fast = dflash.generate(target, draft, PROMPT, compile=True, **kw)
    assert torch.equal(fast.output_ids, eager.output_ids)
    assert fast.acceptance_lengths == eager.acceptance_lengths
    torch._dynamo.reset()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_one_host_read_per_round(target, temperature):
    draft = dflash2_draft(target, block_size=4, top_k=3)
    result = {}

    def run():
        result["r"] = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=14, tree_budget=6,
                                      temperature=temperature, seed=1, stage_timing=True)

    per_round, reads, marks = reads_per_round(run, "commit")
    assert len(marks) == result["r"].num_rounds >= 3
    assert max(per_round) <= 1, f"host reads per round {per_round}; the reads of the worst round: {reads}"
    assert min(per_round) == 1
