"""One attention function for every target pass, whatever ``attn_implementation`` the model was loaded with.

While an adapter is open the model's config names our ``"dflash"`` function
(switched once when the adapter opens, never during a pass); layers get no
mask from us; the reference path builds only ``[T, prefix + T]`` boolean
masks of the current pass (none for the first prefill chunk, which runs SDPA
``is_causal``) and never expands K/V per query head; the model's own forward
is untouched after ``generate()`` returns. Before the round redesign every
pass handed the layers a dense ``[1, 1, T, S]`` float mask, which HF's SDPA
path answered with ``repeat_kv`` copies, and flash-attention-loaded models
read as a padding mask.
"""

from unittest import mock

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import dflash
import dflash_kernels
from dflash.target import ATTENTION_NAME, TargetAdapter
from dflash.target import attention as attention_module
from dflash_kernels import reference as kernel_reference
from prompts import SHORT_PROMPT as PROMPT, greedy
from tiny_models import RiggedDraft, tiny_draft, tiny_target


def record_masks(target):
    """Pre-hooks on every attention module recording the attention_mask each call receives."""
    seen = []
    handles = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs.get("attention_mask", args[2] if len(args) > 2 else None)),
        with_kwargs=True) for layer in target.model.layers]
    return seen, handles


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_layer_gets_a_mask_and_the_model_is_restored(method, attn):
    target = tiny_target("qwen3", layers=3, hidden=32, attn=attn)
    ref = greedy(target, 16, PROMPT, inference_mode=True)
    draft = RiggedDraft(tiny_draft(target, block_size=4, target_layer_ids=[0, 1]), target.lm_head.weight, ref,
                        p_right=0.6, second_right=method == "ddtree")
    TargetAdapter(target).close()  # the check against the model's own forward runs its attention on purpose: first
    seen, handles = record_masks(target)
    own = mock.Mock(side_effect=AssertionError("the model's own attention ran during our pass"))
    with mock.patch.dict(AttentionInterface._global_mapping, {attn: own}):
        res = dflash.generate(target, None if method == "ar" else draft, PROMPT, method=method, max_new_tokens=16,
                              **({"tree_budget": 6} if method == "ddtree" else {}))
    for h in handles:
        h.remove()
    assert torch.equal(res.output_ids, ref)
    assert seen and all(m is None for m in seen)
    assert target.config._attn_implementation == attn
    assert own.call_count == 0


def test_flash_loaded_models_work_and_keep_their_implementation():
    """A model loaded with another implementation (here a stand-in registered under its own name)."""
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("flash_stand_in", stand_in)
    target = tiny_target("llama", layers=3, hidden=32)
    ref = greedy(target, 12, PROMPT, inference_mode=True)
    # the check against the model's own forward, on its real implementation: the stand-in is SDPA without the mask
    # transformers builds for a registered flash kernel, so over cached rows it is not the model's own forward
    TargetAdapter(target).close()
    target.config._attn_implementation = "flash_stand_in"
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    for method in ("dflash", "ddtree"):
        res = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=12)
        assert torch.equal(res.output_ids, ref)
    assert calls == [] and target.config._attn_implementation == "flash_stand_in"
    with torch.inference_mode():
        target(torch.tensor([PROMPT]))
    assert calls  # the model's own forward still uses its implementation


def test_model_forward_while_adapter_is_open_is_the_models_own():
    target = tiny_target("qwen3", layers=2, hidden=32)
    x = torch.tensor([PROMPT])
    with torch.inference_mode():
        closed = target(x).logits
        with TargetAdapter(target, [0]):
            assert target.config._attn_implementation == ATTENTION_NAME
            opened = target(x).logits
            with TargetAdapter(target, [1]):  # nested adapters on one model
                pass
            assert target.config._attn_implementation == ATTENTION_NAME
    assert torch.equal(closed, opened) and target.config._attn_implementation == "sdpa"


def test_reference_masks_are_small_and_gqa_is_native():
    """Reference backend: one ``[T, L + T]`` visibility mask per eager round pass (shared by its layers, not
    one per layer), none for the first prefill chunk; SDPA with enable_gqa, no K/V copies."""
    target = tiny_target("qwen3", layers=2, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    TargetAdapter(target).close()  # the check against the model's own forward: its passes are not the generation's
    shapes, sdpa_kwargs = [], []
    real_vis, real_sdpa = dflash_kernels.tree_visibility, torch.nn.functional.scaled_dot_product_attention

    def vis(bits, prefix, n_rows, n_keys=None, **kw):
        mask = real_vis(bits, prefix, n_rows, n_keys=n_keys, **kw)
        shapes.append((n_rows, n_keys, tuple(mask.shape)))
        return mask

    def sdpa(*args, **kwargs):
        sdpa_kwargs.append(kwargs)
        return real_sdpa(*args, **kwargs)

    with dflash_kernels.force_backend("reference"), mock.patch.object(dflash_kernels, "tree_visibility", vis), \
            mock.patch.object(attention_module.F, "scaled_dot_product_attention", sdpa), \
            mock.patch.object(torch.Tensor, "repeat_interleave", side_effect=AssertionError("K/V copied per head")):
        result = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=10, tree_budget=5)
    # per round: one mask for the drafter's pass, one for the target's verify (no window here)
    assert len(shapes) == 2 * result.num_rounds
    # an eager round's keys stop at the host-known length + T, not the 256-row cache bucket
    # [T, S] or [b, T, S] with b = 1; the drafter's whole-block visibility is one row's, expanded over the block
    assert all(shape[-2:] == (n, S) and len(shape) - 2 <= 1 and S < 256 for n, S, shape in shapes)
    assert [n for n, _, _ in shapes[::2]] == [1] * result.num_rounds
    assert all(kw.get("enable_gqa") for kw in sdpa_kwargs)
    assert any(kw.get("is_causal") for kw in sdpa_kwargs)  # the prefill: no mask at all


def test_long_prompt_prefills_in_chunks_and_stays_lossless():
    target = tiny_target("llama", layers=2, hidden=32)
    prompt = [(7 * i + 3) % 90 for i in range(45)]
    ref = greedy(target, 10, prompt, inference_mode=True)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    with mock.patch("dflash.target.adapter.PREFILL_CHUNK", 16):
        for method in ("ar", "dflash"):
            res = dflash.generate(target, None if method == "ar" else draft, prompt, method=method, max_new_tokens=10)
            assert torch.equal(res.output_ids, ref)
    ids = torch.tensor(prompt)
    with torch.inference_mode(), TargetAdapter(target, [0, 1]) as adapter:
        chunked, whole = adapter.new_cache(64), adapter.new_cache(64)
        last_c, feat_c = adapter.prefill(ids, chunked, chunk_size=16)
        last_w, feat_w = adapter.prefill(ids, whole, chunk_size=64)
    assert chunked.length == whole.length == 45
    torch.testing.assert_close(feat_c, feat_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last_c, last_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.kv[:, :, :, :45], whole.kv[:, :, :, :45], atol=1e-5, rtol=1e-5)
