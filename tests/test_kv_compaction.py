"""KV compaction kernel against the index_select reference, overlaps included."""

import random

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import reference as ref
from dflash_kernels.kv_compaction import KV_COMPACTION_CONFIGS, compact_kv_triton, kv_compaction_config


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cache(layers=3, heads=2, smax=48, head_dim=24, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, heads, smax, head_dim, generator=gen).to(DEVICE, dtype)


def expected_by_hand(kv, src, dst):
    out = kv.clone()
    for i, s in enumerate(src):
        out[:, :, :, dst + i] = kv[:, :, :, s]
    return out


def run_both(kv, src, dst):
    src_t = torch.tensor(src, dtype=torch.int64)
    want = ref.compact_kv_(kv.clone(), src_t, dst)
    got = kv.clone()
    assert compact_kv_triton(got, src_t, dst) is got
    assert torch.equal(got, want)
    assert torch.equal(want, expected_by_hand(kv, src, dst))
    return got


@pytest.mark.parametrize(
    "src,dst",
    [
        ([10, 12, 13], 10),  # dst 12 is row 1's source: overlap
        ([10, 11, 12, 13], 10),  # identity
        ([20, 30, 31, 40], 15),
        ([5], 5),
        ([47], 0),
        (list(range(8, 44, 2)), 8),  # 18 rows: more than one chunk of 16
        ([], 4),
    ],
)
def test_overlapping_and_edge_cases(src, dst):
    run_both(cache(), src, dst)


def test_random_walks_every_dtype():
    rng = random.Random(0)
    for trial in range(12):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[trial % 3]
        smax = 64
        dst = rng.randint(0, 20)
        a = rng.randint(1, 20)
        src = sorted(rng.sample(range(dst, smax), a))
        src = [max(s, dst + i) for i, s in enumerate(src)]  # keep src[i] >= dst + i
        src = sorted(set(src))
        run_both(cache(smax=smax, dtype=dtype, seed=trial, head_dim=rng.choice([16, 40, 128])), src, dst)


def test_strided_cache_view_in_place():
    # A cache that is a view (every other head of a bigger buffer): compacted in place.
    big = cache(heads=4)
    view = big[:, :, ::2]
    untouched = big[:, :, 1::2].clone()
    want = expected_by_hand(view, [9, 11, 12], 8)
    out = dk.compact_kv_(view, torch.tensor([9, 11, 12]), 8)
    assert out is view
    assert torch.equal(view, want) and torch.equal(big[:, :, 1::2], untouched)


def test_public_op_and_int32_positions():
    kv = cache(seed=4)
    want = expected_by_hand(kv, [3, 6, 7], 2)
    assert torch.equal(dk.compact_kv_(kv, torch.tensor([3, 6, 7], dtype=torch.int32), 2), want)


def test_positions_on_the_cache_device():
    kv = cache(seed=5)
    want = expected_by_hand(kv, [4, 9, 10, 30], 4)
    assert torch.equal(dk.compact_kv_(kv, torch.tensor([4, 9, 10, 30], device=DEVICE), 4), want)


def test_config_choices_are_listed():
    for a in (1, 3, 16, 40):
        for d in (16, 64, 80, 128, 256):
            assert kv_compaction_config(a, d) in KV_COMPACTION_CONFIGS


@pytest.mark.parametrize(
    "src,dst,message",
    [
        ([5, 5, 6], 5, "strictly increasing"),
        ([7, 6], 5, "strictly increasing"),
        ([5, 6], 6, r"src_positions\[0\] = 5 must be >= dst_start \+ 0"),
        ([6, 7, 7 + 1], 7, r"src_positions\[0\]"),
        ([10, 48], 10, "beyond the cache length"),
    ],
)
def test_bad_positions_are_rejected(src, dst, message):
    kv = cache()
    with pytest.raises(ValueError, match=message):
        dk.compact_kv_(kv, torch.tensor(src), dst)


def test_bad_arguments_are_rejected():
    kv = cache()
    with pytest.raises(ValueError, match=r"\[L, 2, Hkv, Smax, D\]"):
        dk.compact_kv_(kv[:, :1], torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="1-D"):
        dk.compact_kv_(kv, torch.tensor([[1]]), 0)
    with pytest.raises(ValueError, match="int64 or int32"):
        dk.compact_kv_(kv, torch.tensor([1.0]), 0)
    with pytest.raises(ValueError, match="dst_start"):
        dk.compact_kv_(kv, torch.tensor([1]), -1)
