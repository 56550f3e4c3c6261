"""Per-position acceptance of a generation: a_k = the share of rounds whose accepted drafts reached draft
position k, on hand-made results (chains, trees, rounds cut short by the stop rules, ar, no rounds)."""

import pytest
import torch

from dflash.decoding.result import GenerationResult, position_acceptance


def made(method, acceptance_lengths, accepted_depths=(), block_size=None, **kw):
    return GenerationResult(output_ids=torch.zeros(1, 3 + sum(acceptance_lengths), dtype=torch.long),
                            num_prompt_tokens=3, method=method, acceptance_lengths=list(acceptance_lengths),
                            accepted_depths=list(accepted_depths), block_size=block_size, **kw)


def test_the_function_counts_rounds_reaching_each_position():
    # accepted drafts 3, 0, 1, 2 with B = 4: positions 1, 2, 3 reached by 3, 2, 1 of 4 rounds
    assert position_acceptance([3, 0, 1, 2], 4) == [0.75, 0.5, 0.25]
    assert position_acceptance([], 4) == [0.0, 0.0, 0.0]  # no rounds: nothing reached, still B - 1 entries
    assert position_acceptance([0, 0], 1) == []  # B = 1: no draft positions
    # pooling generations of one block size = the function on their rounds concatenated
    assert position_acceptance([3, 0] + [1, 2, 2], 4) == [4 / 5, 3 / 5, 1 / 5]


@pytest.mark.parametrize("accepted,block_size,what", [
    ([4], 4, r"\[0, 3\]"), ([-1], 4, r"\[0, 3\]"), ([1.0], 4, "ints"), ([1], 0, "block_size must be"),
    ([1], None, "block_size must be"), ([], True, "block_size must be"),
])
def test_the_function_names_bad_input(accepted, block_size, what):
    with pytest.raises(ValueError, match=what):
        position_acceptance(accepted, block_size)


def test_chain_result_counts_accepted_drafts_and_is_in_the_summary():
    res = made("dflash", [4, 1, 2, 3], [3, 0, 1, 2], block_size=4)
    assert res.position_acceptance == [0.75, 0.5, 0.25]
    assert res.summary()["position_acceptance"] == [0.75, 0.5, 0.25]
    assert sum(res.position_acceptance) == pytest.approx(res.tau - 1)  # no round cut short: sum a_k = tau - 1


def test_chain_result_without_depths_uses_the_committed_lengths():
    res = made("dflash", [4, 1, 2, 3], block_size=4)
    assert res.accepted_drafts == [3, 0, 1, 2] and res.position_acceptance == [0.75, 0.5, 0.25]


def test_a_final_round_cut_short_counts_what_its_verify_accepted():
    # the verify accepted all 3 drafts of the last round, max_new_tokens let only 2 tokens commit
    res = made("dflash", [4, 2], [3, 3], block_size=4)
    assert res.position_acceptance == [1.0, 1.0, 1.0]
    assert made("dflash", [4, 2], block_size=4).position_acceptance == [1.0, 0.5, 0.5]  # without the depths


def test_tree_result_counts_the_accepted_path_depth():
    res = made("ddtree", [5, 3, 1, 2], [4, 2, 0, 3], block_size=5, tree_sizes=[8, 8, 8, 8])
    # the last round committed 2 of its 4 path tokens (a stop id); depths 4, 2, 0, 3
    assert res.position_acceptance == [0.75, 0.75, 0.5, 0.25]
    values = res.position_acceptance
    assert all(0.0 <= v <= 1.0 for v in values) and values == sorted(values, reverse=True)


def test_ar_has_no_draft_positions_and_no_rounds_give_zeros():
    assert made("ar", [1, 1, 1], block_size=1).position_acceptance == []
    assert made("ar", [1, 1]).position_acceptance == []  # no block size needed: ar never drafts
    assert made("ar", [1], block_size=1).summary()["position_acceptance"] == []
    assert made("ddtree", [], block_size=4).position_acceptance == [0.0, 0.0, 0.0]


def test_a_drafting_result_without_block_size_says_so():
    with pytest.raises(ValueError, match="block_size=None"):
        made("dflash", [2, 3]).position_acceptance
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        made("ddtree", [5], [4], block_size=4).position_acceptance
