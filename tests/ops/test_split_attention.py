"""Long prefixes on the reference path: the committed keys are attended unmasked, windows read only their keys.

:func:`dflash_kernels.reference.split_attention` (a pass's rows over every committed key, unmasked, merged by
log-sum-exp with their own causal or tree keys) against :func:`dflash_kernels.reference.tree_attention`, the
spec; the attention function's window cut (a windowed layer reads keys ``>= prefix - window + 1`` only); and the
masks a long prefill and its rounds build: none of ``[T, prefix + T]`` for one sequence on the CPU (each was a
``T x S`` float conversion and add per layer, twice the attention's own time at 8k-token prompts).
"""

import importlib
import os
import traceback
from unittest import mock

import pytest
import torch

import dflash
import dflash_kernels
from dflash.target import TargetAdapter
from dflash.target.attention import AttentionPass, pass_attention
from dflash_kernels import reference as kernel_reference
from tiny_models import tiny_draft, tiny_family_target, tiny_target

split_module = importlib.import_module("dflash_kernels.reference.split_attention")  # the module, not its op
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}


def random_tree_bits(T: int, seed: int) -> torch.Tensor:
    """Ancestor-or-self bits of a random tree of ``T`` nodes (node 0 the root, each node's parent earlier)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
    return dflash_kernels.ancestor_bits(torch.tensor(parents))


def qkv(Hq, Hkv, T, S, D, dtype, seed, pad=3):
    """Query ``[1, Hq, T, D]`` and key/value views ``[1, Hkv, S, D]`` into wider storage (the cache's strides)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, T, D, generator=g).to(dtype)
    store = torch.randn(1, 2, Hkv, S + pad, D + pad, generator=g).to(dtype)
    return q, store[:, 0, :, pad:, :D], store[:, 1, :, pad:, :D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (3, 1), (2, 2)])
@pytest.mark.parametrize("prefix,T", [(1, 2), (5, 7), (100, 1), (100, 33), (257, 16)])
@pytest.mark.parametrize("tree", [False, True])
def test_split_attention_is_the_spec(dtype, Hq, Hkv, prefix, T, tree):
    q, k, v = qkv(Hq, Hkv, T, prefix + T, 16, dtype, seed=prefix * 31 + T)
    bits = random_tree_bits(T, seed=T) if tree else None
    want = kernel_reference.tree_attention(q, k, v, bits, prefix, scale=0.3)
    got = split_module.split_attention(q, k, v, prefix, bits, scale=0.3)
    assert got.dtype == dtype and got.shape == want.shape
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_split_attention_without_the_cpu_kernel_is_the_masked_sdpa():
    q, k, v = qkv(4, 2, 9, 40, 16, torch.float32, seed=3)
    want = kernel_reference.tree_attention(q, k, v, None, 31)
    with mock.patch.object(split_module, "_FLASH_CPU", None):
        got = split_module.split_attention(q, k, v, 31)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_split_attention_with_values_narrower_than_keys():
    """MiMo-V2-Flash's 192-dim keys, 128-dim values (here 16 / 8): the masked SDPA, the spec's attention."""
    q, k, _ = qkv(4, 2, 6, 30, 16, torch.float32, seed=5)
    v = torch.randn(1, 2, 30, 8)
    want = kernel_reference.tree_attention(q, k, v, None, 24, scale=0.3)
    torch.testing.assert_close(split_module.split_attention(q, k, v, 24, scale=0.3), want, atol=2e-5, rtol=2e-5)


def test_split_attention_refuses_keys_that_are_not_prefix_plus_rows():
    q, k, v = qkv(4, 2, 9, 40, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match="prefix_len \\+ T = 39 rows, got 40"):
        split_module.split_attention(q, k, v, 30)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("prefix,window", [(100, 10), (100, 1), (5, 64), (40, 48)])
@pytest.mark.parametrize("features", [{}, {"softcap": 5.0}])
def test_windowed_layers_read_only_their_window(tree, prefix, window, features):
    """The cut keys are invisible to every row: the same attention as the spec over all keys; a window wider
    than every distance is no window."""
    T = 12
    q, k, v = qkv(4, 2, T, prefix + T, 16, torch.float32, seed=prefix + window)
    bits = random_tree_bits(T, seed=7) if tree else None
    positions = None
    if tree:  # start + depth: the tree of random_tree_bits, depths from its bits
        depth = torch.tensor([int(bin(int(row[0]) & 0xFFFFFFFF).count("1")) - 1 for row in bits])
        positions = prefix + depth
    want = kernel_reference.tree_attention(q, k, v, bits, prefix, scale=0.25, positions=positions, window=window,
                                           **features)
    attention_pass = AttentionPass(prefix_len=prefix, bits=bits, positions=positions, windows=[window],
                                   backend="reference")
    seen = []
    real = kernel_reference.tree_visibility

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.append(out.shape[-1])
        return out

    with mock.patch.object(kernel_reference, "tree_visibility", spy):
        got = pass_attention(q, k, v, attention_pass, window, 0.25, softcap=features.get("softcap"), backend="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert all(n <= window - 1 + T for n in seen)  # keys older than prefix - window + 1 never reach a mask


def _masks_built(target, draft, prompt, method, chunk):
    """``(shapes, result)``: ``(who, T, S)`` of every visibility mask a generation builds (the target's path and
    the drafter's both call :func:`dflash_kernels.reference.tree_visibility`); ``who`` is ``"drafter"`` when
    the drafter's module is on the call stack."""
    shapes = []
    real = kernel_reference.tree_visibility
    drafter_file = os.path.join("dflash", "drafter", "")

    def build(*args, **kw):
        out = real(*args, **kw)
        who = "drafter" if any(drafter_file in f.filename for f in traceback.extract_stack()) else "target"
        shapes.append((who,) + tuple(out.shape[-2:]))
        return out

    with dflash_kernels.force_backend("reference"), mock.patch("dflash.target.adapter.PREFILL_CHUNK", chunk), \
            mock.patch.object(kernel_reference, "tree_visibility", build):
        result = dflash.generate(target, draft, prompt, method=method, max_new_tokens=12)
    return shapes, result


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_rounds_at_a_long_prefix_build_no_prefix_mask_and_stay_lossless(method):
    """A 200-token prompt (the split threshold lowered to 64 committed tokens): a round's target pass builds no
    mask over its committed keys (before: one ``[T, S]`` per round, converted to floats by every layer); the
    prompt's prefill, one pass, builds none either; the drafter keeps its one ``[B, S]`` mask per round.
    Tokens equal transformers'."""
    target = tiny_target("qwen3", layers=2, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    prompt = [1 + (7 * i + 3) % 89 for i in range(200)]  # no pad id (0): transformers would mask it
    TargetAdapter(target).close()  # the forward check (its passes are not the generation's)
    with mock.patch("dflash.target.adapter.SPLIT_MIN_PREFIX", 64):
        shapes, result = _masks_built(target, None if method == "ar" else draft, prompt, method, None)
    with torch.inference_mode():
        want = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert torch.equal(result.output_ids, want)
    assert [s for s in shapes if s[0] == "target"] == []
    assert len(shapes) == (0 if method == "ar" else result.num_rounds)


def test_below_the_threshold_rounds_keep_the_masked_attention():
    """At a short prefix (and for targets that quantize their activations) a round attends as before: one mask
    per pass, the model's own numbers bit for bit."""
    target = tiny_target("qwen3", layers=2, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    TargetAdapter(target).close()
    shapes, result = _masks_built(target, draft, list(range(1, 40)), "dflash", None)
    assert len([s for s in shapes if s[0] == "target"]) == result.num_rounds


def test_a_windowed_target_masks_only_its_window():
    """Mistral (every layer windowed) at a 200-token prompt prefilled in 32-row chunks (window 24): every
    target mask covers at most window - 1 + T keys, whatever the prefix."""
    target = tiny_family_target("mistral", window=24)
    target.generation_config.pad_token_id = None
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    prompt = [1 + (5 * i + 1) % 60 for i in range(200)]
    TargetAdapter(target).close()
    with mock.patch("dflash.target.adapter.SPLIT_MIN_PREFIX", 64):
        shapes, result = _masks_built(target, draft, prompt, "ddtree", 32)
    with torch.inference_mode():
        want = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert torch.equal(result.output_ids, want)
    target_masks = [(T, S) for who, T, S in shapes if who == "target"]
    assert target_masks and all(S <= 24 - 1 + T for T, S in target_masks), [m for m in target_masks if m[1] > 23 + m[0]]


def _layer_calls(target):
    calls = []
    handle = target.model.layers[0].register_forward_pre_hook(lambda mod, args: calls.append(1))
    return calls, handle


def test_the_prompt_is_prefilled_in_one_pass_with_the_models_own_numbers():
    """The default prefill: the whole prompt in one pass (transformers' generate() does the same: its time to
    first token, and its hidden states bit for bit at a 3000-token prompt; 2048-row chunks each built a mask over
    their prefix and took twice its time). ``prefill_chunk_size`` in the generation config chunks it, as
    transformers then does, and stays lossless."""
    target = tiny_target("qwen3", layers=2, hidden=32)
    target.config.max_position_embeddings = 4096
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 90, (3000,), generator=g)
    with torch.inference_mode():
        own = target(ids[None], output_hidden_states=True).hidden_states[-1][0, -1]
        with TargetAdapter(target) as adapter:
            calls, handle = _layer_calls(target)
            last, _ = adapter.prefill(ids, adapter.new_cache(3016))
            handle.remove()
            ours = adapter.norm(last)[0]
    assert len(calls) == 1 and torch.equal(ours, own)
    prompt = ids[:300].tolist()
    with torch.inference_mode():
        want = target.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, prefill_chunk_size=128)
    calls, handle = _layer_calls(target)
    res = dflash.generate(target, None, prompt, method="ar", max_new_tokens=6, prefill_chunk_size=128)
    handle.remove()
    assert torch.equal(res.output_ids, want) and len(calls) == 3 + 5  # 128 + 128 + 44 rows, then 5 steps
    with pytest.raises(ValueError, match="prefill_chunk_size must be None .* or an int >= 1, got 0"):
        dflash.generate(target, None, prompt, method="ar", max_new_tokens=6, prefill_chunk_size=0)


def test_targets_that_quantize_activations_never_split():
    """A module whose weight quantizes its input activations dynamically (torchao's ``act_quant_kwargs``): the
    adapter keeps the bit-exact masked attention at every prefix."""
    from dflash.target.quantized import quantizes_activations

    target = tiny_target("qwen3", layers=2, hidden=32)
    assert not quantizes_activations(target)
    PerRow = type("PerRow", (), {})  # torchao's one-scale-per-token granularity, by its class name
    target.model.layers[0].mlp.up_proj.weight.act_quant_kwargs = type("Kwargs", (), {"granularity": PerRow()})()
    try:
        assert quantizes_activations(target)
        with TargetAdapter(target) as adapter, mock.patch("dflash.target.adapter.SPLIT_MIN_PREFIX", 1):
            cache = adapter.new_cache(64)
            cache.commit(10)
            cache.freeze()
            assert not adapter._split_pass(cache, 1, 4, "reference")
    finally:
        del target.model.layers[0].mlp.up_proj.weight.act_quant_kwargs
    with TargetAdapter(target) as adapter, mock.patch("dflash.target.adapter.SPLIT_MIN_PREFIX", 1):
        cache = adapter.new_cache(64)
        cache.commit(10)
        cache.freeze()
        assert adapter._split_pass(cache, 1, 4, "reference")

