"""The payload's layout: a batch packed on the device decodes, row by row, into the fields it was made of."""

import pytest
import torch

from dflash.decoding.payload import MASS_SCALE, Payload


def _rows(payload, flat):
    return payload.rows(flat.tolist())


@pytest.mark.parametrize("B,b", [(1, 1), (2, 3), (5, 2), (7, 1)])
def test_chain_round_trip(B, b):
    payload = Payload("dflash", B)
    gen = torch.Generator().manual_seed(B * 10 + b)
    choices = torch.randint(0, 1000, (b, B), generator=gen)
    accepted = torch.randint(0, B, (b,), generator=gen)
    rows = _rows(payload, payload.pack(choices, accepted))
    assert len(rows) == b and all(len(row) == payload.size == B + 1 for row in rows)
    for r, row in enumerate(rows):
        assert payload.committed(row) == choices[r, : int(accepted[r]) + 1].tolist()


@pytest.mark.parametrize("b", [1, 3])
def test_ar_round_trip(b):
    payload = Payload("ar", 4)
    choice = torch.arange(b) * 7 + 3
    rows = _rows(payload, payload.pack(choice))
    assert payload.size == 1 and [payload.committed(row) for row in rows] == [[7 * r + 3] for r in range(b)]


@pytest.mark.parametrize("B,b", [(2, 1), (5, 3), (9, 2)])
def test_fixed_budget_tree_round_trip(B, b):
    payload = Payload("ddtree", B)
    committed = torch.arange(b * B).view(b, B) + 11
    path_len = torch.tensor([1 + r % B for r in range(b)])
    rows = _rows(payload, payload.pack(committed, path_len))
    assert payload.size == B + 1
    for r, row in enumerate(rows):
        assert payload.committed(row) == committed[r, : int(path_len[r])].tolist()


@pytest.mark.parametrize("B,buckets,b", [(3, [2, 5], 1), (6, [1, 4, 9, 13], 3), (8, [7], 2)])
def test_budget_per_round_tree_round_trip(B, buckets, b):
    payload = Payload("ddtree", B, buckets)
    V = len(buckets)
    gen = torch.Generator().manual_seed(B + V + b)
    committed = torch.randint(0, 500, (b, B), generator=gen)
    path_len = torch.tensor([1 + (r * 5) % B for r in range(b)])
    path = torch.zeros(b, B, dtype=torch.long)
    for r in range(b):  # increasing node ids from the root, zero padded
        n = int(path_len[r])
        path[r, :n] = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(1, n) * 2 - (r % 2)])
    masses = torch.rand(b, V, generator=gen) * (B - 1)
    fixed = (masses * MASS_SCALE).long()
    rows = _rows(payload, payload.pack(committed, path_len, path, fixed))
    assert payload.size == 2 * B + 1 + V and all(len(row) == payload.size for row in rows)
    for r, row in enumerate(rows):
        n = int(path_len[r])
        assert payload.committed(row) == committed[r, :n].tolist()
        assert payload.path(row) == path[r, :n].tolist()
        assert payload.path_masses(row) == pytest.approx(masses[r].tolist(), abs=2 / MASS_SCALE)
        ids = path[r, 1:n].tolist()
        assert payload.bucket_acceptance(row) == [sum(1 for i in ids if i <= nodes) for nodes in buckets]


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="no payload layout"):
        Payload("beam", 4)
