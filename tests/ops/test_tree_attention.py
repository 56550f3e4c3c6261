"""Tree attention kernel against the SDPA reference, and the reference against a naive loop.

The kernel runs under the Triton interpreter here (Python per program), so
shapes stay small: prefixes 0/1/37/300, T 1/2/16/17/33/65, heads (4,4) (4,2)
(8,1), head dims 64 and 96 (96 pads to a 128-wide tile). Key/value are always
strided views into a ``[L, 2, Hkv, Smax, D]`` cache and the query a
transposed view, as the model layer passes them. Visibility modes: random
DDTree-like ancestor bits, ``bits=None`` (causal chain), all-ones bits (the
drafter's block), each with and without a sliding window (positions
``prefix_len + depth``). Attention softcap (Gemma 2) and sinks (gpt-oss):
kernel vs reference over windows, modes, GQA layouts and split counts, the
reference vs a naive loop and vs transformers' own eager attention of those
families, and the float32 tanh the kernels use.
"""

import itertools
import math
import random

import pytest
import torch
import triton
import triton.language as tl

import dflash_kernels as dk
from dflash_kernels import reference as ref
from dflash_kernels.tree_attention import (
    MAX_SPLITS,
    MIN_TILES_PER_SPLIT,
    TREE_ATTENTION_DYNAMIC_INTS,
    _tree_attention_kernel,
    choose_num_splits,
    tanh_f32,
    tree_attention_config,
    tree_attention_configs,
    split_time,
    tree_attention_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# dtype -> (atol, rtol) against the float32 reference. bf16/fp16 cover the
# rounding of the output (1 ulp, the interpreter truncates) and of the
# probabilities fed to the second matmul on a GPU.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}


def random_parents(n_tree, seed):
    """Parents of a DDTree-like random tree of ``n_tree`` tokens (depth <= 15), and the depths."""
    rng = random.Random(seed)
    parents, depth = [-1], [0]
    for i in range(1, n_tree):
        p = rng.randint(max(0, i - 24), i - 1)
        while depth[p] >= 15:
            p = parents[p]
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents, depth


def random_tree_bits(n_tree, seed):
    parents, _ = random_parents(n_tree, seed)
    return dk.ancestor_bits(torch.tensor(parents, dtype=torch.int64, device=DEVICE))


def ones_bits(n_tree):
    return torch.full((n_tree, (n_tree + 31) // 32), -1, dtype=torch.int32, device=DEVICE)


def make_bits(mode, n_tree, seed):
    """(bits, positions of the tokens as prefix-relative depths or steps) for a visibility mode."""
    if mode == "tree":
        parents, depth = random_parents(n_tree, seed)
        return dk.ancestor_bits(torch.tensor(parents, dtype=torch.int64, device=DEVICE)), depth
    if mode == "chain":
        return None, list(range(n_tree))
    return ones_bits(n_tree), [0] * n_tree  # drafter: the block after the context, one position each


def make_inputs(hq, hkv, n_tree, prefix_len, head_dim, dtype, seed, smax_extra=7, layers=2):
    """Query ``[Hq, T, D]`` (a transposed view) and key/value views into a cache."""
    gen = torch.Generator().manual_seed(seed)
    s = prefix_len + n_tree
    q = torch.randn(n_tree, hq, head_dim, generator=gen).to(DEVICE, dtype).transpose(0, 1)
    cache = torch.randn(layers, 2, hkv, s + smax_extra, head_dim, generator=gen).to(DEVICE, dtype)
    layer = layers - 1
    return q, cache[layer, 0, :, :s], cache[layer, 1, :, :s]


def check(out, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------
# Kernel vs reference
# ----------------------------------------------------------------------------

HEADS = [(4, 4), (4, 2), (8, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = ["tree", "chain", "ones"]
# Every (prefix, T) pair; heads, head dim, dtype and mode rotate so that each
# value of each meets many of the others without the full product.
SWEEP = [
    (prefix_len, n_tree, HEADS[i % 3], (64, 96)[(i // 3) % 2], DTYPES[(i // 2) % 3], MODES[i % 3])
    for i, (prefix_len, n_tree) in enumerate(itertools.product((0, 1, 37, 300), (1, 2, 16, 17, 33, 65)))
]


@pytest.mark.parametrize(
    "prefix_len,n_tree,heads,head_dim,dtype,mode", SWEEP,
    ids=[f"p{p}-T{t}-{h[0]}x{h[1]}-D{d}-{str(dt)[6:]}-{m}" for p, t, h, d, dt, m in SWEEP],
)
def test_matches_reference(prefix_len, n_tree, heads, head_dim, dtype, mode):
    hq, hkv = heads
    q, k, v = make_inputs(hq, hkv, n_tree, prefix_len, head_dim, dtype, seed=prefix_len * 7 + n_tree)
    bits, _ = make_bits(mode, n_tree, seed=n_tree)
    assert k.untyped_storage().nbytes() > k.numel() * k.element_size()  # a view into a bigger cache
    assert n_tree == 1 or not q.is_contiguous()
    expected = ref.tree_attention(q, k, v, bits, prefix_len)
    check(dk.tree_attention(q, k, v, bits, prefix_len), expected, dtype)


WINDOW_CASES = [
    (window, mode, prefix_len, n_tree, HEADS[i % 3], DTYPES[i % 2])
    for i, (window, mode, (prefix_len, n_tree)) in enumerate(
        itertools.product((1, 5, 64), MODES, ((37, 17), (300, 33)))
    )
]


@pytest.mark.parametrize(
    "window,mode,prefix_len,n_tree,heads,dtype", WINDOW_CASES,
    ids=[f"w{w}-{m}-p{p}-T{t}-{h[0]}x{h[1]}-{str(dt)[6:]}" for w, m, p, t, h, dt in WINDOW_CASES],
)
def test_sliding_window_matches_reference(window, mode, prefix_len, n_tree, heads, dtype):
    hq, hkv = heads
    q, k, v = make_inputs(hq, hkv, n_tree, prefix_len, 64, dtype, seed=window + n_tree)
    bits, depth = make_bits(mode, n_tree, seed=window)
    positions = torch.tensor([prefix_len + d for d in depth], dtype=torch.int64, device=DEVICE)
    expected = ref.tree_attention(q, k, v, bits, prefix_len, positions=positions, window=window)
    check(dk.tree_attention(q, k, v, bits, prefix_len, positions=positions, window=window), expected, dtype)


def test_window_with_default_positions_and_int32_positions():
    q, k, v = make_inputs(4, 2, 16, 40, 64, torch.float32, seed=11)
    expected = ref.tree_attention(q, k, v, None, 40, window=7)
    check(dk.tree_attention(q, k, v, None, 40, window=7), expected, torch.float32)
    positions = torch.arange(40, 56, dtype=torch.int32, device=DEVICE)
    check(dk.tree_attention(q, k, v, None, 40, positions=positions, window=7), expected, torch.float32)


@pytest.mark.parametrize("mode", MODES)
def test_prefix_tiles_outside_every_window_are_not_read(mode):
    # Prefix keys older than the window of every query are NaN: a kernel
    # that loads and multiplies them (even by a zero probability) returns NaN.
    prefix_len, n_tree, window = 300, 17, 20
    q, k, v = make_inputs(4, 2, n_tree, prefix_len, 64, torch.float32, seed=5)
    bits, depth = make_bits(mode, n_tree, seed=5)
    positions = torch.tensor([prefix_len + d for d in depth], dtype=torch.int64, device=DEVICE)
    expected = ref.tree_attention(q, k, v, bits, prefix_len, positions=positions, window=window)
    block_n = tree_attention_config(64, torch.float32, n_tree * 2)["BLOCK_N"]
    dead = (prefix_len - window + 1) // block_n * block_n  # keys before the first tile any query needs
    assert dead >= 2 * block_n
    k, v = k.clone(), v.clone()
    k[:, :dead] = float("nan")
    v[:, :dead] = float("nan")
    for num_splits in (1, 3):
        out = tree_attention_triton(q, k, v, bits, prefix_len, positions=positions, window=window,
                                    num_splits=num_splits)
        check(out, expected, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("mode,window", [("tree", None), ("chain", None), ("ones", None), ("tree", 64),
                                         ("chain", 5)])
def test_forced_key_splits_merge_exactly(num_splits, mode, window):
    prefix_len, n_tree = 100, 33
    q, k, v = make_inputs(4, 2, n_tree, prefix_len, 64, torch.float32, seed=num_splits)
    bits, depth = make_bits(mode, n_tree, seed=num_splits)
    positions = torch.tensor([prefix_len + d for d in depth], device=DEVICE) if window else None
    expected = ref.tree_attention(q, k, v, bits, prefix_len, positions=positions, window=window)
    out = tree_attention_triton(q, k, v, bits, prefix_len, positions=positions, window=window,
                                num_splits=num_splits)
    check(out, expected, torch.float32)


# The prefix loop runs whole key tiles unmasked and a ragged last one masked: prefixes below, at and past a
# multiple of the tile, split so that a split's range starts or ends inside either part, a head dim narrower
# than its tile (the whole tiles keep the head-dim mask), softcap / sinks through the unmasked step.
@pytest.mark.parametrize("prefix_len", [0, 31, 32, 33, 64, 95, 96])
@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("mode,head_dim,extras", [("tree", 64, False), ("chain", 48, False), ("ones", 64, True)])
@pytest.mark.parametrize("unmasked", [True, False])
def test_whole_and_ragged_prefix_tiles(prefix_len, num_splits, mode, head_dim, extras, unmasked):
    n_tree = 9
    q, k, v = make_inputs(4, 2, n_tree, prefix_len, head_dim, torch.float32, seed=prefix_len + num_splits)
    bits, _ = make_bits(mode, n_tree, seed=prefix_len)
    kw = dict(softcap=3.0, sinks=torch.linspace(-1.0, 1.0, 4, device=DEVICE)) if extras else {}
    cfg = dict(tree_attention_configs(head_dim, torch.float32)[0], UNMASKED_PREFIX=unmasked)
    assert cfg["BLOCK_N"] == 32
    expected = ref.tree_attention(q, k, v, bits, prefix_len, **kw)
    check(tree_attention_triton(q, k, v, bits, prefix_len, num_splits=num_splits, config=cfg, **kw), expected,
          torch.float32)


@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.7])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_any_scale_through_whole_prefix_tiles(scale, softcap):
    # The whole tiles take the row max over raw q.k (a negative scale runs as -q with -scale).
    q, k, v = make_inputs(4, 2, 9, 70, 64, torch.float32, seed=7)
    bits = random_tree_bits(9, 7)
    expected = ref.tree_attention(q, k, v, bits, 70, scale, softcap=softcap)
    for num_splits in (1, 2):
        check(tree_attention_triton(q, k, v, bits, 70, scale, softcap=softcap, num_splits=num_splits), expected,
              torch.float32)


def test_whole_prefix_tiles_with_bf16_64_key_tiles():
    # The 128-row bf16 tile over 64-key tiles: two whole prefix tiles and a ragged one, split across them.
    cfg = next(c for c in tree_attention_configs(64, torch.bfloat16) if c["BLOCK_M"] == 128)
    q, k, v = make_inputs(8, 2, 37, 150, 64, torch.bfloat16, seed=150)
    bits, _ = make_bits("tree", 37, seed=150)
    expected = ref.tree_attention(q, k, v, bits, 150)
    for num_splits in (1, 2):
        check(tree_attention_triton(q, k, v, bits, 150, config=cfg, num_splits=num_splits), expected,
              torch.bfloat16)


def test_more_splits_than_key_tiles_leave_empty_splits():
    q, k, v = make_inputs(2, 1, 5, 3, 64, torch.float32, seed=2)
    bits = random_tree_bits(5, 2)
    check(tree_attention_triton(q, k, v, bits, 3, num_splits=7), ref.tree_attention(q, k, v, bits, 3),
          torch.float32)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_every_bf16_row_tile(block_m, mode):
    # Row tiles cut across tokens (G = 4): a tile's last token is partial.
    cfg = next(c for c in tree_attention_configs(64, torch.bfloat16) if c["BLOCK_M"] == block_m)
    q, k, v = make_inputs(8, 2, 37, 30, 64, torch.bfloat16, seed=block_m)
    bits, _ = make_bits(mode, 37, seed=block_m)
    expected = ref.tree_attention(q, k, v, bits, 30)
    check(tree_attention_triton(q, k, v, bits, 30, config=cfg, num_splits=2), expected, torch.bfloat16)


def test_large_tree_several_bitmask_words():
    q, k, v = make_inputs(2, 1, 200, 3, 64, torch.float32, seed=200)
    bits = random_tree_bits(200, 200)
    check(dk.tree_attention(q, k, v, bits, 3), ref.tree_attention(q, k, v, bits, 3), torch.float32)


def test_chain_equals_the_bits_of_a_chain():
    n_tree = 40
    q, k, v = make_inputs(4, 2, n_tree, 9, 64, torch.float32, seed=9)
    chain_bits = dk.ancestor_bits(torch.arange(-1, n_tree - 1, device=DEVICE))
    check(dk.tree_attention(q, k, v, None, 9), dk.tree_attention(q, k, v, chain_bits, 9), torch.float32)


def test_each_query_head_reads_its_own_kv_head():
    # Only kv head 1 has non-zero values: query heads 2, 3 (group 2) must see
    # them, query heads 0, 1 must output zeros.
    q, k, v = make_inputs(4, 2, 9, 5, 64, torch.float32, seed=1)
    v = v.clone()
    v[0].zero_()
    out = dk.tree_attention(q, k, v, random_tree_bits(9, 1), 5)
    assert out[:2].abs().max() == 0 and out[2:].abs().min() > 0


def test_fp16_and_batched_rank_and_scale():
    q, k, v = make_inputs(4, 2, 17, 20, 64, torch.float16, seed=3)
    bits = random_tree_bits(17, 3)
    out = dk.tree_attention(q[None], k[None], v[None], bits, 20, scale=0.3)
    assert out.shape == (1, 4, 17, 64)
    check(out, ref.tree_attention(q[None], k[None], v[None], bits, 20, scale=0.3), torch.float16)


def test_ancestor_only_visibility():
    # Chain 0 <- 1 and a sibling 2 of node 1. Query 2 must ignore key 1 even
    # if key 1 is hugely attractive; query 1 must attend to it.
    parents = torch.tensor([-1, 0, 0], device=DEVICE)
    bits = dk.ancestor_bits(parents)
    q = torch.ones(1, 3, 16, device=DEVICE)
    k = torch.zeros(1, 3, 16, device=DEVICE)
    k[0, 1] = 10.0
    v = torch.zeros(1, 3, 16, device=DEVICE)
    v[0, 1] = 1.0
    out = dk.tree_attention(q, k, v, bits, 0)
    assert out[0, 1].min() > 0.99
    assert out[0, 2].abs().max() == 0 and out[0, 0].abs().max() == 0


def test_warmup_runs_every_variant_and_is_a_no_op_on_the_reference_backend():
    q, k, v = make_inputs(4, 2, 17, 40, 64, torch.bfloat16, seed=4)
    bits = random_tree_bits(17, 4)
    assert dk.warmup_tree_attention(q, k, v, bits, 40) is None
    assert dk.warmup_tree_attention(q, k, v, None, 40, window=8) is None
    with dk.force_backend("reference"):
        calls = []
        real = ref.tree_attention
        try:
            ref.tree_attention = lambda *a, **kw: calls.append(1)
            dk.warmup_tree_attention(q, k, v, bits, 40)
        finally:
            ref.tree_attention = real
        assert calls == []
        check(dk.tree_attention(q, k, v, bits, 40), real(q, k, v, bits, 40), torch.bfloat16)


# ----------------------------------------------------------------------------
# Attention softcap and sinks
# ----------------------------------------------------------------------------

def make_sinks(kind, hq, n_keys, seed):
    """``[Hq]`` sink logits: random (about the log of the key count, so that they weigh about as much as
    the keys together), or a mix of a dominating one, -inf-like, -inf and ordinary ones."""
    if kind is None:
        return None
    if kind == "random":
        noise = torch.randn(hq, generator=torch.Generator().manual_seed(seed))
        return (math.log(n_keys) + noise).to(DEVICE)
    mixed = [12.0, -1e30, float("-inf"), 1.5, -0.5, 30.0, -3.0, 0.0]
    return torch.tensor([mixed[h % len(mixed)] for h in range(hq)], device=DEVICE)


# (softcap, sinks kind, mode, window, prefix_len, T, heads, head_dim, dtype, splits): every softcap x
# sinks pair meets every mode, with and without a window; the rest rotates.
SOFTCAP_SINK_CASES = [
    (softcap, sinks, MODES[i % 3], (None, 5)[(i // 3) % 2], (0, 37, 100)[i % 3], (1, 17, 33, 65)[i % 4],
     HEADS[i % 3], (64, 96)[(i // 2) % 2], DTYPES[i % 3], (1, 2, 3)[(i // 4) % 3])
    for i, (softcap, sinks, _repeat) in enumerate(
        itertools.product((None, 0.5, 5.0), (None, "random", "mixed"), (0, 1))
    ) if (softcap, sinks) != (None, None)
]


@pytest.mark.parametrize(
    "softcap,sinks,mode,window,prefix_len,n_tree,heads,head_dim,dtype,num_splits", SOFTCAP_SINK_CASES,
    ids=[f"c{c}-s{s}-{m}-w{w}-p{p}-T{t}-{h[0]}x{h[1]}-D{d}-{str(dt)[6:]}-split{n}"
         for c, s, m, w, p, t, h, d, dt, n in SOFTCAP_SINK_CASES],
)
def test_softcap_and_sinks_match_reference(softcap, sinks, mode, window, prefix_len, n_tree, heads, head_dim,
                                           dtype, num_splits):
    hq, hkv = heads
    q, k, v = make_inputs(hq, hkv, n_tree, prefix_len, head_dim, dtype, seed=prefix_len + 3 * n_tree)
    q = q * 2  # scores of a few units: a softcap of 0.5 or 5 changes them
    bits, depth = make_bits(mode, n_tree, seed=n_tree)
    positions = torch.tensor([prefix_len + d for d in depth], dtype=torch.int64, device=DEVICE) if window else None
    sink_logits = make_sinks(sinks, hq, prefix_len + n_tree, seed=n_tree)
    if sink_logits is not None and dtype != torch.float32 and sinks == "random":
        sink_logits = sink_logits.to(dtype)  # any float dtype
    kw = dict(positions=positions, window=window, softcap=softcap, sinks=sink_logits)
    expected = ref.tree_attention(q, k, v, bits, prefix_len, **kw)
    plain = ref.tree_attention(q, k, v, bits, prefix_len, positions=positions, window=window)
    if prefix_len + n_tree > 1 or sinks is not None:  # (one key: softmax weight 1, whatever its score)
        assert (expected.float() - plain.float()).abs().max() > 0.05, "the feature must change the result"
    check(tree_attention_triton(q, k, v, bits, prefix_len, num_splits=num_splits, **kw), expected, dtype)
    if num_splits == 1:
        check(dk.tree_attention(q, k, v, bits, prefix_len, **kw), expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_sinks_are_added_once_across_splits(num_splits):
    # A sink equal to the log-sum-exp of the visible scores takes exactly half of every row's weight.
    prefix_len, n_tree = 100, 33
    q, k, v = make_inputs(4, 2, n_tree, prefix_len, 64, torch.float32, seed=4)
    sinks = torch.zeros(4, device=DEVICE)  # with all-zero queries of head 1, every score is 0 ...
    q = q.clone()
    q[1] = 0
    sinks[1] = torch.log(torch.tensor(float(prefix_len + n_tree)))  # ... and the last row sees S keys
    out = tree_attention_triton(q, k, v, None, prefix_len, sinks=sinks, num_splits=num_splits)
    check(out, ref.tree_attention(q, k, v, None, prefix_len, sinks=sinks), torch.float32)
    torch.testing.assert_close(out[1, -1], 0.5 * ref.tree_attention(q, k, v, None, prefix_len)[1, -1],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_row_that_sees_no_key_outputs_zero(num_splits, with_sinks):
    # bits are any int32 rows: row 2 sees no tree key, and there is no prefix.
    n_tree = 5
    q, k, v = make_inputs(2, 1, n_tree, 0, 16, torch.float32, seed=6)
    bits = ones_bits(n_tree)
    bits[2] = 0
    sinks = torch.tensor([0.3, float("-inf")], device=DEVICE) if with_sinks else None
    out = tree_attention_triton(q, k, v, bits, 0, softcap=2.0, sinks=sinks, num_splits=num_splits)
    expected = ref.tree_attention(q, k, v, bits, 0, softcap=2.0, sinks=sinks)
    assert out[:, 2].abs().max() == 0 and expected[:, 2].abs().max() == 0
    check(out, expected, torch.float32)


def test_softcap_saturates_huge_scores():
    # Scores of +-1e4 with softcap 1: every visible score becomes +-1 (no overflow, no NaN).
    q, k, v = make_inputs(2, 2, 9, 20, 32, torch.float32, seed=8)
    q = q * 1e3
    bits = random_tree_bits(9, 8)
    out = dk.tree_attention(q, k, v, bits, 20, softcap=1.0, sinks=torch.tensor([40.0, -40.0], device=DEVICE))
    assert torch.isfinite(out).all()
    check(out, ref.tree_attention(q, k, v, bits, 20, softcap=1.0, sinks=torch.tensor([40.0, -40.0])),
          torch.float32)


def test_warmup_with_softcap_and_sinks():
    q, k, v = make_inputs(4, 2, 17, 40, 64, torch.bfloat16, seed=4)
    sinks = torch.randn(4, device=DEVICE)
    assert dk.warmup_tree_attention(q, k, v, None, 40, window=8, softcap=3.0, sinks=sinks) is None


@triton.jit
def _tanh_probe_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, tanh_f32(x), mask=offs < n)


def test_tanh_f32_is_accurate_to_a_few_ulps():
    x = torch.cat([torch.linspace(-20, 20, 4001), torch.logspace(-30, 1.5, 600), -torch.logspace(-30, 1.5, 600),
                   torch.tensor([0.0, 0.25, -0.25, 0.2499999, 0.2500001, float("inf"), float("-inf"), 1e30])])
    x = x.float().to(DEVICE)
    out = torch.empty_like(x)
    _tanh_probe_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = torch.tanh(x.double())
    rel = ((out.double() - want).abs() / want.abs().clamp_min(1e-300))[want != 0]
    assert float(rel.max()) < 5e-7
    assert torch.equal(out[x == 0], x[x == 0]) and bool((out.abs() <= 1).all())


# ----------------------------------------------------------------------------
# The reference itself
# ----------------------------------------------------------------------------

def naive_visible(parents, prefix_len, n_tree, positions, window):
    """Python loops: query i sees key k (the rule, written out once more)."""
    pos_q = list(positions) if positions is not None else [prefix_len + i for i in range(n_tree)]
    pos_k = list(range(prefix_len)) + pos_q
    seen = torch.zeros(n_tree, prefix_len + n_tree, dtype=torch.bool)
    for i in range(n_tree):
        ancestors = set()
        node = i
        while parents != "all" and node >= 0:
            ancestors.add(node)
            node = parents[node] if parents is not None else node - 1
        for key in range(prefix_len + n_tree):
            ok = key < prefix_len or parents == "all" or (key - prefix_len) in ancestors
            if window is not None and pos_q[i] - pos_k[key] >= window:
                ok = False
            seen[i, key] = ok
    return seen


@pytest.mark.parametrize("softcap,sinks", [(None, False), (0.5, False), (None, True), (3.0, True)])
@pytest.mark.parametrize("mode,window", [("tree", None), ("chain", None), ("ones", None), ("tree", 3),
                                         ("chain", 4), ("ones", 2)])
def test_reference_equals_naive_per_head_softmax(mode, window, softcap, sinks):
    prefix_len, n_tree, hq, hkv, d = 6, 9, 4, 2, 8
    parents, depth = random_parents(n_tree, 7)
    bits = {"tree": dk.ancestor_bits(torch.tensor(parents)), "chain": None, "ones": ones_bits(n_tree)}[mode]
    positions = [prefix_len + x for x in (depth if mode == "tree" else range(n_tree))]
    pos_t = torch.tensor(positions) if window else None
    seen = naive_visible({"tree": parents, "chain": None, "ones": "all"}[mode], prefix_len, n_tree,
                         positions if window else None, window)
    assert torch.equal(ref.tree_visibility(bits, prefix_len, n_tree, positions=pos_t, window=window), seen)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(hq, n_tree, d, generator=gen)
    k = torch.randn(hkv, prefix_len + n_tree, d, generator=gen)
    v = torch.randn(hkv, prefix_len + n_tree, d, generator=gen)
    scale = 0.7
    sink_logits = torch.tensor([1.0, -2.0, 0.5, 3.0]) if sinks else None
    want = torch.empty(hq, n_tree, d)
    for h in range(hq):
        kv = h // (hq // hkv)
        for i in range(n_tree):
            scores = []
            for j in range(prefix_len + n_tree):
                s = float(q[h, i] @ k[kv, j]) * scale
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                scores.append(s if seen[i, j] else float("-inf"))
            if sinks:
                scores.append(float(sink_logits[h]))
            p = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)[: prefix_len + n_tree]
            want[h, i] = (p[:, None] * v[kv].double()).sum(0).float()
    got = ref.tree_attention(q, k, v, bits, prefix_len, scale, positions=pos_t, window=window, softcap=softcap,
                             sinks=sink_logits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_mask_matches_visibility():
    bits = random_tree_bits(40, 3)
    mask = ref.tree_attention_mask(bits, 5, torch.float32)
    assert torch.equal(mask == 0, ref.tree_visibility(bits, 5, 40))


class _FamilyAttention(torch.nn.Module):
    """The attributes transformers' eager attention functions read from the attention module."""

    def __init__(self, hq, hkv, d, sinks=None):
        super().__init__()
        self.num_key_value_groups = hq // hkv
        self.head_dim = d
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)
        self.eval()


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_reference_equals_transformers_eager_attention(family):
    """gpt-oss's sinks and Gemma 2's softcap as transformers' eager attention applies them (additive
    ``finfo.min`` mask), incl. a row that sees no key (bits row 3 empty, no prefix): gpt-oss gives 0 there."""
    import importlib

    eager = importlib.import_module(f"transformers.models.{family}.modeling_{family}").eager_attention_forward
    hq, hkv, n_tree, d, scale = 4, 2, 9, 16, 0.4
    q, k, v = make_inputs(hq, hkv, n_tree, 0, d, torch.float32, seed=12)
    q, k, v = q.cpu() * 3, k.cpu(), v.cpu()
    bits = random_tree_bits(n_tree, 12).cpu()
    if family == "gpt_oss":
        bits[3] = 0
    hidden = ~ref.tree_visibility(bits, 0, n_tree)
    mask = torch.zeros(n_tree, n_tree).masked_fill(hidden, torch.finfo(torch.float32).min)
    if family == "gpt_oss":
        sinks = torch.tensor([0.5, -1.0, 2.0, -30.0])
        module = _FamilyAttention(hq, hkv, d, sinks)
        want, _ = eager(module, q[None], k[None], v[None], mask[None, None], scaling=scale)
        got = ref.tree_attention(q, k, v, bits, 0, scale, sinks=sinks)
        assert got[:, 3].abs().max() == 0
    else:
        module = _FamilyAttention(hq, hkv, d)
        want, _ = eager(module, q[None], k[None], v[None], mask[None, None], scaling=scale, softcap=0.8)
        got = ref.tree_attention(q, k, v, bits, 0, scale, softcap=0.8)
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------
# Launch choices: no recompiles, wave-filling splits
# ----------------------------------------------------------------------------

def test_per_round_ints_are_never_specialized():
    kwargs = getattr(_tree_attention_kernel, "kwargs", None)  # interpreter
    dns = kwargs["do_not_specialize"] if kwargs is not None else _tree_attention_kernel.do_not_specialize
    assert {"n_tree", "prefix_len", "window"} <= set(dns) == set(TREE_ATTENTION_DYNAMIC_INTS)
    assert set(dns) <= set(_tree_attention_kernel.arg_names)
    unaligned = kwargs["do_not_specialize_on_alignment"] if kwargs is not None else [
        p.name for p in _tree_attention_kernel.params if p.do_not_specialize_on_alignment]
    assert set(unaligned) == {"bits_ptr", "pos_ptr", "sinks_ptr", "prefix_ptr"}
    # The split count is a grid dim, not an argument.
    assert not any("split" in name for name in _tree_attention_kernel.arg_names if name != "SPLIT_KEYS")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_config_table_is_small_and_fixed(head_dim, dtype):
    configs = tree_attention_configs(head_dim, dtype)
    assert 1 <= len(configs) <= 4
    for n_rows in range(1, 5000, 7):
        assert tree_attention_config(head_dim, dtype, n_rows) in configs
    for cfg in configs:
        assert cfg["BLOCK_N"] % 32 == 0 and cfg["BLOCK_D"] >= head_dim and cfg["maxnreg"] == 255


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_arch_tables_share_their_row_tiles(head_dim):
    # sm_90 runs 128-row tiles over 64-key tiles (m64n64 wgmma scores), sm_80 over 32 (its mma.sync tile at 64
    # keys spills); nothing else differs, so the row tile (and the binaries a warmup groups by) is the same.
    hopper = tree_attention_configs(head_dim, torch.bfloat16, 90)
    ampere = tree_attention_configs(head_dim, torch.bfloat16, 80)
    assert tree_attention_configs(head_dim, torch.bfloat16) == hopper
    assert [{**c, "BLOCK_N": 0, "UNMASKED_PREFIX": 0} for c in hopper] == \
        [{**c, "BLOCK_N": 0, "UNMASKED_PREFIX": 0} for c in ampere]
    for h, a in zip(hopper, ampere):
        wide = h["BLOCK_M"] == 128 and head_dim <= 128
        assert (h["BLOCK_N"], a["BLOCK_N"]) == ((64, 32) if wide else (a["BLOCK_N"], a["BLOCK_N"]))
        # (sm_80's 128 x 32 tile at D <= 128 keeps one masked prefix loop: the unmasked one makes it spill)
        assert h["UNMASKED_PREFIX"] and a["UNMASKED_PREFIX"] == (not wide)
    for n_rows in range(1, 3000, 11):
        assert tree_attention_config(head_dim, torch.bfloat16, n_rows, 80)["BLOCK_M"] == \
            tree_attention_config(head_dim, torch.bfloat16, n_rows, 90)["BLOCK_M"]
    # 257 tree tokens x G 4 = 1028 rows: 9 tiles of 128 (1152 rows), over 64-key tiles on sm_90.
    cfg = tree_attention_config(head_dim, torch.bfloat16, 1028, 90)
    assert cfg["BLOCK_M"] == (128 if head_dim <= 128 else 64)


def test_row_tile_choice_keeps_padding_small():
    # T = 65 at Qwen3-8B's G = 4: 260 rows -> 5 tiles of 64 (60 padded rows), not 2 x 128 per head.
    assert tree_attention_config(128, torch.bfloat16, 260)["BLOCK_M"] == 64
    assert tree_attention_config(128, torch.bfloat16, 8)["BLOCK_M"] == 16
    assert tree_attention_config(128, torch.bfloat16, 64)["BLOCK_M"] == 64
    assert tree_attention_config(128, torch.bfloat16, 4100)["BLOCK_M"] == 128
    for n_rows in range(1, 5000):
        block_m = tree_attention_config(128, torch.bfloat16, n_rows)["BLOCK_M"]
        padded = -(-n_rows // block_m) * block_m
        assert padded - n_rows < 128 and (n_rows < 64 or padded - n_rows <= 0.33 * padded)
        assert n_rows < 256 or padded - n_rows <= 0.2 * padded


@pytest.mark.parametrize("sms", [108, 132])
def test_split_count_minimizes_the_modeled_time(sms):
    for programs in (1, 2, 8, 24, 40, 72, 100, 140, 200, 264, 600):
        for key_tiles in (1, 3, 8, 16, 64, 69, 130, 517, 1000):
            splits = choose_num_splits(programs, key_tiles, sms)
            allowed = range(1, max(1, min(MAX_SPLITS, key_tiles // MIN_TILES_PER_SPLIT)) + 1)
            assert splits in allowed
            best = min(split_time(programs, key_tiles, sms, s) for s in allowed)
            assert split_time(programs, key_tiles, sms, splits) == best
            assert all(split_time(programs, key_tiles, sms, s) > best for s in allowed if s < splits)
    # The model: waves x tiles per split, plus the merge and the partials of a split launch.
    assert split_time(72, 69, 132, 1) == 69
    assert split_time(72, 69, 132, 7) == 4 * 10 + 2 + 7 * 72 / 132


def test_split_count_at_257_tree_rows():
    # 257 tokens x G 4 = 1028 rows: 9 tiles of 128 x 8 kv heads = 72 programs on an H100 / H200 (132 SMs).
    assert choose_num_splits(72, 4096 // 64 + 5, 132) == 7  # 504 programs: 4 waves of 10 tiles
    assert choose_num_splits(72, 32768 // 64 + 5, 132) == 11  # 792 programs: 6 whole waves of 47 tiles
    # Qwen3-8B, T = 65 (5 row tiles x 8 kv heads) with a 4k prefix: 3 splits, 120 / 132 SMs, one wave.
    assert choose_num_splits(40, 4096 // 64 + 2, 132) == 3
    # A decode step (8 programs) over 8k keys: 15 splits of 9 tiles, one wave.
    assert choose_num_splits(8, 8192 // 64 + 1, 132) == 15
    # A grid of whole waves is not split (the merge would only add time).
    assert choose_num_splits(4 * 132, 69, 132) == 1


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------

def test_errors_are_clear():
    q, k, v = make_inputs(4, 2, 5, 3, 16, torch.float32, seed=0)
    bits = random_tree_bits(5, 0)
    with pytest.raises(ValueError, match="prefix_len"):
        dk.tree_attention(q, k, v, bits, 2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        dk.tree_attention(q[:3], k, v, bits, 3)
    with pytest.raises(ValueError, match="one dtype"):
        dk.tree_attention(q.half(), k, v, bits, 3)
    with pytest.raises(ValueError, match="head dim"):
        dk.tree_attention(q[..., :8], k, v, bits, 3)
    with pytest.raises(ValueError, match="bits must be"):
        dk.tree_attention(q, k, v, bits[:4], 3)
    with pytest.raises(ValueError, match="int32"):
        dk.tree_attention(q, k, v, bits.long(), 3)
    with pytest.raises(TypeError, match="bits must be a torch.Tensor or None"):
        dk.tree_attention(q, k, v, [[1]], 3)
    with pytest.raises(ValueError, match="batch size 1"):
        dk.tree_attention(torch.stack([q, q]), k, v, bits, 3)
    with pytest.raises(ValueError, match="value shape"):
        dk.tree_attention(q, k, v[:1], bits, 3)
    for window in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="window must be None or an int >= 1"):
            dk.tree_attention(q, k, v, bits, 3, window=window)
    with pytest.raises(ValueError, match=r"positions must be a 1-D \[T\] = \[5\] int32/int64"):
        dk.tree_attention(q, k, v, bits, 3, positions=torch.arange(4), window=2)
    with pytest.raises(ValueError, match="int32/int64"):
        dk.tree_attention(q, k, v, bits, 3, positions=torch.arange(5.0), window=2)
    with pytest.raises(TypeError, match="positions must be a torch.Tensor"):
        dk.tree_attention(q, k, v, bits, 3, positions=[3, 4, 5, 6, 7], window=2)
    with pytest.raises(ValueError, match="num_splits"):
        tree_attention_triton(q, k, v, bits, 3, num_splits=0)
    for softcap in (0, 0.0, -1.0, True, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match=r"softcap must be None or a finite float > 0"):
            dk.tree_attention(q, k, v, bits, 3, softcap=softcap)
    for sinks in (torch.zeros(3), torch.zeros(1, 4), torch.zeros(4, dtype=torch.int64), torch.zeros(())):
        with pytest.raises(ValueError, match=r"sinks must be a 1-D float tensor \[Hq\] = \[4\]"):
            dk.tree_attention(q, k, v, bits, 3, sinks=sinks.to(DEVICE))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        dk.tree_attention(q, k, v, bits, 3, sinks=[0.0] * 4)
    with pytest.raises(ValueError, match="sinks is on meta"):
        dk.tree_attention(q, k, v, bits, 3, sinks=torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="softcap"):
        dk.warmup_tree_attention(q, k, v, bits, 3, softcap=-2.0)


def test_kv_offsets_past_int32_are_refused():
    """The kernel's K / V offsets within one kv head are int32: a view whose keys of one head span 2^31
    elements or more (with a tile of slack for masked lanes) is refused by the Triton launcher, not read
    through wrapped offsets. Meta tensors: no memory, and the check runs before any launch."""
    n_tree, prefix, d = 5, 3, 16
    q = torch.empty(4, n_tree, d, device="meta")
    bits = torch.empty(n_tree, 1, dtype=torch.int32, device="meta")
    wide = torch.empty_strided((2, prefix + n_tree, d), (0, 2**26, 1), device="meta")
    with pytest.raises(ValueError, match=r"key spans .* int32 offsets \(2\^31\)"):
        tree_attention_triton(q, wide, wide, bits, prefix)
    narrow = torch.empty_strided((2, prefix + n_tree, d), (0, 2**20, 1), device="meta")
    with pytest.raises(ValueError, match=r"value spans"):
        tree_attention_triton(q, narrow, wide, bits, prefix)
