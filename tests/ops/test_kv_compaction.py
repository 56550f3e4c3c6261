"""KV compaction kernel against the index_select reference, overlaps included.

Covers the adversarial overlaps of an accepted tree path (``[0, 2, 3, ...]``:
an earlier row's source is a later row's destination), every subset of a
small tree as the accepted set, 1..20 rows (several 16-row chunks), a device
row count below the buffer length (``num_rows``), ``check=False`` (no value is
read on the host: proven on the meta device, which has no values), the error
messages, the fixed chunk tile (no recompiles) and, because Triton's
interpreter cannot show a race between warps, the barrier in the compiled
PTX.
"""

import itertools
import random

import pytest
import torch

import dflash_kernels as dk
import dflash_kernels.kv_compaction as kv_module
from dflash_kernels import force_backend
from dflash_kernels import reference as ref
from dflash_kernels.kv_compaction import KV_COMPACTION_CONFIGS, compact_kv_triton, kv_compaction_config
from kernel_stub import KernelStub


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cache(layers=3, heads=2, smax=48, head_dim=24, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, heads, smax, head_dim, generator=gen).to(DEVICE, dtype)


def expected_by_hand(kv, src, dst):
    out = kv.clone()
    for i, s in enumerate(src):
        out[:, :, :, dst + i] = kv[:, :, :, s]
    return out


def run_both(kv, src, dst, **kw):
    src_t = torch.tensor(src, dtype=torch.int64)
    want = ref.compact_kv_(kv.clone(), src_t, dst)
    got = kv.clone()
    assert compact_kv_triton(got, src_t, dst, **kw) is got
    assert torch.equal(got, want)
    assert torch.equal(want, expected_by_hand(kv, src, dst))
    return got


def path_positions(nodes, prefix):
    """Cache positions of accepted tree nodes (node 0 = the root at ``prefix``)."""
    return [prefix + n for n in nodes]


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


def test_row_tile_is_fixed_and_counts_are_not_specialized():
    """No recompiles: the chunk is 16 rows whatever the path length, row count and dst_start are not specialized.

    Fails on the old kernel (BLOCK_A = next_pow2(rows): 1, 2, 4, 8 or 16, and
    no do_not_specialize).
    """
    assert {kv_compaction_config(a, 128)["BLOCK_A"] for a in range(1, 40)} == {16}
    kernel = kv_module._compact_kv_kernel
    declared = getattr(kernel, "do_not_specialize", None)
    if declared is None:  # interpreter object
        declared = kernel.kwargs["do_not_specialize"]
    names = {kernel.arg_names[n] if isinstance(n, int) else n for n in declared}
    assert {"n_rows", "dst_start"} <= names


# ------------------------------------------------------------------ adversarial overlaps


def small_cache(seed=0, dtype=torch.float32, smax=64):
    return cache(layers=2, heads=1, smax=smax, head_dim=16, dtype=dtype, seed=seed)


@pytest.mark.parametrize("a", range(1, 21))
def test_skip_one_then_run_crosses_chunks(a):
    """Accepted nodes [0, 2, 3, ..., a]: row i >= 1 reads L+i+1, which row i+1 writes (same and next chunk)."""
    prefix = 7
    nodes = [0] + list(range(2, a + 1))
    run_both(small_cache(seed=a), path_positions(nodes, prefix), prefix)
    # and the mirror image: a run first, then the skip ([0, 1, ..., k, k+2, k+3, ...])
    k = a // 2
    nodes = list(range(k + 1)) + list(range(k + 2, a + 2))
    run_both(small_cache(seed=100 + a), path_positions(nodes, prefix), prefix)


def test_every_subset_of_a_small_tree():
    """Every accepted set {0} + S, S a subset of nodes 1..7: all overlap patterns of short paths."""
    kv = small_cache(seed=3, smax=24)
    prefix = 5
    for size in range(0, 8):
        for subset in itertools.combinations(range(1, 8), size):
            run_both(kv, path_positions((0,) + subset, prefix), prefix)


@pytest.mark.parametrize("a", [1, 2, 15, 16, 17, 20])
def test_dense_sparse_mixes_up_to_20_rows(a):
    rng = random.Random(a)
    for trial in range(3):
        prefix = rng.randint(0, 10)
        nodes = [0] + sorted(rng.sample(range(1, 40), a - 1))
        run_both(small_cache(seed=trial, smax=prefix + 41), path_positions(nodes, prefix), prefix)


# ------------------------------------------------------------------ device row count


@pytest.mark.parametrize("count_shape", [(1,), ()], ids=["shape1", "scalar"])
@pytest.mark.parametrize("count_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_device_row_count_below_the_buffer(count_shape, count_dtype, check, backend):
    """A fixed A = 20 buffer; only the first n rows move; entries past n are garbage and never read."""
    prefix, A = 6, 20
    nodes = [0, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    for n in (0, 1, 3, 16, 17, 18):
        kv = cache(layers=2, heads=2, smax=prefix + 40, head_dim=16, seed=n)
        src = path_positions(nodes[:n], prefix)
        garbage = [10 ** 6, -5, 0] * A  # out of range, negative, not increasing: must not be touched
        buf = torch.tensor(src + garbage[: A - n], dtype=torch.int64, device=DEVICE)
        count = torch.full(count_shape, n, dtype=count_dtype, device=DEVICE)
        want = expected_by_hand(kv, src, prefix)
        with force_backend(backend):
            out = dk.compact_kv_(kv, buf, prefix, num_rows=count, check=check)
        assert out is kv and torch.equal(kv, want), n


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_device_row_count_is_clamped_without_checks(backend):
    """check=False: a count above A moves A rows, a negative one moves nothing (no error, no host read)."""
    prefix = 4
    src = [4, 6, 7]
    for count, moved in ((5, src), (-2, [])):
        kv = small_cache(seed=count + 10)
        want = expected_by_hand(kv, moved, prefix)
        with force_backend(backend):
            dk.compact_kv_(kv, torch.tensor(src), prefix, num_rows=torch.tensor([count]), check=False)
        assert torch.equal(kv, want)


def test_device_count_near_the_end_of_the_cache():
    """dst_start + A past Smax is fine when the real rows fit (the reference too)."""
    smax, prefix = 32, 28
    kv = small_cache(seed=1, smax=smax)
    buf = torch.tensor([28, 30, 31, 0, 0, 0, 0, 0])  # A = 8 > Smax - prefix = 4
    want = expected_by_hand(kv, [28, 30, 31], prefix)
    for backend in ("triton", "reference"):
        got = kv.clone()
        with force_backend(backend):
            dk.compact_kv_(got, buf, prefix, num_rows=torch.tensor(3), check=False)
        assert torch.equal(got, want), backend


def test_check_true_validates_only_the_counted_rows():
    kv = small_cache()
    buf = torch.tensor([5, 7, 8, 3, 3])  # rows 3.. would be rejected
    want = expected_by_hand(kv, [5, 7, 8], 5)
    dk.compact_kv_(kv, buf, 5, num_rows=torch.tensor([3]), check=True)
    assert torch.equal(kv, want)
    with pytest.raises(ValueError, match="strictly increasing"):
        dk.compact_kv_(small_cache(), buf, 5, num_rows=torch.tensor([4]), check=True)


# ------------------------------------------------------------------ no host reads with check=False




@pytest.mark.parametrize("with_count", [False, True])
def test_check_false_reads_no_tensor_value_on_the_host(monkeypatch, with_count):
    """On the meta device any host read of a value raises; check=False must get through to the launch.

    check=True (the debug path) does read the positions, and so fails there:
    that shows the meta device detects host reads.
    """
    stub = KernelStub()
    monkeypatch.setattr(kv_module, "_compact_kv_kernel", stub)
    kv = torch.empty(3, 2, 4, 64, 128, dtype=torch.bfloat16, device="meta")
    src = torch.empty(20, dtype=torch.int64, device="meta")
    count = torch.empty(1, dtype=torch.int64, device="meta") if with_count else None
    with force_backend("triton"):
        assert dk.compact_kv_(kv, src, 4000 % 64, num_rows=count, check=False) is kv
        assert len(stub.launches) == 1
        grid, args, kwargs = stub.launches[0]
        assert grid == (3 * 2 * 4, 1) and kwargs["HAS_COUNT"] == with_count and kwargs["BLOCK_A"] == 16
        with pytest.raises((RuntimeError, NotImplementedError)):
            dk.compact_kv_(kv, src, 0, num_rows=count, check=True)


# ------------------------------------------------------------------ the barrier (compiled PTX)


def test_compiled_kernel_has_a_barrier_between_each_chunks_loads_and_stores():
    """Race freedom across warps, which the interpreter cannot show: inspect the real sm_90 PTX instead.

    Rows of one 16-row chunk live in different warps; with accepted nodes
    [0, 2, 3] row 1 reads the position row 2 writes. The kernel must execute a
    CTA barrier after the chunk's global loads and before its global stores.
    This test fails on the old kernel, whose PTX has no barrier at all.
    """
    from gpu_compile import compile_for_gpu, require_gpu_compiler
    from test_compile_gpu_kv_compaction import assert_loads_barrier_stores

    require_gpu_compiler()
    cfg = next(c for c in kv_module.launch_configs() if c["head_dim"] == 128 and c["signature"]["kv_ptr"] == "*bf16")
    res = compile_for_gpu(cfg["kernel"], cfg["signature"], cfg["constexprs"], 90, cfg["num_warps"],
                          cfg["num_stages"], divisible_by_16=cfg["divisible_by_16"])
    assert_loads_barrier_stores(res["ptx"], cfg["name"])


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
    with pytest.raises(ValueError, match="stride-0"):
        dk.compact_kv_(kv[:, :, :1].expand(-1, -1, 3, -1, -1), torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="1-D"):
        dk.compact_kv_(kv, torch.tensor([[1]]), 0)
    with pytest.raises(ValueError, match="int64 or int32"):
        dk.compact_kv_(kv, torch.tensor([1.0]), 0)
    with pytest.raises(ValueError, match="dst_start"):
        dk.compact_kv_(kv, torch.tensor([1]), -1)


@pytest.mark.parametrize("check", [True, False])
def test_bad_row_counts_are_rejected(check):
    kv = cache()
    src = torch.tensor([3, 5, 6])
    with pytest.raises(TypeError, match="num_rows must be None or an int64 tensor"):
        dk.compact_kv_(kv, src, 3, num_rows=2, check=check)
    with pytest.raises(ValueError, match=r"num_rows must have shape \[1\] or \[\]"):
        dk.compact_kv_(kv, src, 3, num_rows=torch.tensor([1, 2]), check=check)
    with pytest.raises(ValueError, match="num_rows must be int64 or int32"):
        dk.compact_kv_(kv, src, 3, num_rows=torch.tensor([1.0]), check=check)
    with pytest.raises(ValueError, match="num_rows must be on kv's device"):
        dk.compact_kv_(kv, src, 3, num_rows=torch.tensor([1], device="meta"), check=check)


def test_row_count_out_of_range_is_rejected_when_checking():
    kv = cache()
    with pytest.raises(ValueError, match=r"num_rows = 4 must be in \[0, A\] = \[0, 3\]"):
        dk.compact_kv_(kv, torch.tensor([3, 5, 6]), 3, num_rows=torch.tensor([4]))
    with pytest.raises(ValueError, match=r"num_rows = -1 must be in \[0, A\]"):
        dk.compact_kv_(kv, torch.tensor([3, 5, 6]), 3, num_rows=torch.tensor(-1))


def test_check_false_skips_the_value_checks_only():
    kv = cache()
    # metadata is still checked ...
    with pytest.raises(ValueError, match="int64 or int32"):
        dk.compact_kv_(kv, torch.tensor([1.0]), 0, check=False)
    with pytest.raises(ValueError, match="dst_start"):
        dk.compact_kv_(kv, torch.tensor([1]), -1, check=False)
    # ... values are trusted: a valid call gives the same result as with checks
    want = expected_by_hand(kv, [9, 11, 12], 8)
    assert torch.equal(dk.compact_kv_(kv, torch.tensor([9, 11, 12]), 8, check=False), want)


# --------------------------------------------------------------------------- layouts


def _overlapping_views(kv):
    """Self-overlapping layouts over ``kv``'s storage: two distinct indices address one element."""
    L, _, H, S, D = kv.shape
    row, head = D, S * D
    return {
        "rows share elements": (kv.shape, (2 * H * S * D, H * S * D, head, D // 2, 1)),
        "heads share rows": (kv.shape, (2 * H * S * D, H * S * D, head // 2, row, 1)),
        "key and value alias": (kv.shape, (2 * H * S * D, 0 + head, head, row, 1)),
        "layers alias k/v": ((L, 2, H, S // 2, D), (H * S * D, H * S * D, head, row, 1)),
        "head dim past the row": ((L, 2, H, S // 2, 2 * D), (2 * H * S * D, H * S * D, head, row, 1)),
    }


@pytest.mark.parametrize("name", list(_overlapping_views(cache())))
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("static", [False, True])
def test_self_overlapping_kv_is_refused(name, backend, static):
    """as_strided layouts where two indices share an element break the programs' disjoint slices: refused,
    naming the shape and strides, before anything is written."""
    base = cache()
    shape, strides = _overlapping_views(base)[name]
    kv = base.as_strided(shape, strides)
    before = base.clone()
    src = torch.tensor([3, 5, 6], device=DEVICE)
    dst = torch.tensor([3], device=DEVICE) if static else 3
    op = dk.compact_kv_
    with force_backend(backend):
        with pytest.raises(ValueError, match="overlaps itself") as err:
            op(kv, src, dst, check=False)
    assert f"shape {tuple(shape)}" in str(err.value) and f"strides {tuple(strides)}" in str(err.value)
    assert "contiguous" in str(err.value)
    assert torch.equal(base, before)


@pytest.mark.parametrize("name", list(_overlapping_views(cache())))
def test_self_overlap_is_found_from_metadata_alone(name):
    """The layout check reads no tensor value: a meta-device cache (no values) is refused the same way, and the
    reference functions refuse it too."""
    shape, strides = _overlapping_views(cache())[name]
    kv = torch.empty(3, 2, 2, 48, 24, device="meta").as_strided(shape, strides)
    src = torch.tensor([3, 5, 6], device="meta")
    with pytest.raises(ValueError, match="overlaps itself"):
        dk.compact_kv_(kv, src, 3, num_rows=torch.tensor([2], device="meta"), check=False)
    with pytest.raises(ValueError, match="overlaps itself"):
        ref.compact_kv_(kv, src, 3)
    with pytest.raises(ValueError, match="overlaps itself"):
        ref.compact_kv_(kv, src, torch.tensor([3], device="meta"))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_broadcast_kv_is_still_refused(backend):
    kv = cache()
    with force_backend(backend):
        with pytest.raises(ValueError, match="stride-0"):
            dk.compact_kv_(kv[:, :, :1].expand(-1, -1, 3, -1, -1), torch.tensor([1]), 0, check=False)
        with pytest.raises(ValueError, match="stride-0"):
            dk.compact_kv_(kv[:1].expand(4, -1, -1, -1, -1), torch.tensor([1]), 0, check=False)


def _legitimate_views():
    """Caches the package (or a caller) hands over: slices, steps and permutations of a contiguous buffer."""
    gen = torch.Generator().manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    return {
        "row prefix": rand(3, 2, 2, 48, 24)[:, :, :, :40],
        "layer slice": rand(5, 2, 2, 48, 24)[1:4],
        "every other head": rand(3, 2, 4, 48, 24)[:, :, ::2],
        "head-dim slice": rand(3, 2, 2, 48, 32)[..., 4:28],
        "heads outermost": rand(2, 3, 2, 48, 24).permute(1, 2, 0, 3, 4),
        "rows before heads": rand(3, 2, 48, 2, 24).permute(0, 1, 3, 2, 4),
        "one layer, one head": rand(1, 2, 1, 48, 24),
        "pooled slice of a bigger cache": rand(4, 3, 2, 2, 64, 24)[2, :, :, :, :48],
    }


@pytest.mark.parametrize("name", list(_legitimate_views()))
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("static", [False, True])
def test_legitimate_views_are_compacted_in_place(name, backend, static):
    view = _legitimate_views()[name]
    base = view._base if view._base is not None else view
    outside = base.clone()
    want = expected_by_hand(view, [9, 11, 12, 30], 8)
    src = torch.tensor([9, 11, 12, 30], device=DEVICE)
    dst = torch.tensor([8], device=DEVICE) if static else 8
    with force_backend(backend):
        out = dk.compact_kv_(view, src, dst, check=not static)
    assert out is view and torch.equal(view, want)
    mask = torch.ones_like(base, dtype=torch.bool)
    view_mask = mask.as_strided(view.shape, view.stride(), view.storage_offset())
    view_mask.fill_(False)
    assert torch.equal(base[mask], outside[mask])  # nothing outside the view moved


def test_package_caches_pass_the_layout_check():
    """The caches the package compacts: TargetKVCache, a HybridKVCache's attention slots, a pooled static view."""
    from dflash.target.cache import TargetKVCache
    from dflash.target.cache import TargetKVCache
    from tiny_models import tiny_target

    config = tiny_target("qwen3", layers=2, hidden=32).config
    caches = [TargetKVCache(config, 40, torch.float32, DEVICE).kv]
    pool = torch.zeros(3, *TargetKVCache.kv_shape(config, 40), device=DEVICE)
    caches.append(TargetKVCache(config, 40, torch.float32, DEVICE, kv=pool[1]).kv)
    for kv in caches:
        kv.normal_()
        want = expected_by_hand(kv, [5, 7, 8], 4)
        for backend in ("triton", "reference"):
            got = kv.clone()
            with force_backend(backend):
                dk.compact_kv_(got, torch.tensor([5, 7, 8]), 4)
            assert torch.equal(got, want)
        assert torch.equal(dk.compact_kv_(kv[:, :, :, :20], torch.tensor([5, 7, 8]), 4), want[:, :, :, :20])


def _offsets_distinct(shape, strides) -> bool:
    offsets = {sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*map(range, shape))}
    return len(offsets) == torch.Size(shape).numel()


def test_nested_strides_is_a_sound_overlap_test():
    """Whenever the check accepts a layout its offsets are distinct (brute force over small layouts), and it
    accepts every slice / step / permutation of a contiguous tensor (the layouts caches come in)."""
    from dflash_kernels.reference.kv_compaction import nested_strides

    rng = random.Random(0)
    accepted = 0
    for _ in range(3000):
        dims = rng.randint(1, 4)
        shape = [rng.randint(0, 4) for _ in range(dims)]
        strides = [rng.randint(0, 24) for _ in range(dims)]
        if nested_strides(shape, strides):
            accepted += 1
            assert _offsets_distinct(shape, strides), (shape, strides)
    assert accepted > 300
    for _ in range(500):
        dims = rng.randint(1, 5)
        full = [rng.randint(1, 5) for _ in range(dims)]
        t = torch.empty(full)
        for d in range(dims):  # slice and step every dim
            start = rng.randint(0, full[d] - 1)
            t = t.narrow(d, start, rng.randint(1, full[d] - start))
            t = t[(slice(None),) * d + (slice(None, None, rng.randint(1, 2)),)]
        t = t.permute(*rng.sample(range(dims), dims))
        assert nested_strides(t.shape, t.stride()), (t.shape, t.stride())
    # size-1 dims do not count, whatever their stride; an empty layout has nothing to overlap
    assert nested_strides((2, 1, 3), (3, 0, 1)) and nested_strides((0, 3), (0, 0))
    assert not nested_strides((2, 3), (2, 1))  # offsets 0..4: element 2 is reached twice


# --------------------------------------------------------------------------- kv_write_ (C++), one and a batch


def _write_by_hand(kv, layer, rows, key, value):
    """``kv[r, layer, 0, :, rows[r, t]] = key[r, :, t]`` (and value) by plain index assignment, row by row."""
    out = kv.clone()
    for r in range(rows.shape[0]):
        for t in range(rows.shape[1]):
            out[r, layer, 0, :, int(rows[r, t])] = key[r, :, t].to(kv.dtype)
            out[r, layer, 1, :, int(rows[r, t])] = value[r, :, t].to(kv.dtype)
    return out


def _write_case(b, layers=3, heads=2, smax=12, head_dim=8, t=4, dtype=torch.float32, key_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(b, layers, 2, heads, smax, head_dim, generator=gen).to(DEVICE, dtype)
    rows = torch.stack([torch.randperm(smax, generator=gen)[:t] for _ in range(b)]).to(DEVICE)
    key = torch.randn(b, heads, t, head_dim, generator=gen).to(DEVICE, key_dtype or dtype)
    value = torch.randn(b, heads, t, head_dim, generator=gen).to(DEVICE, key_dtype or dtype)
    return kv, rows, key, value


@pytest.mark.parametrize("b,heads,t,dtype,key_dtype", [
    (1, 1, 1, torch.float32, None), (2, 2, 4, torch.bfloat16, torch.float32), (3, 2, 7, torch.float16, None),
    (5, 1, 3, torch.float32, torch.float64),
])
def test_batched_kv_write_equals_index_assignment(b, heads, t, dtype, key_dtype):
    kv, rows, key, value = _write_case(b, heads=heads, t=t, dtype=dtype, key_dtype=key_dtype, seed=b)
    want = _write_by_hand(kv, 1, rows, key, value)
    assert dk.kv_write_(kv, 1, rows, key, value) is None
    assert torch.equal(kv, want)
    # int32 rows, strided key / value views: the same write
    kv2, rows2, key2, value2 = _write_case(b, heads=heads, t=t, dtype=dtype, key_dtype=key_dtype, seed=b)
    key_view = key2.transpose(2, 3).contiguous().transpose(2, 3)
    dk.kv_write_(kv2, 1, rows2.to(torch.int32), key_view, value2)
    assert torch.equal(kv2, want)


def test_batched_kv_write_with_one_row_equals_the_one_sequence_form():
    kv, rows, key, value = _write_case(1, t=5, dtype=torch.bfloat16, seed=7)
    one = kv[0].clone()
    dk.kv_write_(one, 2, rows[0], key[0], value[0])
    dk.kv_write_(kv, 2, rows, key, value)
    assert torch.equal(kv[0], one)


def test_batched_kv_write_is_two_indexed_writes_and_reads_nothing_on_the_host():
    """One index_put_ per key and per value whatever b (no loop over the rows), and no scalar read of rows."""
    from torch.profiler import ProfilerActivity, profile

    for b in (1, 5):
        kv, rows, key, value = _write_case(b, seed=b)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.ops.dflash.kv_write_(kv, 0, rows, key, value)
        names = [e.name for e in prof.events()]
        assert names.count("aten::index_put_") == 2, names
        assert not {"aten::item", "aten::_local_scalar_dense", "aten::nonzero"} & set(names), names


def test_batched_kv_write_opcheck():
    kv, rows, key, value = _write_case(3, seed=3)
    torch.library.opcheck(torch.ops.dflash.kv_write_, (kv, 1, rows, key, value))


def test_kv_write_errors_name_the_problem():
    op = torch.ops.dflash.kv_write_
    kv, rows, key, value = _write_case(3, layers=2, seed=1)
    cases = [
        ((kv[:, :, :1], 0, rows, key, value), r"kv must be \[L, 2, Hkv, S, D\] \(one sequence\) or "
                                              r"\[b, L, 2, Hkv, S, D\] \(a batch\)"),
        ((kv[None], 0, rows, key, value), r"kv must be \[L, 2, Hkv, S, D\]"),
        ((kv, 2, rows, key, value), r"layer 2 is outside \[0, L=2\)"),
        ((kv, -1, rows, key, value), r"layer -1 is outside"),
        ((kv, 0, rows[0], key, value), r"batched kv \[b=3, L, 2, Hkv, S, D\], rows must be a 2-D \[b=3, T\]"),
        ((kv, 0, rows[:2], key, value), r"rows must be a 2-D \[b=3, T\]"),
        ((kv, 0, rows.float(), key, value), r"int64/int32"),
        ((kv, 0, rows, key[:, :, :2], value), r"key/value must be \[b=3, Hkv=2, T=4, D=8\], got \[3, 2, 2, 8\]"),
        ((kv, 0, rows, key, value[0]), r"key/value must be \[b=3, Hkv=2, T=4, D=8\]"),
        ((kv[0], 0, rows, key[0], value[0]), r"one-sequence kv \[L, 2, Hkv, S, D\], rows must be a 1-D \[T\]"),
        ((kv[0], 0, rows[0], key, value[0]), r"key/value must be \[Hkv=2, T=4, D=8\]"),
    ]
    if DEVICE == "cuda":  # (a meta tensor would send the call to the fake instead)
        cases.append(((kv, 0, rows.cpu(), key, value), r"rows must be on kv's device"))
    for args, message in cases:
        before = kv.clone()
        with pytest.raises(RuntimeError, match=message):
            op(*args)
        assert torch.equal(kv, before), message


# --------------------------------------------------------------------------- batched compaction (one launch)


def batch_cache(b, layers=2, heads=2, smax=48, head_dim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, layers, 2, heads, smax, head_dim, generator=gen).to(DEVICE, dtype)


def batch_rows(b, a, smax, seed=0):
    """Per-row valid inputs: ``src [b, A]`` (strictly increasing, ``src[r, i] >= dst[r] + i``, ``< smax``) and
    ``dst [b]``; the rows' first sources overlap their destinations as an accepted tree path's do."""
    rng = random.Random(seed)
    src, dst = [], []
    for _ in range(b):
        d = rng.randint(0, smax - a)
        gaps = sorted(rng.randint(0, smax - d - a) for _ in range(a))  # nondecreasing: d + i + gap increases
        src.append([d + i + g for i, g in enumerate(gaps)])
        dst.append(d)
    return torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE)


def per_row_expected(kv, src, dst, counts):
    """Each row compacted by hand on its own: ``n(r) = clamp(counts[r], 0, A)`` rows move."""
    out = kv.clone()
    a = src.shape[1]
    for r in range(kv.shape[0]):
        n = a if counts is None else max(0, min(int(counts[r]), a))
        out[r] = expected_by_hand(kv[r], src[r, :n].tolist(), int(dst[r]))
    return out


def bits(t):
    """The raw bits (NaN payloads compare equal)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


BATCH_CASES = [  # (b, A, L, Hkv, D, dtype): every value of each dim appears; kept small for the interpreter
    (1, 1, 1, 1, 16, torch.float32),
    (1, 16, 3, 2, 64, torch.bfloat16),
    (2, 7, 3, 1, 128, torch.float16),
    (2, 16, 1, 2, 16, torch.float32),
    (3, 1, 3, 2, 64, torch.float16),
    (3, 7, 1, 1, 128, torch.bfloat16),
    (5, 16, 1, 1, 64, torch.float32),
    (5, 7, 3, 2, 16, torch.bfloat16),
    (3, 16, 1, 2, 128, torch.float16),
]


@pytest.mark.parametrize("b,a,layers,heads,head_dim,dtype", BATCH_CASES,
                         ids=[f"b{c[0]}-A{c[1]}-L{c[2]}-H{c[3]}-D{c[4]}-{str(c[5])[6:]}" for c in BATCH_CASES])
def test_batched_equals_per_row_single_calls(b, a, layers, heads, head_dim, dtype):
    """One batched call (Triton under the interpreter, and the reference) equals b single device-destination
    calls, one per row, bit for bit; counts 0, below A, A, above A (clamped) and negative."""
    smax = 40
    kv = batch_cache(b, layers, heads, smax, head_dim, dtype, seed=b * 100 + a)
    src, dst = batch_rows(b, a, smax, seed=a + b)
    counts = torch.tensor([(0, a, max(1, a // 2), a + 3, -2)[r % 5] for r in range(b)], device=DEVICE)
    want = per_row_expected(kv, src, dst, counts)
    single = kv.clone()
    for r in range(b):
        dk.compact_kv_(single[r], src[r], dst[r:r + 1], num_rows=counts[r:r + 1], check=False)
    assert torch.equal(bits(single), bits(want))
    for backend in ("triton", "reference"):
        got = kv.clone()
        with force_backend(backend):
            assert dk.compact_kv_(got, src, dst, num_rows=counts, check=False) is got
        assert torch.equal(bits(got), bits(want)), backend
    # every count valid: the checked path, and no count at all (A rows each)
    valid = counts.clamp(0, a)
    got = kv.clone()
    assert compact_kv_triton(got, src, dst, num_rows=valid, check=True) is got
    assert torch.equal(bits(got), bits(want))
    got, ref_got = kv.clone(), kv.clone()
    compact_kv_triton(got, src, dst, check=True)
    ref.compact_kv_(ref_got, src, dst)
    assert torch.equal(bits(got), bits(per_row_expected(kv, src, dst, None)))
    assert torch.equal(bits(ref_got), bits(got))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batched_with_one_row_is_the_single_form_bit_for_bit(dtype, backend):
    """b = 1: kv[None] compacted by the batched form equals kv compacted by the device-destination form, with
    NaN / inf in the cache (raw bits compared)."""
    kv = cache(layers=3, heads=2, smax=40, head_dim=24, dtype=dtype, seed=11)
    kv[0, 1, 0, 12] = float("nan")
    kv[2, 0, 1, 17] = float("-inf")
    src = torch.tensor([10, 12, 13, 17, 30, 31, 0, 0], device=DEVICE)
    for count in (6, 3, 0, 9):
        single, batched = kv.clone(), kv.clone()[None]
        with force_backend(backend):
            dk.compact_kv_(single, src, torch.tensor([10], device=DEVICE),
                           num_rows=torch.tensor([count], device=DEVICE), check=False)
            dk.compact_kv_(batched, src[None], torch.tensor([10], device=DEVICE),
                           num_rows=torch.tensor([count], device=DEVICE), check=False)
        assert torch.equal(bits(batched[0]), bits(single)), count


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batched_rows_past_the_count_are_never_read_or_written(backend):
    """Garbage sources past a row's count (out of range, negative, decreasing) and a finished row whose
    destination lies at or past the end of the cache: nothing outside the moved rows changes."""
    smax, a = 32, 6
    kv = batch_cache(3, smax=smax, seed=5)
    src = torch.tensor([[9, 11, 12, 10 ** 6, -5, 0], [40, -1, 7, 7, 7, 7], [28, 30, 31, 0, 0, 0]], device=DEVICE)
    dst = torch.tensor([8, smax, 28], device=DEVICE)  # row 1: a finished sequence at a full cache
    counts = torch.tensor([3, 0, 3], device=DEVICE)
    want = per_row_expected(kv, src, dst, counts)
    with force_backend(backend):
        dk.compact_kv_(kv, src, dst, num_rows=counts, check=False)
    assert torch.equal(kv, want)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batched_overlapping_paths_every_row(backend):
    """Each row an adversarial accepted path ([0, 2, 3, ...]: an earlier row's source is a later row's
    destination), crossing a 16-row chunk, with a different prefix per row."""
    prefixes, a = [3, 0, 11], 18
    kv = batch_cache(3, heads=1, smax=48, seed=9)
    nodes = [0] + list(range(2, a + 1))
    src = torch.tensor([path_positions(nodes, p) for p in prefixes], device=DEVICE)
    dst = torch.tensor(prefixes, device=DEVICE)
    counts = [a, 17, 5]
    want = per_row_expected(kv, src, dst, counts)
    with force_backend(backend):
        dk.compact_kv_(kv, src, dst, num_rows=torch.tensor(counts, device=DEVICE), check=True)
    assert torch.equal(kv, want)


def test_batched_int32_inputs_and_strided_counts():
    """int32 positions, destinations and counts; the [b] destinations and counts as strided slices of a state
    buffer (each at its own stride)."""
    kv = batch_cache(3, seed=4)
    src, dst = batch_rows(3, 5, 48, seed=4)
    state = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    state[:, 1] = dst.to(torch.int32)
    state[:, 3] = torch.tensor([5, 2, 0], dtype=torch.int32)
    want = per_row_expected(kv, src, dst, [5, 2, 0])
    with force_backend("triton"):
        dk.compact_kv_(kv, src.to(torch.int32), state[:, 1], num_rows=state[:, 3], check=True)
    assert torch.equal(kv, want)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batched_views_are_compacted_in_place(backend):
    """A slice of a pooled buffer and every other head: compacted in place, nothing outside the view moves."""
    gen = torch.Generator().manual_seed(3)
    for big, view in ((lambda t: (t, t[1:4]))(torch.randn(5, 2, 2, 2, 48, 16, generator=gen).to(DEVICE)),
                      (lambda t: (t, t[:, :, :, ::2]))(torch.randn(3, 2, 2, 4, 48, 16, generator=gen).to(DEVICE)),
                      (lambda t: (t, t.permute(1, 0, 2, 3, 4, 5)))(
                          torch.randn(2, 3, 2, 2, 48, 16, generator=gen).to(DEVICE))):
        before = big.clone()
        src, dst = batch_rows(3, 4, 48, seed=7)
        want = per_row_expected(view, src, dst, [4, 1, 3])
        with force_backend(backend):
            dk.compact_kv_(view, src, dst, num_rows=torch.tensor([4, 1, 3], device=DEVICE))
        assert torch.equal(view, want)
        mask = torch.ones_like(big, dtype=torch.bool)
        mask.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
        assert torch.equal(big[mask], before[mask])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batched_self_overlapping_kv_is_refused(backend):
    """Rows of the batch must be disjoint memory: a broadcast batch, or a batch stride inside one row's span,
    is refused before anything is written."""
    base = batch_cache(3)
    src, dst = batch_rows(3, 3, 48)
    before = base.clone()
    row = base[0].numel()
    overlapping = base.as_strided(base.shape, (row // 2,) + base.stride()[1:])
    with force_backend(backend):
        with pytest.raises(ValueError, match="stride-0"):
            dk.compact_kv_(base[:1].expand(3, -1, -1, -1, -1, -1), src, dst, check=False)
        with pytest.raises(ValueError, match="overlaps itself") as err:
            dk.compact_kv_(overlapping, src, dst, check=False)
    assert f"strides {overlapping.stride()}" in str(err.value)
    assert torch.equal(base, before)
    with pytest.raises(ValueError, match="overlaps itself"):
        ref.compact_kv_(overlapping, src, dst)


def test_batched_bad_arguments_are_rejected():
    kv = batch_cache(3)
    src, dst = batch_rows(3, 4, 48)
    counts = torch.tensor([1, 2, 3], device=DEVICE)
    cases = [
        (ValueError, (kv[:, :, :1], src, dst), {}, r"\[b, L, 2, Hkv, Smax, D\] \(a batch\)"),
        (ValueError, (kv, src, 3), {}, r"batched kv \[b, L, 2, Hkv, Smax, D\] takes dst_start as an int64/int32 "
                                       r"tensor \[b\] = \[3\]"),
        (ValueError, (kv, src[0], dst), {}, r"src_positions must be \[b, A\] = \[3, A\]"),
        (ValueError, (kv, src[:2], dst), {}, r"src_positions must be \[b, A\]"),
        (ValueError, (kv, src.float(), dst), {}, "src_positions must be int64 or int32"),
        (ValueError, (kv, src, dst[:1]), {}, r"dst_start must have shape \[b\] = \[3\]"),
        (ValueError, (kv, src, dst[:, None]), {}, r"dst_start must have shape \[b\]"),
        (ValueError, (kv, src, dst.float()), {}, "dst_start must be int64 or int32"),
        (ValueError, (kv, src, dst), {"num_rows": counts[:1]}, r"num_rows must have shape \[b\] = \[3\]"),
        (ValueError, (kv, src, dst), {"num_rows": counts.float()}, "num_rows must be int64 or int32"),
        (TypeError, (kv, src, dst), {"num_rows": 2}, r"num_rows must be None or an int64 tensor \[b\]"),
        (ValueError, (kv, src, dst), {"num_rows": counts.to("meta")}, "num_rows must be on kv's device"),
        (ValueError, (kv, src, dst.to("meta")), {}, "dst_start must be on kv's device"),
        (ValueError, (kv, src, kv.view(-1)[:6].view(torch.int64)), {}, "dst_start must not share storage"),
        (ValueError, (kv, kv.view(-1)[:24].view(torch.int64).view(3, 4), dst), {},
         "src_positions must not share storage"),
    ]
    if DEVICE == "cuda":
        cases.append((ValueError, (kv, src.cpu(), dst), {}, "src_positions must be on kv's device"))
    for backend in ("triton", "reference"):
        for check in (True, False):
            for error, args, kwargs, message in cases:
                before = kv.clone()
                with force_backend(backend), pytest.raises(error, match=message):
                    dk.compact_kv_(*args, check=check, **kwargs)
                assert torch.equal(kv, before), message


@pytest.mark.parametrize(
    "src,dst,counts,message",
    [
        ([[5, 6], [5, 5], [9, 9]], [5, 4, 9], [2, 2, 0], r"row 1: src_positions must be strictly increasing, "
                                                          r"got 5 then 5 at 1, 0"),
        ([[5, 6], [7, 8], [5, 9]], [5, 4, 6], [2, 2, 1], r"row 2: src_positions\[2, 0\] = 5 must be >= "
                                                          r"dst_start \+ 0 = 6"),
        ([[5, 6], [7, 8], [5, 9]], [5, 4, 4], [3, 2, 2], r"row 0: num_rows = 3 must be in \[0, A\] = \[0, 2\] "
                                                          r"\(A = src_positions.shape\[1\]\)"),
        ([[5, 6], [7, 8], [5, 9]], [5, 4, 4], [1, -1, 2], r"row 1: num_rows = -1 must be in \[0, A\]"),
        ([[5, 48], [7, 8], [5, 9]], [5, 4, 4], [2, 2, 2], r"row 0: src_positions\[0, 1\] = 48 is beyond the cache "
                                                           r"length Smax = 48"),
        ([[5, 6], [7, 8], [5, 9]], [5, -1, 4], [2, 2, 2], r"row 1: dst_start = -1 must be >= 0"),
    ],
)
def test_batched_bad_positions_are_rejected_row_by_row(src, dst, counts, message):
    kv = batch_cache(3)
    before = kv.clone()
    with pytest.raises(ValueError, match=message):
        dk.compact_kv_(kv, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE),
                       num_rows=torch.tensor(counts, device=DEVICE))
    assert torch.equal(kv, before)


def test_batched_check_validates_only_the_counted_rows():
    kv = batch_cache(2)
    src = torch.tensor([[5, 7, 8, 3], [20, 3, 3, 3]], device=DEVICE)  # past the counts: not increasing
    dst = torch.tensor([5, 19], device=DEVICE)
    want = per_row_expected(kv, src, dst, [3, 1])
    dk.compact_kv_(kv, src, dst, num_rows=torch.tensor([3, 1], device=DEVICE), check=True)
    assert torch.equal(kv, want)


@pytest.mark.parametrize("with_count", [False, True])
def test_batched_check_false_reads_no_tensor_value_on_the_host(monkeypatch, with_count):
    """Meta tensors (no values): check=False reaches the one launch; its grid covers every row's slices."""
    stub = KernelStub()
    monkeypatch.setattr(kv_module, "_compact_kv_batched_kernel", stub)
    kv = torch.empty(4, 3, 2, 8, 64, 128, dtype=torch.bfloat16, device="meta")
    src = torch.empty(4, 20, dtype=torch.int64, device="meta")
    dst = torch.empty(4, dtype=torch.int64, device="meta")
    count = torch.empty(4, dtype=torch.int64, device="meta") if with_count else None
    with force_backend("triton"):
        assert dk.compact_kv_(kv, src, dst, num_rows=count, check=False) is kv
        (grid, args, kwargs), = stub.launches
        assert grid == (4 * 3 * 2 * 8, 1) and kwargs["HAS_COUNT"] == with_count and kwargs["BLOCK_A"] == 16
        assert args[4] == 20  # A: the sources' row stride too
        with pytest.raises((RuntimeError, NotImplementedError)):
            dk.compact_kv_(kv, src, dst, num_rows=count, check=True)


def test_batched_kernel_does_not_specialize_on_the_row_count():
    kernel = kv_module._compact_kv_batched_kernel
    declared = getattr(kernel, "do_not_specialize", None)
    if declared is None:  # interpreter object
        declared = kernel.kwargs["do_not_specialize"]
    assert "n_rows" in {kernel.arg_names[n] if isinstance(n, int) else n for n in declared}
