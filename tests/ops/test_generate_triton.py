"""The decoding loops on the Triton kernels (interpreter on CPU, compiled on a GPU): still lossless.

The other generation tests run the loops on the reference ops for speed; this
file proves the wiring: capture through gather_concat, choices through the
fused lm_head argmax / top-K, DDTree verification through the tree-attention
kernel behind our attention function (every verify pass, chain or tree), and KV compaction.
"""

from unittest import mock

import pytest
import torch

import dflash
from dflash.target import TargetAdapter
import dflash_kernels
from dflash.target import ATTENTION_NAME
from prompts import greedy
from tiny_models import RiggedDraft, tiny_draft, tiny_target

PROMPT = [5, 17, 33, 2, 9, 41, 60, 7]  # this file's own, not prompts.PROMPT


@pytest.fixture(autouse=True)
def triton_ops():
    if "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is off)")
    with dflash_kernels.force_backend("triton"):
        yield


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_dflash_on_the_kernels_is_lossless(family):
    target = tiny_target(family, layers=4, hidden=32)
    ref = greedy(target, 12, PROMPT)
    rigged = RiggedDraft(tiny_draft(target, block_size=4, target_layer_ids=[1, 2]), target.lm_head.weight, ref, p_right=0.8)
    with mock.patch.object(dflash_kernels, "gather_concat", wraps=dflash_kernels.gather_concat) as gather:
        res = dflash.generate(target, rigged, PROMPT, max_new_tokens=12)
    assert torch.equal(res.output_ids, ref)
    # the prefill's features in one gather launch; a round copies its captured rows inside its traceable step
    assert gather.call_count == 1


def test_ddtree_on_the_kernels_is_lossless_and_uses_tree_attention():
    target = tiny_target("qwen3", layers=4, hidden=32)
    ref = greedy(target, 10, PROMPT)
    rigged = RiggedDraft(tiny_draft(target, block_size=4, target_layer_ids=[1, 2]), target.lm_head.weight, ref, p_right=0.5,
                         second_right=True)
    calls = []
    real = dflash_kernels.tree_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    TargetAdapter(target).close()  # the check against the model's own forward (its passes are not counted)
    with mock.patch.object(dflash_kernels, "tree_attention", spy):
        res = dflash.generate(target, rigged, PROMPT, method="ddtree", max_new_tokens=10, tree_budget=6)
    assert torch.equal(res.output_ids, ref)
    assert len(calls) == res.num_rounds * target.config.num_hidden_layers
    # the adapter pointed the model at our attention function and gave it back its own
    assert target.config._attn_implementation == "sdpa"
    assert ATTENTION_NAME in __import__("transformers").AttentionInterface._global_mapping
