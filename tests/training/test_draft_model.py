"""The drafter: cache-incremental passes, sliding windows, checkpoint format and its errors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash_kernels
from dflash import DFlashDraftModel, DraftConfigError
from dflash.drafter.cache import DraftKVCache
from tiny_models import tiny_draft, tiny_target

CHECKPOINT_NAMES = [
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight", "norm.weight", "fc.weight",
    "hidden_norm.weight",
]


def _run_rounds(draft, feats, splits, B, cache):
    """Feed context in chunks as a generation does (the first chunk ingested as the prompt's, each later one
    as a round's waiting context, padded to 8 rows of which ``count`` are real) and return each round's block
    output."""
    outs, done = [], splits[0]
    draft.ingest_context(feats[:done], cache)
    cache.freeze()
    for i, end in enumerate(splits):
        count = end - done if i else 0
        waiting = torch.zeros(8, feats.shape[1])
        waiting[:count] = feats[done:end] if i else feats[:0]
        block = torch.randn(B, draft.config.hidden_size, generator=torch.Generator().manual_seed(end))
        outs.append((block, end, draft.draft_block(block, waiting, torch.tensor([count]), cache)))
        cache.mirror(end)  # the host mirror a generation refreshes from its payload
        done = end
    return outs


@pytest.mark.parametrize("sliding", [False, True])
def test_cached_passes_equal_full_context_passes(sliding):
    target = tiny_target("qwen3", layers=6)
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5) if sliding else {}
    draft = tiny_draft(target, block_size=4, **kw)
    n, H = len(draft.target_layer_ids), target.config.hidden_size
    feats = torch.randn(20, n * H)
    cache = DraftKVCache(draft.config, 64, torch.float32, "cpu")
    with torch.no_grad():
        for block, end, out in _run_rounds(draft, feats, [7, 9, 14, 20], 4, cache):
            full = draft(block, feats[:end], torch.arange(end + 4))
            torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


def test_sliding_window_changes_the_result():
    target = tiny_target("qwen3", layers=6)
    full = tiny_draft(target, block_size=4, layer_types=["full_attention"] * 2)
    sliding = tiny_draft(target, block_size=4, layer_types=["sliding_attention"] * 2, sliding_window=3)
    sliding.load_state_dict(full.state_dict())
    feats = torch.randn(12, 2 * target.config.hidden_size)
    block = torch.randn(4, target.config.hidden_size)
    with torch.no_grad():
        a = full(block, feats, torch.arange(16))
        b = sliding(block, feats, torch.arange(16))
        # a window wider than the sequence sees everything: equal to full attention
        wide = tiny_draft(target, block_size=4, layer_types=["sliding_attention"] * 2, sliding_window=64)
        wide.load_state_dict(full.state_dict())
        c = wide(block, feats, torch.arange(16))
    assert not torch.allclose(a, b, atol=1e-4)
    torch.testing.assert_close(a, c)


def test_checkpoint_round_trip_in_published_format(tmp_path):
    target = tiny_target("qwen3", layers=6)
    draft = tiny_draft(target, block_size=8, layer_types=["full_attention", "sliding_attention"], sliding_window=16)
    draft.save_pretrained(tmp_path)
    config = json.load(open(tmp_path / "config.json"))
    assert config["block_size"] == 8 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 3]}
    names = set(load_file(tmp_path / "model.safetensors"))
    assert set(CHECKPOINT_NAMES) <= names
    loaded = DFlashDraftModel.from_pretrained(str(tmp_path))
    assert loaded.target_layer_ids == draft.target_layer_ids and loaded.block_size == 8
    assert loaded.layers[1].sliding_window == 16 and loaded.layers[0].sliding_window is None
    feats = torch.randn(5, 2 * 64)
    block = torch.randn(8, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(block, feats, torch.arange(13)), draft(block, feats, torch.arange(13)))


def test_checkpoint_in_half_precision(tmp_path):
    target = tiny_target("qwen3", layers=6)
    tiny_draft(target).save_pretrained(tmp_path, dtype=torch.bfloat16)
    assert DFlashDraftModel.from_pretrained(str(tmp_path)).fc.weight.dtype == torch.bfloat16
    assert DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).fc.weight.dtype == torch.float32


def test_checkpoint_errors_name_the_problem(tmp_path):
    target = tiny_target("qwen3", layers=6)
    draft = tiny_draft(target)
    with pytest.raises(DraftConfigError, match="does not exist"):
        DFlashDraftModel.from_pretrained(str(tmp_path / "nope"))
    draft.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)

    os.remove(weights)
    with pytest.raises(DraftConfigError, match="no .safetensors weight file"):
        DFlashDraftModel.from_pretrained(str(tmp_path))

    save_file({k: v for k, v in state.items() if k != "fc.weight"}, weights)
    with pytest.raises(DraftConfigError, match="missing weights: fc.weight"):
        DFlashDraftModel.from_pretrained(str(tmp_path))

    bad = dict(state)
    bad["fc.weight"] = torch.zeros(64, 3 * 64)
    save_file(bad, weights)
    with pytest.raises(DraftConfigError, match=r"fc.weight has shape \(64, 192\)"):
        DFlashDraftModel.from_pretrained(str(tmp_path))

    save_file({**state, "lm_head.weight": torch.zeros(2, 2)}, weights)
    with pytest.raises(DraftConfigError, match="unexpected weights: lm_head.weight"):
        DFlashDraftModel.from_pretrained(str(tmp_path))

    os.remove(tmp_path / "config.json")
    with pytest.raises(DraftConfigError, match="no config.json"):
        DFlashDraftModel.from_pretrained(str(tmp_path))


def test_round_masks_are_the_pass_own_one_per_layer_kind():
    """On the reference backend a round pass makes one ``[b, B, S]`` mask per layer kind, hands each layer the
    one of its kind (layers of one kind share the tensor) and leaves none on the cache."""
    target = tiny_target("qwen3", layers=6)
    draft = tiny_draft(target, block_size=4, layers=3, sliding_window=3,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    n, H = len(draft.target_layer_ids), target.config.hidden_size
    feats = torch.randn(10, n * H)
    cache = DraftKVCache(draft.config, 64, torch.float32, "cpu")
    seen = {}

    def keep(layer):
        return lambda module, args, kwargs: seen.__setitem__(layer, kwargs["visible"])

    hooks = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(draft.layers)]
    with torch.no_grad(), dflash_kernels.force_backend("reference"):
        _run_rounds(draft, feats, [6, 9], 4, cache)
    for hook in hooks:
        hook.remove()
    assert seen[0] is seen[2] and seen[0] is not seen[1]
    assert seen[1].shape == seen[0].shape and seen[1].shape[:2] == (1, 4)  # [b, B, the pass's key rows]
    # the full-attention layer's block rows see every committed context row (9) and the whole block
    want = torch.zeros_like(seen[1])
    want[..., :9 + 4] = True
    assert torch.equal(seen[1], want)
    assert not seen[0].equal(seen[1])  # the sliding layers' window hides context rows
    assert not hasattr(cache, "visible")
