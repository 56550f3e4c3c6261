"""Layer mapping and drafter-config validation."""

import pytest

from dflash.drafter.config import DraftConfigError, default_target_layer_ids, make_draft_config, validate_target_layer_ids


@pytest.mark.parametrize(
    "L, n, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (36, 1, [18]),
        (32, 5, [1, 8, 15, 22, 29]),
        (6, 2, [1, 3]),
        (28, 3, [1, 13, 25]),
        (4, 2, [1, 1]),
    ],
)
def test_published_layer_mapping(L, n, expected):
    assert default_target_layer_ids(L, n) == expected


def test_mapping_matches_formula_for_many_shapes():
    for L in range(4, 80):
        for n in range(2, 9):
            ids = default_target_layer_ids(L, n)
            assert ids == [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
            assert ids[0] == 1 and ids[-1] == L - 3


def _cfg(**kw):
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=50, num_target_layers=6, block_size=4, mask_token_id=49)
    base.update(kw)
    return make_draft_config(**base)


def test_explicit_target_layer_ids_override_the_formula():
    assert _cfg(target_layer_ids=[0, 5]).dflash_config["target_layer_ids"] == [0, 5]
    assert _cfg().dflash_config["target_layer_ids"] == [1, 3]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(target_layer_ids=[1, 6]), "out of range"),
        (dict(target_layer_ids=[-1, 2]), "out of range"),
        (dict(block_size=1), "block_size must be >= 2"),
        (dict(mask_token_id=50), "outside the vocabulary"),
        (dict(layer_types=["full_attention", "sliding_attention"], sliding_window=None), "sliding_window"),
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
    ],
)
def test_bad_configs_name_the_problem(kw, message):
    with pytest.raises(DraftConfigError, match=message):
        _cfg(**kw)


def test_repeated_ids_warn_for_shallow_targets():
    with pytest.warns(UserWarning, match="repeats a layer"):
        validate_target_layer_ids(default_target_layer_ids(4, 2), 4)
