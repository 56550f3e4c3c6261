"""The target's RMSNorms as one op inside our passes (:mod:`dflash.target.norms`).

* inside a pass each fusable norm is one ``rms_norm`` op, and a Qwen3 layer's four norms are all taken;
* the user's own forward while an adapter is open runs the modules' own forward (the one op never leaks out);
* a norm whose output is not the formula (Gemma's ``1 + w``) keeps its module forward;
* closing the adapter gives every module its forward back; the generation stays the model's own greedy text.
"""

import pytest
import torch

import dflash
from dflash.benchmark.launches import LaunchCounter
from dflash.target import TargetAdapter
from dflash.target.norms import norm_patches
from prompts import SHORT_PROMPT as PROMPT, greedy
from tiny_models import tiny_draft, tiny_family_target, tiny_target


def _norm_modules(target):
    return [m for m in target.model.layers.modules() if "Norm" in type(m).__name__]


def test_qwen3_norms_are_one_op_inside_a_pass_and_their_own_outside():
    target = tiny_target("qwen3", layers=2, hidden=32)
    norms = _norm_modules(target)
    assert len(norms) == 8  # input, post-attention, q and k norm per layer
    x = torch.randn(3, 32)
    with torch.inference_mode():
        own = target(torch.tensor([PROMPT])).logits
    with TargetAdapter(target) as adapter, torch.inference_mode():
        assert len(norm_patches(list(adapter.layers.modules()))) == 8
        assert all("forward" in vars(m) for m in norms)
        with LaunchCounter() as outside:  # the user's own forward: the module's own six ops
            target.model.layers[0].input_layernorm(x)
        assert outside.by_op.get("rms_norm", 0) == 0 and outside.by_op["rsqrt"] == 1
        assert torch.equal(target(torch.tensor([PROMPT])).logits, own)
        cache = adapter.new_cache(32)
        with LaunchCounter() as inside:
            adapter.prefill(torch.tensor(PROMPT), cache)
        assert inside.by_op["rms_norm"] >= 8 and inside.by_op.get("rsqrt", 0) == 0
    assert not any("forward" in vars(m) for m in norms)


def test_a_norm_that_is_not_the_formula_keeps_its_forward():
    target = tiny_family_target("gemma2")
    with TargetAdapter(target) as adapter:
        assert norm_patches(list(adapter.layers.modules())) == []
        assert not any("forward" in vars(m) for m in _norm_modules(target))


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_generation_with_one_op_norms_is_the_models_own(method):
    target = tiny_target("qwen3", layers=3, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 2])
    want = greedy(target, 24, PROMPT)
    got = dflash.generate(target, None if method == "ar" else draft, PROMPT, method=method, max_new_tokens=24)
    assert torch.equal(got.output_ids, want)
