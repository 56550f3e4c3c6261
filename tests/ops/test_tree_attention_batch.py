"""Batched tree attention: ``b`` independent sequences (rows) in one call.

Every batched output row is checked against the single-row call on that row's
slices: the Triton kernel (interpreter) bit for bit (a batch row's programs run
the single-row program's arithmetic; only base pointers move), the reference
within float32 rounding (one batched SDPA vs per-row ones), and both against
the per-row reference. K/V are views ``kv[:, layer, 0]`` / ``kv[:, layer, 1]``
of a ``[b, L, 2, Hkv, S_max, D]`` cache, the query a transposed view, as a
batched model passes them. Shapes rotate through b 1/2/3/5, T 1/7/33/65, GQA
4/2 and 8/1, D 64/96/128; shared and per-row trees, chains, int and per-row
tensor prefixes (0 among them, NaN in every cache row a row never reads),
windows (shared and per-row positions, and the default ones), softcap, sinks
and forced key splits.
"""

import importlib
import itertools
import random

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import reference as ref
from dflash_kernels.tree_attention import tree_attention_triton

from kernel_stub import KernelStub

#: The attention kernel's argument names (read before any test swaps the kernel for a stub).
KERNEL_ARG_NAMES = importlib.import_module("dflash_kernels.tree_attention")._tree_attention_kernel.arg_names

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}
#: Committed lengths of the rows of a per-row prefix (rotated per case): 0 and unaligned ones among them.
ROW_PREFIXES = (37, 0, 70, 5, 100)


def random_parents(n_tree, seed):
    rng = random.Random(seed)
    parents, depth = [-1], [0]
    for i in range(1, n_tree):
        p = rng.randint(max(0, i - 24), i - 1)
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents, depth


def tree(n_tree, seed):
    """(bits [T, W], depths) of a random tree."""
    parents, depth = random_parents(n_tree, seed)
    return dk.ancestor_bits(torch.tensor(parents, dtype=torch.int64, device=DEVICE)), depth


def make_batch(b, hq, hkv, n_tree, prefixes, head_dim, dtype, seed, layers=2, smax_extra=9):
    """``q [b, Hq, T, D]`` (a transposed view) and the cache ``[b, L, 2, Hkv, S_max, D]``; row ``r``'s cache
    rows ``>= prefixes[r] + T`` hold NaN (no call may read them)."""
    gen = torch.Generator().manual_seed(seed)
    s_max = max(prefixes) + n_tree + smax_extra
    q = torch.randn(b, n_tree, hq, head_dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    kv = torch.randn(b, layers, 2, hkv, s_max, head_dim, generator=gen).to(DEVICE, dtype)
    for r, p in enumerate(prefixes):
        kv[r, :, :, :, p + n_tree:] = float("nan")
    return q, kv


def check(out, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def row_args(q, k, v, bits, positions, prefixes, r, n_tree):
    """Row ``r``'s single-row inputs with an int prefix: K/V sliced to its live keys."""
    p = prefixes[r]
    row_bits = bits if bits is None or bits.dim() == 2 else bits[r]
    row_pos = positions if positions is None or positions.dim() == 1 else positions[r]
    return q[r], k[r, :, :p + n_tree], v[r, :, :p + n_tree], row_bits, p, row_pos


# (b, T, heads, D, dtype, bits kind, prefix kind, window, positions kind, softcap, sinks, splits)
_KINDS = ("shared", "per_row", "chain")
BATCH_CASES = [
    (b, t, ((4, 2), (8, 1))[i % 2], (64, 96, 128)[i % 3], (torch.float32, torch.bfloat16, torch.float16)[(i // 2) % 3],
     _KINDS[i % 3], ("tensor", "int")[(i // 3) % 2], (None, 5, 40)[(i // 2) % 3], ("given", "default")[(i // 2) % 2],
     (None, 3.0)[(i // 5) % 2], i % 4 in (1, 2), (1, 3)[(i // 4) % 2])
    for i, (b, t) in enumerate(itertools.product((1, 2, 3, 5), (1, 7, 33, 65)))
]


@pytest.mark.parametrize(
    "b,n_tree,heads,head_dim,dtype,bits_kind,prefix_kind,window,pos_kind,softcap,sinks,num_splits", BATCH_CASES,
    ids=[f"b{b}-T{t}-{h[0]}x{h[1]}-D{d}-{str(dt)[6:]}-{bk}-{pk}-w{w}-{pos}-c{c}-{'sinks' if s else 'nosinks'}-"
         f"split{n}" for b, t, h, d, dt, bk, pk, w, pos, c, s, n in BATCH_CASES],
)
def test_batched_equals_per_row_calls(b, n_tree, heads, head_dim, dtype, bits_kind, prefix_kind, window, pos_kind,
                                      softcap, sinks, num_splits):
    hq, hkv = heads
    seed = 1000 * b + n_tree
    per_row_prefix = prefix_kind == "tensor"
    prefixes = [ROW_PREFIXES[(r + n_tree) % len(ROW_PREFIXES)] for r in range(b)] if per_row_prefix \
        else [ROW_PREFIXES[n_tree % len(ROW_PREFIXES)]] * b
    q, kv = make_batch(b, hq, hkv, n_tree, prefixes, head_dim, dtype, seed)
    layer = 1
    k, v = kv[:, layer, 0], kv[:, layer, 1]  # [b, Hkv, S_max, D], batch stride L * 2 * Hkv * S_max * D
    assert k.stride(0) == kv.stride(0) and (n_tree == 1 or not q.is_contiguous())
    if bits_kind == "chain":
        bits, depths = None, [list(range(n_tree))] * b
    elif bits_kind == "shared":
        bits, depth = tree(n_tree, seed)
        depths = [depth] * b
    else:
        rows = [tree(n_tree, seed + r) for r in range(b)]
        bits = torch.stack([x for x, _ in rows])
        depths = [d for _, d in rows]
    positions = None
    if window is not None and pos_kind == "given":
        if per_row_prefix or bits_kind == "per_row":
            positions = torch.tensor([[p + x for x in d] for p, d in zip(prefixes, depths)], device=DEVICE)
        else:
            positions = torch.tensor([prefixes[0] + x for x in depths[0]], device=DEVICE)
    sink_logits = torch.linspace(-1.0, 3.0, hq, device=DEVICE) if sinks else None
    kw = dict(window=window, softcap=softcap, sinks=sink_logits)
    if per_row_prefix:
        prefix = torch.tensor(prefixes, dtype=torch.int64, device=DEVICE)
        batch_k, batch_v = k, v  # the whole cache views
    else:
        prefix = prefixes[0]
        batch_k, batch_v = k[:, :, :prefix + n_tree], v[:, :, :prefix + n_tree]

    out = tree_attention_triton(q, batch_k, batch_v, bits, prefix, positions=positions, num_splits=num_splits, **kw)
    batched_ref = ref.tree_attention(q, batch_k, batch_v, bits, prefix, positions=positions, **kw)
    assert out.shape == (b, hq, n_tree, head_dim) and torch.isfinite(out).all() and torch.isfinite(batched_ref).all()
    assert out.is_contiguous() and batched_ref.is_contiguous()  # as the ops' fakes say
    for r in range(b):
        q_r, k_r, v_r, bits_r, p, pos_r = row_args(q, k, v, bits, positions, prefixes, r, n_tree)
        if window is not None and pos_r is None:
            pos_r = torch.arange(p, p + n_tree, device=DEVICE)  # the default: p_r + arange(T)
        row_kw = dict(kw, positions=pos_r)
        if per_row_prefix:  # the single-row tensor form over the same cache views
            single = tree_attention_triton(q_r, k[r], v[r], bits_r, prefix[r:r + 1], num_splits=num_splits, **row_kw)
        else:
            single = tree_attention_triton(q_r, k_r, v_r, bits_r, p, num_splits=num_splits, **row_kw)
        assert torch.equal(out[r], single), f"row {r}: the batched kernel differs from the single-row call"
        expected = ref.tree_attention(q_r, k_r, v_r, bits_r, p, **row_kw)
        check(out[r], expected, dtype)
        check(batched_ref[r], expected, dtype)
        atol = 1e-6 if dtype == torch.float32 else TOLERANCE[dtype][0]
        torch.testing.assert_close(batched_ref[r].float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("prefix_kind", ["int", "tensor"])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_one_row_batched_is_the_unbatched_call_bit_for_bit(mode, prefix_kind):
    """b == 1 with every input in its batched form ([1, ...] query/K/V, [1, T, W] bits, [1, T] positions, a
    [1] prefix) is the unbatched call, bit for bit, on both backends (the Triton launch is the same binary with
    the same arguments but the batch strides, which one row never uses)."""
    n_tree, prefix_len, window = 17, 40, 9
    q, kv = make_batch(1, 8, 2, n_tree, [prefix_len], 64, torch.bfloat16, seed=7)
    k, v = kv[:, 1, 0], kv[:, 1, 1]
    bits = None if mode == "chain" else tree(n_tree, 7)[0]
    positions = torch.arange(prefix_len, prefix_len + n_tree, device=DEVICE) + 2
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kw = dict(window=window, softcap=2.0, sinks=sinks)
    if prefix_kind == "int":
        k, v = k[:, :, :prefix_len + n_tree], v[:, :, :prefix_len + n_tree]
        prefix, prefix_one = prefix_len, prefix_len
    else:
        prefix, prefix_one = torch.tensor([prefix_len], device=DEVICE), torch.tensor(prefix_len, device=DEVICE)
    batched_bits = None if bits is None else bits[None]
    for backend in ("triton", "reference"):
        with dk.force_backend(backend):
            one = dk.tree_attention(q[0], k[0], v[0], bits, prefix_one, positions=positions, **kw)
            batched = dk.tree_attention(q, k, v, batched_bits, prefix, positions=positions[None], **kw)
            plain_kw = dict(window=window)  # the SDPA path of the reference too
            one_plain = dk.tree_attention(q[0], k[0], v[0], bits, prefix_one, positions=positions, **plain_kw)
            batched_plain = dk.tree_attention(q, k, v, batched_bits, prefix, positions=positions[None], **plain_kw)
        assert batched.shape == (1,) + one.shape
        assert torch.equal(batched[0], one) and torch.equal(batched_plain[0], one_plain), backend
    for splits in (1, 2):
        one = tree_attention_triton(q[0], k[0], v[0], bits, prefix_one, positions=positions, num_splits=splits, **kw)
        batched = tree_attention_triton(q, k, v, batched_bits, prefix, positions=positions[None], num_splits=splits,
                                        **kw)
        assert torch.equal(batched[0], one)


def test_rows_with_a_prefix_at_the_cache_end_and_empty_prefixes():
    """Per-row prefixes at both extremes: 0 (only tree keys) and S_max - T (the last rows of the cache), with
    splits that are empty for the short rows (their partials weigh 0 in the merge)."""
    n_tree, s_max = 5, 140
    prefixes = [0, s_max - n_tree, 3]
    q, kv = make_batch(3, 4, 2, n_tree, prefixes, 64, torch.float32, seed=3, smax_extra=0)
    k, v = kv[:, 0, 0], kv[:, 0, 1]
    bits = torch.stack([tree(n_tree, r)[0] for r in range(3)])
    prefix = torch.tensor(prefixes, device=DEVICE)
    for splits in (1, 4):
        out = tree_attention_triton(q, k, v, bits, prefix, num_splits=splits)
        for r, p in enumerate(prefixes):
            check(out[r], ref.tree_attention(q[r], k[r, :, :p + n_tree], v[r, :, :p + n_tree], bits[r], p),
                  torch.float32)
    check(ref.tree_attention(q, k, v, bits, prefix), out, torch.float32)


def test_int32_prefix_tensor_and_each_row_reads_its_own_cache():
    """An int32 prefix [b]; only row 1's values are non-zero, so rows 0 and 2 must output exactly zero."""
    n_tree = 7
    prefixes = [4, 9, 0]
    q, kv = make_batch(3, 4, 2, n_tree, prefixes, 32, torch.float32, seed=5)
    kv = kv.nan_to_num(0.0)
    kv[0, :, 1].zero_()
    kv[2, :, 1].zero_()
    k, v = kv[:, 0, 0], kv[:, 0, 1]
    prefix = torch.tensor(prefixes, dtype=torch.int32, device=DEVICE)
    for backend in ("triton", "reference"):
        with dk.force_backend(backend):
            out = dk.tree_attention(q, k, v, None, prefix)
        assert out[0].abs().max() == 0 and out[2].abs().max() == 0 and out[1].abs().min() > 0, backend


def test_warmup_accepts_a_batch():
    q, kv = make_batch(2, 4, 2, 9, [12, 3], 64, torch.bfloat16, seed=9)
    prefix = torch.tensor([12, 3], device=DEVICE)
    assert dk.warmup_tree_attention(q, kv[:, 0, 0], kv[:, 0, 1], None, prefix, window=4) is None


def test_batched_launch_grid_strides_and_no_host_read(monkeypatch):
    """Meta tensors (any host read raises): the grid's axis 1 is b * Hkv, the split count counts the batch's
    programs, the batch strides are the cache's (an int64 value past 2^31 elements), shared bits get batch
    stride 0, and two prefix values launch identically."""
    ta_module = importlib.import_module("dflash_kernels.tree_attention")  # (the package attribute is the op)
    stub, merge = KernelStub(), KernelStub()
    monkeypatch.setattr(ta_module, "_tree_attention_kernel", stub)
    monkeypatch.setattr(ta_module, "_merge_splits_kernel", merge)
    b, hq, hkv, t, d, layers, s_max = 3, 32, 8, 9, 128, 36, 32768
    q = torch.empty(b, t, hq, d, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    kv = torch.empty(b, layers, 2, hkv, s_max, d, dtype=torch.bfloat16, device="meta")
    k, v = kv[:, 5, 0], kv[:, 5, 1]
    bits = torch.empty(t, 1, dtype=torch.int32, device="meta")
    with dk.force_backend("triton"):
        for _ in range(2):
            dk.tree_attention(q, k, v, bits, torch.empty(b, dtype=torch.int64, device="meta"), window=100)
        tree_attention_triton(q, k, v, bits, torch.empty(b, dtype=torch.int64, device="meta"), num_splits=3)
    (grid_a, args_a, kw_a), (grid_b, args_b, kw_b), (grid_s, args_s, kw_s) = stub.launches
    assert grid_a == grid_b and grid_a[1] == b * hkv and kw_a == kw_b and kw_a["PREFIX_IN_MEMORY"]
    assert grid_s == (grid_a[0], b * hkv, 3) and merge.launches[0][0][1] == b * hkv
    same = lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x  # noqa: E731
    assert [same(a) for a in args_a] == [same(x) for x in args_b]
    assert args_a[6].shape == (b,)  # prefix_ptr: the [b] tensor itself
    names = KERNEL_ARG_NAMES
    args = dict(zip(names, args_a))
    assert args["stride_kb"] == args["stride_vb"] == kv.stride(0) == layers * 2 * hkv * s_max * d > 2**31
    assert args["stride_qb"] == q.stride(0) and args["stride_ob"] == hq * t * d  # multiples of 16 (hinted)
    assert args["stride_bits_b"] == 0 and args["stride_prefix_b"] == 1 and args["stride_pos_b"] == t
    assert args["n_kv_heads"] == hkv
    # one row, in either rank: batch strides 0, the arguments of one launch whatever the layout
    dk.tree_attention(q[:1], k[:1], v[:1], bits, torch.empty(1, dtype=torch.int64, device="meta"), window=100)
    dk.tree_attention(q[0], k[0], v[0], bits, torch.empty((), dtype=torch.int64, device="meta"), window=100)
    one, other = (dict(zip(names, launch[1])) for launch in stub.launches[3:])
    assert stub.launches[3][0][1] == hkv
    for name in ("stride_qb", "stride_kb", "stride_vb", "stride_ob"):
        assert one[name] == other[name] == 0, name
    assert {n: same(x) for n, x in one.items()} == {n: same(x) for n, x in other.items()}




def test_batched_split_count_counts_every_row(monkeypatch):
    """On a GPU the split count is chosen for the whole grid: row tiles x b x Hkv programs."""
    ta_module = importlib.import_module("dflash_kernels.tree_attention")
    seen = []
    monkeypatch.setattr(ta_module, "_tree_attention_kernel", KernelStub())
    monkeypatch.setattr(ta_module, "_merge_splits_kernel", KernelStub())
    monkeypatch.setattr(ta_module, "_auto_num_splits", lambda device, programs, key_tiles: seen.append(
        (programs, key_tiles)) or 1)
    q = torch.empty(4, 32, 65, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(4, 8, 4096 + 65, 128, dtype=torch.bfloat16, device="meta")
    with dk.force_backend("triton"):
        dk.tree_attention(q, k, k, None, 4096)
    # 65 tokens x G 4 = 260 rows: 5 tiles of 64, per kv head and row
    assert seen == [(5 * 8 * 4, 4096 // 64 + 2)]
    assert ta_module.choose_num_splits(5 * 8, 4096 // 64 + 2, 132) == 3  # one row: 3 splits fill the H100
    # four rows: 160 programs, 4 splits (5 waves of 17 tiles), not the one-row choice
    assert ta_module.choose_num_splits(5 * 8 * 4, 4096 // 64 + 2, 132) == 4


# ----------------------------------------------------------------------------
# Visibility and masked attention
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_batched_visibility_stacks_the_rows(mode, window):
    b, n_tree, s_max = 3, 6, 20
    prefixes = [0, 7, 14]
    bits = None if mode == "chain" else torch.stack([tree(n_tree, r)[0] for r in range(b)])
    positions = torch.tensor([[p + i // 2 for i in range(n_tree)] for p in prefixes], device=DEVICE)
    prefix = torch.tensor(prefixes, device=DEVICE)
    for fn in (ref.tree_visibility, dk.tree_visibility):
        vis = fn(bits, prefix, n_tree, n_keys=s_max, positions=positions, window=window)
        assert vis.shape == (b, n_tree, s_max) and vis.dtype == torch.bool
        for r, p in enumerate(prefixes):
            row_bits = None if bits is None else bits[r]
            one = fn(row_bits, prefix[r:r + 1], n_tree, n_keys=s_max, positions=positions[r], window=window)
            assert torch.equal(vis[r], one)
            assert torch.equal(vis[r, :, :p + n_tree], fn(row_bits, p, n_tree, positions=positions[r], window=window))
            assert not vis[r, :, p + n_tree:].any()
    # int prefix, per-row bits or positions only: [b, T, prefix + T]; a shared tree with a [1] prefix: [T, S]
    if bits is not None:
        vis = ref.tree_visibility(bits, 5, n_tree)
        assert vis.shape == (b, n_tree, 5 + n_tree)
        assert all(torch.equal(vis[r], ref.tree_visibility(bits[r], 5, n_tree)) for r in range(b))
        assert ref.tree_visibility(bits[0], prefix[:1], n_tree, n_keys=s_max).shape == (n_tree, s_max)
    shared = ref.tree_visibility(None, prefix, n_tree, n_keys=s_max)  # a chain shared, prefixes per row
    assert shared.shape == (b, n_tree, s_max)
    with pytest.raises(ValueError, match="batch sizes of bits, positions differ"):
        ref.tree_visibility(torch.stack([tree(n_tree, 0)[0]] * 2), 3, n_tree, positions=positions, window=2)


def test_batched_masked_attention_equals_per_row():
    b, hq, hkv, n_tree, s_max, d = 3, 8, 2, 5, 24, 32
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(b, hq, n_tree, d, generator=gen).to(DEVICE)
    kv = torch.randn(b, 2, hkv, s_max, d, generator=gen).to(DEVICE)
    prefix = torch.tensor([0, 6, 19], device=DEVICE)
    bits = torch.stack([tree(n_tree, r)[0] for r in range(b)])
    vis = dk.tree_visibility(bits, prefix, n_tree, n_keys=s_max)
    out = dk.masked_attention(q, kv[:, 0], kv[:, 1], vis, scale=0.3)
    shared = dk.masked_attention(q, kv[:, 0], kv[:, 1], vis[1], scale=0.3)
    for r in range(b):
        one = dk.masked_attention(q[r], kv[r, 0], kv[r, 1], vis[r], scale=0.3)
        torch.testing.assert_close(out[r], one, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(shared[r], dk.masked_attention(q[r], kv[r, 0], kv[r, 1], vis[1], scale=0.3),
                                   atol=1e-6, rtol=1e-6)
        p = int(prefix[r])
        torch.testing.assert_close(out[r], ref.tree_attention(q[r], kv[r, 0, :, :p + n_tree], kv[r, 1, :, :p + n_tree],
                                                              bits[r], p, 0.3), atol=1e-5, rtol=1e-5)


def test_batched_reference_compiles_without_graph_breaks_and_replays_any_prefixes():
    """The reference with per-row device prefixes traces with fullgraph=True, and new prefix values in the same
    tensor replay the same graph (nothing is read on the host)."""
    from torch._dynamo.testing import CompileCounter

    b, n_tree = 2, 5
    # NaN from row 0's key 19 and row 1's key 30 (none): past every prefix + T below
    q, kv = make_batch(b, 4, 2, n_tree, [14, 25], 16, torch.float32, seed=11, smax_extra=3)
    k, v = kv[:, 0, 0], kv[:, 0, 1]
    bits = torch.stack([tree(n_tree, r)[0] for r in range(b)])
    positions = torch.zeros(b, n_tree, dtype=torch.int64, device=DEVICE)
    counter = CompileCounter()

    def step(q, k, v, bits, prefix, positions):
        return ref.tree_attention(q, k, v, bits, prefix, positions=positions, window=6, softcap=2.0)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    prefix = torch.zeros(b, dtype=torch.int64, device=DEVICE)
    for prefixes in ([9, 20], [0, 25], [14, 3]):
        prefix.copy_(torch.tensor(prefixes))
        positions.copy_(prefix[:, None] + torch.arange(n_tree) // 2)
        got = compiled(q, k, v, bits, prefix, positions)
        for r, p in enumerate(prefixes):
            want = ref.tree_attention(q[r], k[r, :, :p + n_tree], v[r, :, :p + n_tree], bits[r], p,
                                      positions=positions[r], window=6, softcap=2.0)
            torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------

def test_batch_errors_are_clear():
    b, n_tree = 3, 5
    q, kv = make_batch(b, 4, 2, n_tree, [3, 3, 3], 16, torch.float32, seed=0, smax_extra=0)
    k, v = kv[:, 0, 0], kv[:, 0, 1]
    bits = tree(n_tree, 0)[0]
    prefix = torch.tensor([3, 1, 0], device=DEVICE)
    with pytest.raises(ValueError, match=r"key has batch size 2 but query has 3"):
        dk.tree_attention(q, k[:2], v[:2], bits, 3)
    with pytest.raises(ValueError, match=r"value has batch size 2 but query has 3"):
        dk.tree_attention(q, k, v[:2], bits, 3)
    with pytest.raises(ValueError, match=r"key without a batch dim .* needs a query of batch size 1"):
        dk.tree_attention(q, k[0], v[0], bits, 3)
    with pytest.raises(ValueError, match=r"key has batch size 3 but query has 1"):
        dk.tree_attention(q[0], k, v, bits, 3)
    with pytest.raises(ValueError, match=r"query must be \[Hq, T, D\] or \[b, Hq, T, D\]"):
        dk.tree_attention(q[None], k, v, bits, 3)
    with pytest.raises(ValueError, match=r"prefix_len must have shape \[b\] = \[3\]"):
        dk.tree_attention(q, k, v, bits, prefix[:2])
    with pytest.raises(ValueError, match=r"prefix_len must have shape \[b\] = \[3\]"):
        dk.tree_attention(q, k, v, bits, prefix[:1])  # a shared [1] prefix is one row's form only
    with pytest.raises(ValueError, match=r"prefix_len must have shape \[b\] = \[3\]"):
        dk.tree_attention(q, k, v, bits, prefix[None])
    with pytest.raises(ValueError, match="int64"):
        dk.tree_attention(q, k, v, bits, prefix.float())
    with pytest.raises(ValueError, match=r"prefix_len is on meta but query is on"):
        dk.tree_attention(q, k, v, bits, torch.zeros(b, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match=r"bits must be \[T, >= ceil\(T/32\)\] = \[5, >= 1\] .* or \[b, T, "
                                         r">= ceil\(T/32\)\] = \[3, 5, >= 1\]"):
        dk.tree_attention(q, k, v, torch.stack([bits, bits]), 3)
    with pytest.raises(ValueError, match=r"bits must be"):
        dk.tree_attention(q, k, v, torch.stack([bits] * 3)[:, :4], 3)
    with pytest.raises(ValueError, match=r"bits must be"):
        dk.tree_attention(q, k, v, bits[None, None], 3)
    with pytest.raises(ValueError, match=r"positions must be a 1-D \[T\] = \[5\] int32/int64 tensor .* or a 2-D "
                                         r"\[b, T\] = \[3, 5\]"):
        dk.tree_attention(q, k, v, bits, 3, positions=torch.zeros(2, n_tree, dtype=torch.int64, device=DEVICE),
                          window=2)
    with pytest.raises(ValueError, match="positions must be"):
        dk.tree_attention(q, k, v, bits, 3, positions=torch.zeros(b, n_tree + 1, dtype=torch.int64, device=DEVICE),
                          window=2)
    with pytest.raises(ValueError, match=r"S_max >= T"):
        dk.tree_attention(q, k[:, :, :4], v[:, :, :4], bits, prefix)
    with pytest.raises(ValueError, match=r"prefix_len \+ T"):
        dk.tree_attention(q, k, v, bits, 2)
    with pytest.raises(ValueError, match=r"sinks must be a 1-D float tensor \[Hq\] = \[4\]"):
        dk.tree_attention(q, k, v, bits, 3, sinks=torch.zeros(b, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"prefix_len must have shape \[b\] = \[3\]"):
        dk.warmup_tree_attention(q, k, v, bits, prefix[:2])
