"""Target adapter: capture offset (layer k == hidden_states[k+1]), rows, structure errors."""

import pytest
import torch

from dflash.target import TargetAdapter, TargetStructureError
from tiny_models import tiny_target


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_capture_equals_output_hidden_states_entry_k_plus_1(family):
    model = tiny_target(family, layers=6)
    ids = torch.randint(0, 90, (9,))
    layer_ids = [1, 3, 4]
    with TargetAdapter(model, layer_ids) as adapter:
        cache = adapter.new_cache(32)
        hidden = adapter.forward(ids, torch.arange(9), cache)
        feats = adapter.context_features()
        logits = adapter.logits(hidden)
    with torch.no_grad():
        ref = model(ids[None], output_hidden_states=True)
    H = model.config.hidden_size
    assert feats.shape == (9, 3 * H)
    for slot, k in enumerate(layer_ids):
        torch.testing.assert_close(feats[:, slot * H : (slot + 1) * H], ref.hidden_states[k + 1][0], rtol=1e-5, atol=1e-5)
        # the off-by-one entry is a different tensor: the offset matters
        assert not torch.allclose(feats[:, slot * H : (slot + 1) * H], ref.hidden_states[k][0], atol=1e-3)
    torch.testing.assert_close(logits, ref.logits[0].float(), rtol=1e-4, atol=1e-4)


def test_context_features_select_rows_and_fill_a_preallocated_buffer():
    model = tiny_target("qwen3", layers=4)
    with TargetAdapter(model, [0, 2]) as adapter:
        cache = adapter.new_cache(16)
        adapter.forward(torch.randint(0, 90, (7,)), torch.arange(7), cache)
        full = adapter.context_features()
        rows = torch.tensor([0, 3, 4])
        buf = torch.empty(5, full.shape[1])
        out = adapter.context_features(rows=rows, out=buf[1:4])
        torch.testing.assert_close(out, full[rows])
        torch.testing.assert_close(buf[1:4], full[rows])


def test_incremental_forward_matches_full_forward():
    model = tiny_target("llama", layers=3)
    ids = torch.randint(0, 90, (10,))
    with TargetAdapter(model, [1]) as adapter:
        cache = adapter.new_cache(16)
        adapter.forward(ids[:6], torch.arange(6), cache)
        cache.commit(6)
        h2 = adapter.forward(ids[6:], torch.arange(6, 10), cache)
        cache2 = adapter.new_cache(16)
        h_full = adapter.forward(ids, torch.arange(10), cache2)
    torch.testing.assert_close(h2, h_full[6:], rtol=1e-5, atol=1e-5)


def test_capture_adds_no_hooks_and_returns_the_mapped_layers():
    """The pass returns the captured layers' outputs itself: the model never gets a hook from us."""
    model = tiny_target("qwen3", layers=4)
    ids = torch.randint(0, 90, (5,))
    with TargetAdapter(model, [2, 1]) as adapter:
        assert not any(layer._forward_hooks for layer in model.model.layers)
        cache = adapter.new_cache(8)
        hidden, captured = adapter.run_pass(ids, torch.arange(5), cache)
    own = model(ids[None], output_hidden_states=True).hidden_states  # [embeddings, layer 0, layer 1, ...]
    torch.testing.assert_close(captured[0], own[3][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(captured[1], own[2][0], rtol=1e-5, atol=1e-5)


def test_a_model_without_decoder_parts_is_a_clear_error():
    with pytest.raises(TargetStructureError, match="model.embed_tokens"):
        TargetAdapter(torch.nn.Linear(3, 3))


def test_layer_id_out_of_range_is_a_clear_error():
    from dflash.drafter.config import DraftConfigError

    with pytest.raises(DraftConfigError, match="out of range"):
        TargetAdapter(tiny_target("qwen3", layers=4), [1, 4])
