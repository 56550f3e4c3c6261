"""No Triton compile inside a generation once :func:`dflash.warmup` has run.

Under the interpreter nothing compiles, so the test records the compile key
of every launch (tests/triton_launches.py: constexprs, launch options, and
for each int argument outside ``do_not_specialize`` whether it is 1 or
divisible by 16): a 256-token generation with varying acceptance, after the
warm-up, must launch no key the warm-up did not. Before the round redesign
the prefix length, tree-attention split sizes, gather row counts and the
compaction tile were all part of the key.
"""

import pytest
import torch

import dflash
import dflash_kernels
from tiny_models import RiggedDraft, tiny_draft, tiny_target
from triton_launches import LaunchKeys

PROMPT = [5, 17, 33, 2, 9, 41, 60, 7, 3, 11, 13]


@pytest.fixture(autouse=True)
def triton_ops():
    if "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    with dflash_kernels.force_backend("triton"):
        yield


def new_keys_after_warmup(target, draft, gen_kwargs, warm_kwargs):
    with LaunchKeys() as warm:
        dflash.warmup(target, draft, **warm_kwargs)
    with LaunchKeys() as run:
        result = dflash.generate(target, draft, PROMPT, **gen_kwargs)
    return run.keys - warm.keys, result


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_rigged_256_tokens_no_new_variant(method):
    target = tiny_target("qwen3", layers=2, hidden=32)
    with torch.inference_mode():
        ref = target.generate(torch.tensor([PROMPT]), max_new_tokens=256, do_sample=False)
    base = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    rigged = RiggedDraft(base, target.lm_head.weight, ref, p_right=0.7, second_right=method == "ddtree")
    kw = dict(method=method, max_new_tokens=256, block_size=4)
    warm = dict(method=method, block_size=4)
    if method == "ddtree":
        kw["tree_budget"] = warm["tree_budget"] = 6
    new, result = new_keys_after_warmup(target, rigged, kw, warm)
    assert torch.equal(result.output_ids, ref)
    assert len(set(result.acceptance_lengths)) >= 3  # acceptance really varied
    assert not new, f"launches the warm-up did not compile: {sorted(new)}"


@pytest.mark.parametrize("method,temperature", [("dflash", 0.0), ("ddtree", 0.7), ("ar", 0.0)])
def test_real_drafter_no_new_variant(method, temperature):
    target = tiny_target("llama", layers=2, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1]) if method != "ar" else None
    kw = dict(method=method, max_new_tokens=40, temperature=temperature, seed=3)
    warm = dict(method=method, temperature=temperature, block_size=4)
    if method != "ar":
        kw["block_size"] = 4
    if method == "ddtree":
        kw["tree_budget"] = warm["tree_budget"] = 5
    new, _ = new_keys_after_warmup(target, draft, kw, warm)
    assert not new, f"launches the warm-up did not compile: {sorted(new)}"


def test_recorder_sees_a_specialized_int():
    """The recorder is not blind: the pre-redesign compaction tile (next_pow2 of the row count) is a new key."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows(x_ptr, n_rows, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n_rows), mask=offs < n_rows)

    x = torch.zeros(32)
    with LaunchKeys() as first:
        copy_rows[(1,)](x, 3, BLOCK=triton.next_power_of_2(3))
    with LaunchKeys() as second:
        copy_rows[(1,)](x, 16, BLOCK=triton.next_power_of_2(16))
    assert second.keys - first.keys


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sink_variants_are_warmed(family):
    """Gemma 2 (attention softcap, windows on every other layer) and gpt-oss (sinks, windows): the warm-up
    launches their attention variants too."""
    from tiny_models import tiny_family_target

    target = tiny_family_target(family, layers=2, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    kw = dict(method="ddtree", max_new_tokens=24, block_size=4, tree_budget=5)
    new, _ = new_keys_after_warmup(target, draft, kw, dict(method="ddtree", block_size=4, tree_budget=5))
    assert not new, f"launches the warm-up did not compile: {sorted(new)}"
