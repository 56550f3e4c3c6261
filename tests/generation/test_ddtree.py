"""DDTree generation: lossless for every budget / block size / family, branches accepted, sampling."""

import pytest
import torch

import dflash
import dflash_kernels
from dflash.decoding.compat import ddtree_generate
from prompts import PROMPT, greedy
from tiny_models import RiggedDraft, tiny_draft, tiny_target


@pytest.fixture(autouse=True)
def reference_ops():
    """Reference ops (the interpreter is slow); test_generate_triton.py runs the loop on the kernels."""
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return tiny_target(request.param, layers=6)


def leaves_top1_chain(tree) -> bool:
    """True when an accepted node is not its parent's first (rank-0, earliest popped) child."""
    parents = tree["parents"].tolist()
    for node in tree["accepted"].tolist()[1:]:
        first_child = min(i for i in range(1, len(parents)) if parents[i] == parents[node])
        if node != first_child:
            return True
    return False


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("budget", [1, 4, 16, 64, 256])
def test_ddtree_is_lossless(target, block_size, budget):
    ref = greedy(target, 32)
    draft = tiny_draft(target, block_size=block_size)
    res = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=32, tree_budget=budget)
    assert torch.equal(res.output_ids, ref)
    rigged = RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.5, second_right=True, seed=budget)
    res = ddtree_generate(rigged, target, torch.tensor([PROMPT]), max_new_tokens=32, block_size=block_size,
                          tree_budget=budget, return_trees=True)
    assert torch.equal(res.output_ids, ref)
    assert all(size == min(budget, size) for size in res.tree_sizes)
    # every round commits its walked path plus the bonus, except that max_new_tokens may cut the last one
    assert res.accepted_depths[:-1] == [n - 1 for n in res.acceptance_lengths[:-1]]
    assert res.accepted_depths[-1] >= res.acceptance_lengths[-1] - 1
    assert sum(res.acceptance_lengths) == 32 - 1  # the prefill committed the first token
    if budget >= 16:
        assert any(leaves_top1_chain(t) for t in res.trees), "no accepted path left the top-1 chain"
        assert res.tau > 2.5


def test_ddtree_beats_the_chain_when_the_second_guess_is_right(target):
    ref = greedy(target, 40)
    draft = tiny_draft(target, block_size=8)
    rigged = RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.5, second_right=True, seed=1)
    chain = dflash.generate(target, rigged, PROMPT, method="dflash", max_new_tokens=40)
    tree = dflash.generate(target, rigged, PROMPT, method="ddtree", max_new_tokens=40, tree_budget=64)
    assert torch.equal(chain.output_ids, ref) and torch.equal(tree.output_ids, ref)
    assert tree.tau > chain.tau + 1.0


def test_tree_traces_are_consistent(target):
    ref = greedy(target, 20)
    draft = tiny_draft(target, block_size=8)
    rigged = RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.7, second_right=True)
    res = ddtree_generate(rigged, target, PROMPT, max_new_tokens=20, tree_budget=16, return_trees=True)
    new = res.generated_ids[0].tolist()
    pos = 1  # the first new token comes from the prefill
    for tree, n in zip(res.trees, res.acceptance_lengths):
        acc = tree["accepted"].tolist()
        assert acc[0] == 0 and len(acc) >= n  # == except when max_new_tokens cuts the last round
        parents = tree["parents"].tolist()
        assert all(parents[b] == a for a, b in zip(acc, acc[1:]))
        walked = [tree["tokens"][i - 1].item() for i in acc[1:]]
        committed = new[pos : pos + n]  # the walked tokens then the bonus (max_new_tokens may cut the last round)
        assert committed[: len(walked)] == walked[: len(committed)]
        pos += n


def test_ddtree_sampling_is_reproducible(target):
    draft = tiny_draft(target, block_size=4)
    kw = dict(method="ddtree", max_new_tokens=24, temperature=0.9, tree_budget=8)
    a = dflash.generate(target, draft, PROMPT, seed=5, **kw)
    b = dflash.generate(target, draft, PROMPT, seed=5, **kw)
    c = dflash.generate(target, draft, PROMPT, seed=6, **kw)
    assert torch.equal(a.output_ids, b.output_ids) and not torch.equal(a.output_ids, c.output_ids)


def test_ddtree_stop_tokens_and_exact_length(target):
    ref = greedy(target, 30)
    new = ref[0, len(PROMPT):].tolist()
    rigged = RiggedDraft(tiny_draft(target, block_size=8), target.lm_head.weight, ref, p_right=1.0)
    for n in (1, 5, 13):
        assert dflash.generate(target, rigged, PROMPT, method="ddtree", max_new_tokens=n,
                               tree_budget=16).num_new_tokens == n
    stop = new[6]
    res = dflash.generate(target, rigged, PROMPT, method="ddtree", max_new_tokens=30, tree_budget=16,
                          stop_token_ids=[stop])
    assert res.generated_ids[0].tolist() == new[: new.index(stop) + 1]


def test_sliding_window_target_is_lossless_under_ddtree():
    target = tiny_target("qwen3", layers=6, sliding_window=6)
    ref = greedy(target, 24)
    rigged = RiggedDraft(tiny_draft(target, block_size=4), target.lm_head.weight, ref, p_right=0.5,
                         second_right=True)
    assert torch.equal(dflash.generate(target, rigged, PROMPT, method="ddtree", max_new_tokens=24,
                                       tree_budget=16).output_ids, ref)


@pytest.mark.parametrize("budget, message", [(0, "tree_budget must be an int >= 1"), (2.5, "tree_budget must be")])
def test_bad_budget(budget, message):
    t = tiny_target("qwen3", layers=6)
    with pytest.raises(ValueError, match=message):
        dflash.generate(t, tiny_draft(t), PROMPT, method="ddtree", max_new_tokens=4, tree_budget=budget)


def test_bad_mask_token():
    t = tiny_target("qwen3", layers=6)
    with pytest.raises(ValueError, match="mask_token_id 500 is outside"):
        ddtree_generate(tiny_draft(t), t, PROMPT, mask_token_id=500, max_new_tokens=4)
