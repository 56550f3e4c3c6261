"""Device-side lengths and seeds: the tensor forms of tree attention, sampling and compaction.

A compiled / CUDA-graph step may not change any Python value from round to round, so the committed length,
the first destination row of the compaction and the sampling seed are device tensors the kernels read from
memory. Held here, on both backends (the reference, and Triton under the CPU interpreter or on a GPU):

* ``tree_attention`` with ``prefix_len`` a tensor over the WHOLE cache views equals the int form over the
  sliced views, for chains, ancestor bits, windows (default and given positions), softcap, sinks, GQA, splits
  (including splits past the live keys), bf16 / fp32, with NaN and inf planted in the rows past the live
  length (they must not leak); the launch does not depend on the prefix value.
* ``compact_kv_`` with ``dst_start`` a tensor equals the int form; rows past ``num_rows`` are untouched even
  when their sources are garbage and their destinations lie past the cache.
* The counter-based noise: Philox-4x32-10 in int64 tensor ops equals an independent Python-int Philox (and the
  Random123 known answer), the Triton noise kernel equals it; ``lm_head_sample(seed=<tensor>)`` and
  ``lm_head_sample(seed=<tensor>)`` with filters are reproducible per seed value, differ across values, agree
  across backends, and draw from softmax(z / T) / the processed distribution (chi-square).
* The references compile with ``torch.compile(fullgraph=True)`` into one graph (``CompileCounter``), and the
  compiled function replays with a new prefix / seed / destination value without recompiling.
* Nothing is read on the host: the Triton launchers get to their launches on meta tensors.
"""

import functools
import importlib
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import dflash_kernels as dk
from dflash_kernels import available_backends, force_backend
from dflash_kernels import kv_compaction as kv_module
from dflash_kernels import lm_head as lm_module
from dflash_kernels import reference as ref
from dflash_kernels.noise import gumbel_noise_block
from dflash_kernels.reference.lm_head import HeadInputs
from dflash_kernels.reference.sampling import model_logits, processed_probs
from kernel_stub import KernelStub

# (``dflash_kernels.tree_attention`` is the function: the package re-exports it over the module's name)
ta_module = importlib.import_module("dflash_kernels.tree_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = available_backends(torch.device(DEVICE))
OPS = torch.ops.dflash


def _t(x):
    return torch.tensor(x, device=DEVICE)


# ---------------------------------------------------------------------------------------------- tree attention

ATT_TOL = {torch.float32: dict(atol=2e-6, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _attention_case(t=5, prefix=11, smax=40, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0, poison=True):
    """q [Hq, T, D], a cache [2, Hkv, Smax, D] with the pass rows at [prefix, prefix + T), garbage after."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, t, d, generator=g)
    cache = torch.randn(2, hkv, smax, d, generator=g)
    if poison:  # rows past the live length: NaN, +inf, -inf, and huge values
        tail = cache[:, :, prefix + t:]
        tail[..., 0::4] = float("nan")
        tail[..., 1::4] = float("inf")
        tail[..., 2::4] = float("-inf")
        tail[..., 3::4] = 1e30
    return q.to(dtype).to(DEVICE), cache.to(dtype).to(DEVICE)


def _tree_bits(t):
    parents = torch.tensor([-1] + [max(0, (i - 1) // 2) for i in range(1, t)])
    return dk.ancestor_bits(parents).to(DEVICE)


ATT_VARIANTS = {
    "chain": dict(bits=False),
    "tree": dict(bits=True),
    "tree_window": dict(bits=True, window=6),
    "chain_window_default_positions": dict(bits=False, window=4),
    "tree_window_positions_softcap_sinks": dict(bits=True, window=5, positions=True, softcap=2.0, sinks=True),
    "chain_sinks": dict(bits=False, sinks=True),
}


def _attention_kwargs(variant, q, t, prefix):
    spec = ATT_VARIANTS[variant]
    kw = {}
    if spec.get("window"):
        kw["window"] = spec["window"]
    if spec.get("positions"):  # tree positions: prefix + depth
        depth = torch.tensor([0] + [int(math.log2(i + 1)) for i in range(1, t)])
        kw["positions"] = (prefix + depth).to(DEVICE)
    if spec.get("softcap"):
        kw["softcap"] = spec["softcap"]
    if spec.get("sinks"):
        kw["sinks"] = torch.linspace(-1.0, 2.0, q.shape[0]).to(DEVICE)
    return (_tree_bits(t) if spec["bits"] else None), kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(ATT_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_static_attention_equals_the_int_form(variant, dtype, backend):
    t, prefix, smax = 7, 37, 80
    q, cache = _attention_case(t=t, prefix=prefix, smax=smax, dtype=dtype)
    bits, kw = _attention_kwargs(variant, q, t, prefix)
    live_k, live_v = cache[0, :, :prefix + t], cache[1, :, :prefix + t]
    want = ref.tree_attention(q, live_k, live_v, bits, prefix, **kw)
    with force_backend(backend):
        got = dk.tree_attention(q, cache[0], cache[1], bits, _t([prefix]), **kw)
        got_static = dk.tree_attention(q[None], cache[0][None], cache[1][None], bits, _t(prefix), **kw)
    assert got.shape == q.shape and got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **ATT_TOL[dtype])
    torch.testing.assert_close(got_static[0].float(), want.float(), **ATT_TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("prefix", [0, 1, 37, 73])
def test_triton_static_attention_every_split_and_prefix(prefix, num_splits):
    """Splits are cut from the live length read in-kernel; splits past it write neutral partials."""
    if "triton" not in BACKENDS:
        pytest.skip("no Triton backend here")
    t, smax = 7, 80  # prefix 73 fills the cache exactly
    q, cache = _attention_case(t=t, prefix=prefix, smax=smax, seed=prefix)
    bits = _tree_bits(t)
    sinks = torch.linspace(-1.0, 1.0, q.shape[0]).to(DEVICE)
    for b, kw in ((bits, {}), (None, dict(window=9)), (bits, dict(sinks=sinks, softcap=3.0))):
        want = ref.tree_attention(q, cache[0, :, :prefix + t], cache[1, :, :prefix + t], b, prefix, **kw)
        got = ta_module.tree_attention_triton(q, cache[0], cache[1], b, _t([prefix]), num_splits=num_splits, **kw)
        torch.testing.assert_close(got, want, **ATT_TOL[torch.float32])


@pytest.mark.parametrize("group", [1, 4])
def test_static_attention_gqa_and_strided_cache_views(group):
    """K/V as strided views of a [L, 2, Hkv, Smax, D] buffer (nothing copied), MHA and GQA."""
    g = torch.Generator().manual_seed(3)
    hkv, t, d, prefix, smax = 2, 6, 8, 20, 33
    buf = torch.randn(3, 2, hkv, smax, d, generator=g).to(DEVICE)
    buf[:, :, :, prefix + t:] = float("nan")
    q = torch.randn(hkv * group, t, d, generator=g).to(DEVICE)
    k, v = buf[1, 0], buf[1, 1]
    want = ref.tree_attention(q, k[:, :prefix + t], v[:, :prefix + t], None, prefix)
    for backend in BACKENDS:
        with force_backend(backend):
            got = dk.tree_attention(q, k, v, None, _t([prefix]))
        torch.testing.assert_close(got, want, **ATT_TOL[torch.float32])


def test_reference_static_attention_masks_before_use():
    """The reference zeroes the dead rows before the matmul: not even NaN * 0 reaches the softmax."""
    q, cache = _attention_case(t=4, prefix=3, smax=12)
    out = ref.tree_attention(q, cache[0], cache[1], _tree_bits(4), _t([3]), softcap=1.5,
                                    sinks=torch.zeros(q.shape[0], device=DEVICE))
    assert torch.isfinite(out).all()
    vis = ref.tree_visibility(_tree_bits(4), _t([3]), 4, n_keys=12)
    assert vis.shape == (4, 12) and not vis[:, 7:].any() and vis[:, :3].all()
    torch.testing.assert_close(vis[:, :7], ref.tree_visibility(_tree_bits(4), 3, 4))


@pytest.mark.parametrize("t,smax", [(1, 1), (1, 9), (5, 12), (33, 70)])
def test_chain_visibility_is_the_rule_of_a_chains_own_bits(t, smax):
    """The one-compare chain visibility (bits None, no window) equals the general rule given a chain's
    ancestor bits (parent of node i is i - 1), for shared and per-row device prefixes, every prefix up to the
    last that fits."""
    chain = dk.ancestor_bits(torch.arange(-1, t - 1)).to(DEVICE)
    for prefix in range(smax - t + 1):
        got = ref.tree_visibility(None, _t([prefix]), t, n_keys=smax)
        assert got.shape == (t, smax)
        assert torch.equal(got, ref.tree_visibility(chain, _t([prefix]), t, n_keys=smax))
    prefixes = _t([0, smax - t, (smax - t) // 2])
    got = ref.tree_visibility(None, prefixes, t, n_keys=smax)
    want = ref.tree_visibility(chain.expand(3, *chain.shape), prefixes, t, n_keys=smax)
    assert got.shape == (3, t, smax) and torch.equal(got, want)


def test_triton_static_attention_launch_does_not_depend_on_the_prefix(monkeypatch):
    """Grid, split count and every argument but the prefix tensor are the same for any prefix value; nothing is
    read on the host (meta tensors: any read raises)."""
    stub = KernelStub()
    monkeypatch.setattr(ta_module, "_tree_attention_kernel", stub)
    monkeypatch.setattr(ta_module, "_merge_splits_kernel", KernelStub())
    q = torch.empty(8, 9, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 4096, 64, dtype=torch.bfloat16, device="meta")
    bits = torch.empty(9, 1, dtype=torch.int32, device="meta")
    with force_backend("triton"):
        for _ in range(2):
            dk.tree_attention(q, k, k, bits, torch.empty(1, dtype=torch.int64, device="meta"), window=100)
    (grid_a, args_a, kw_a), (grid_b, args_b, kw_b) = stub.launches
    assert grid_a == grid_b and kw_a == kw_b and kw_a["PREFIX_IN_MEMORY"]
    same = lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x  # noqa: E731
    assert [same(a) for a in args_a] == [same(b) for b in args_b]
    assert args_a[6].shape == (1,) and args_a[6].dtype == torch.int64  # prefix_ptr: the tensor itself
    assert 0 in [a for a in args_a if isinstance(a, int) and not isinstance(a, bool)]  # the unused int prefix


def test_static_attention_errors():
    q, cache = _attention_case(t=5, prefix=3, smax=12, poison=False)
    with pytest.raises(ValueError, match="int64"):
        dk.tree_attention(q, cache[0], cache[1], None, torch.tensor([3.0], device=DEVICE))
    with pytest.raises(ValueError, match=r"shape \[1\] or \[\]"):
        dk.tree_attention(q, cache[0], cache[1], None, _t([3, 4]))
    with pytest.raises(ValueError, match="S_max >= T"):
        dk.tree_attention(q, cache[0, :, :4], cache[1, :, :4], None, _t([0]))
    with pytest.raises(ValueError, match="prefix_len \\+ T"):  # the int form keeps its exact-length rule
        dk.tree_attention(q, cache[0], cache[1], None, 3)
    if DEVICE == "cpu":
        return
    with pytest.raises(ValueError, match="prefix_len is on"):
        dk.tree_attention(q, cache[0], cache[1], None, torch.tensor([3]))


def test_reference_static_attention_compiles_without_graph_breaks_and_replays_any_prefix():
    t, smax = 5, 30
    q, cache = _attention_case(t=t, prefix=9, smax=smax, poison=False)
    bits = _tree_bits(t)
    counter = CompileCounter()

    def step(q, k, v, bits, prefix):
        return ref.tree_attention(q, k, v, bits, prefix, window=7, softcap=2.5)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    prefix = _t([9])
    for p in (9, 0, 25, 14):
        prefix.fill_(p)  # the same tensor, a new value: the compiled step must follow it
        got = compiled(q, cache[0], cache[1], bits, prefix)
        want = ref.tree_attention(q, cache[0, :, :p + t], cache[1, :, :p + t], bits, p, window=7, softcap=2.5)
        torch.testing.assert_close(got, want, **ATT_TOL[torch.float32])
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------------------- compaction

COMPACT_CASES = [  # (src, dst, num_rows or None): overlapping ranges, a chunk boundary, garbage tails
    ([3, 5, 6], 3, None),
    ([7, 8, 9, 35], 5, 3),
    (list(range(20, 38)), 19, 17),
    ([39, 999, -5], 39, 1),  # the moved row is the cache's last; the unmoved tail is out of range
    ([12, 13], 10, 0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", COMPACT_CASES, ids=[f"case{i}" for i in range(len(COMPACT_CASES))])
def test_static_compaction_equals_the_int_form(case, backend):
    src, dst, n = case
    kv = torch.randn(2, 2, 3, 40, 5, generator=torch.Generator().manual_seed(len(src))).to(DEVICE)
    moved = src if n is None else src[:n]
    want = kv.clone()
    if moved:
        ref.compact_kv_(want, torch.tensor(moved), dst)
    got = kv.clone()
    num_rows = None if n is None else _t([n])
    with force_backend(backend):
        assert dk.compact_kv_(got, _t(src), _t([dst]), num_rows=num_rows, check=False) is got
        again = kv.clone()
        dk.compact_kv_(again, _t(src), _t(dst), num_rows=num_rows, check=False)
    assert torch.equal(got, want) and torch.equal(again, want)
    outside = torch.ones(kv.shape[3], dtype=torch.bool)
    outside[dst:dst + len(moved)] = False  # every row but the destinations keeps its value
    assert torch.equal(got[:, :, :, outside.to(DEVICE)], kv[:, :, :, outside.to(DEVICE)])


def test_static_compaction_check_reads_and_validates():
    kv = torch.randn(1, 2, 1, 10, 4).to(DEVICE)
    with pytest.raises(ValueError, match="must be >= dst_start"):
        dk.compact_kv_(kv, _t([3, 4]), _t([4]), check=True)
    with pytest.raises(ValueError, match="int64"):
        dk.compact_kv_(kv, _t([3]), torch.tensor([3.0], device=DEVICE), check=False)
    with pytest.raises(ValueError, match=r"shape \[1\] or \[\]"):
        dk.compact_kv_(kv, _t([3]), _t([3, 3]), check=False)
    with pytest.raises(ValueError, match="share storage"):  # an int64 view of kv's own bytes
        dk.compact_kv_(kv, _t([3]), kv.view(-1)[:2].view(torch.int64), check=False)


def test_triton_static_compaction_reads_nothing_on_the_host(monkeypatch):
    stub = KernelStub()
    monkeypatch.setattr(kv_module, "_compact_kv_kernel", stub)
    kv = torch.empty(3, 2, 4, 64, 128, dtype=torch.bfloat16, device="meta")
    src = torch.empty(20, dtype=torch.int64, device="meta")
    meta1 = lambda: torch.empty(1, dtype=torch.int64, device="meta")  # noqa: E731
    with force_backend("triton"):
        assert dk.compact_kv_(kv, src, meta1(), num_rows=meta1(), check=False) is kv
    (grid, args, kwargs), = stub.launches
    assert kwargs["DST_IN_MEMORY"] and kwargs["HAS_COUNT"] and args[5] == 0  # the int dst_start is unused


def test_reference_static_compaction_compiles_and_replays_any_destination():
    counter = CompileCounter()
    compiled = torch.compile(lambda kv, s, d, n: ref.compact_kv_(kv, s, d, num_rows=n), backend=counter,
                             fullgraph=True)
    base = torch.randn(2, 2, 2, 30, 4, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    dst, count = _t([0]), _t([0])
    for d, rows, n in ((4, [6, 8, 9, 29], 3), (10, [10, 12, 20, 21], 4), (27, [28, 29, 0, 0], 2)):
        dst.fill_(d)
        count.fill_(n)
        got, want = base.clone(), base.clone()
        compiled(got, _t(rows), dst, count)
        ref.compact_kv_(want, torch.tensor(rows[:n]), d)
        assert torch.equal(got, want)
    assert counter.frame_count == 1


def test_reference_batched_compaction_compiles_and_replays_any_destinations_and_counts():
    """The batched reference (kv [b, L, 2, Hkv, Smax, D], per-row [b] destinations and counts) traces into
    one graph with no host read, and replays new per-row values (a finished row's count 0, a count above A,
    a destination at the end of the cache) without recompiling."""
    counter = CompileCounter()
    compiled = torch.compile(lambda kv, s, d, n: ref.compact_kv_(kv, s, d, num_rows=n), backend=counter,
                             fullgraph=True)
    base = torch.randn(3, 2, 2, 2, 30, 4, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    dst, count = _t([0, 0, 0]), _t([0, 0, 0])
    rounds = [  # per row: (destination, sources [A = 4], count)
        [(4, [6, 8, 9, 29], 3), (0, [0, 1, 2, 3], 4), (27, [28, 29, 0, 0], 2)],
        [(10, [10, 12, 20, 21], 9), (30, [0, 0, 0, 0], 0), (2, [5, 6, 7, 8], -1)],
    ]
    for rows in rounds:
        dst.copy_(_t([d for d, _, _ in rows]))
        count.copy_(_t([n for _, _, n in rows]))
        got, want = base.clone(), base.clone()
        compiled(got, _t([s for _, s, _ in rows]), dst, count)
        for r, (d, s, n) in enumerate(rows):
            n = max(0, min(n, 4))
            if n:
                ref.compact_kv_(want[r], torch.tensor(s[:n]), d)
        assert torch.equal(got, want)
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------------------- noise

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def _philox_python(c, k):
    """Philox-4x32-10 with Python ints (Salmon et al. 2011): an independent implementation to check against."""
    c0, c1, c2, c3 = c
    k0, k1 = k
    for _ in range(10):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & 0xFFFFFFFF, p1 & 0xFFFFFFFF, ((p0 >> 32) ^ c3 ^ k1) & 0xFFFFFFFF, \
            p0 & 0xFFFFFFFF
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return c0, c1, c2, c3


def test_philox_words_equal_an_independent_implementation():
    assert _philox_python((0, 0, 0, 0), (0, 0))[0] == 0x6627E8D5  # Random123's known answer (first word)
    assert int(ref.philox_uint32(torch.tensor(0), torch.tensor([0]), torch.tensor([0]))) == 0x6627E8D5
    g = torch.Generator().manual_seed(0)
    for seed in (1, -1, 2 ** 62 + 12345, -(2 ** 63), 0x0123456789ABCDEF):
        rows = torch.randint(0, 2 ** 31, (5,), generator=g)
        rows[0] = 2 ** 32 - 1
        cols = torch.randint(0, 2 ** 31, (7,), generator=g)
        got = ref.philox_uint32(torch.tensor([seed]), rows, cols)
        u = seed & 0xFFFFFFFFFFFFFFFF
        for i, r in enumerate(rows.tolist()):
            for j, c in enumerate(cols.tolist()):
                assert int(got[i, j]) == _philox_python((c, r, 0, 0), (u & 0xFFFFFFFF, u >> 32))[0]


def test_cpu_philox_op_equals_the_tensor_reference():
    """The C++ op the CPU samplers call (csrc/philox.cpp) gives the reference's words bit for bit, including
    the first-word known answer, keys with the high bit set and counters at 2**32 - 1; its fake traces."""
    op = torch.ops.dflash.philox_uint32
    assert int(op(torch.tensor(0), torch.tensor([0]), torch.tensor([0]))) == 0x6627E8D5
    g = torch.Generator().manual_seed(1)
    for seed in (0, 1, -1, 2 ** 62 + 12345, -(2 ** 63), 0x0123456789ABCDEF):
        rows = torch.randint(0, 2 ** 32, (6,), generator=g)
        rows[0] = 2 ** 32 - 1
        cols = torch.randint(0, 2 ** 32, (301,), generator=g)
        cols[-1] = 2 ** 32 - 1
        assert torch.equal(op(torch.tensor([seed]), rows, cols), ref.philox_uint32(torch.tensor([seed]), rows, cols))
    torch.library.opcheck(op, (torch.tensor([3]), torch.arange(4), torch.arange(9)))
    assert torch.equal(ref.philox_words(torch.tensor([9]), torch.arange(3), torch.arange(5)),
                       ref.philox_uint32(torch.tensor([9]), torch.arange(3), torch.arange(5)))


def test_gumbel_noise_is_standard_gumbel_and_precise_in_the_tail():
    seed = torch.tensor([7])
    g = ref.gumbel_noise(seed, torch.arange(64), torch.arange(4096)).double()
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi ** 2 / 6) < 0.03
    # e -> E is exact in the small-e branch: E = -log(1 - e) to float precision
    e = ref.uniform_noise(seed, torch.arange(64), torch.arange(4096)).double()
    assert e.min() > 0 and e.max() <= 1
    expo = torch.exp(-g)
    torch.testing.assert_close(expo, -torch.log1p(-e), rtol=3e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_noise_kernel_equals_the_reference(backend):
    seed = _t([0x5EED])
    want = ref.gumbel_noise(seed, torch.arange(3, 20, device=DEVICE), torch.arange(100, 1300, device=DEVICE))
    with force_backend(backend):
        got = gumbel_noise_block(seed, 3, 17, 100, 1200)
    assert got.shape == (17, 1200) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)  # the integer words are equal; logs to an ulp


# ---------------------------------------------------------------------------------------------- sampling

def _lm_case(V=40, H=16, T=6, dtype=torch.float32, seed=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).to(DEVICE)
    norm = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    return hidden, weight, norm


def chi_square_pvalue(samples, probs):
    """Pearson chi-square p-value (cells with expectation < 5 pooled), via the regularized gamma function."""
    n = samples.numel()
    counts = torch.bincount(samples.cpu(), minlength=probs.numel()).double()
    expected = probs.double().cpu() * n
    assert counts[expected == 0].sum() == 0, "a sample outside the support"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,softcap", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 1.5)],
                         ids=["fp32", "bf16", "bf16-softcap"])
def test_seeded_sample_backends_agree_and_are_reproducible(dtype, softcap, backend):
    hidden, weight, norm = _lm_case(V=300, dtype=dtype)
    positions = _t([5, 0, 0, 3, 1, 4, 2, 2])
    kw = dict(norm_weight=norm, positions=positions, softcap=softcap)
    seed = _t([424242])
    want = ref.lm_head_sample(hidden, weight, 0.9, check_bounds=False, seed=seed, **kw)
    with force_backend(backend):
        a = dk.lm_head_sample(hidden, weight, 0.9, seed=seed, **kw)
        b = dk.lm_head_sample(hidden, weight, 0.9, check_bounds=False, seed=_t(424242), **kw)  # a 0-d seed: the same value
        c = dk.lm_head_sample(hidden, weight, 0.9, seed=_t([424243]), **kw)
    assert a.dtype == torch.int64 and a.shape == (8,)
    assert torch.equal(a, want) and torch.equal(b, want)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sample_draws_from_softmax(backend):
    """Chi-square of 3000 draws of one row (repeated by positions: each output row has its own noise)."""
    hidden, weight, norm = _lm_case(V=24, dtype=torch.bfloat16)
    T = 0.8
    n = 3000 if backend == "reference" or DEVICE == "cuda" else 1500
    positions = torch.full((n,), 2, dtype=torch.int64, device=DEVICE)
    logits = ref.lm_head_logits(hidden, weight, norm_weight=norm, positions=positions[:1], logit_dtype=None)
    probs = torch.softmax(logits.float()[0] / T, dim=-1)
    with force_backend(backend):
        samples = dk.lm_head_sample(hidden, weight, T, norm_weight=norm, positions=positions, seed=_t([5]))
    assert chi_square_pvalue(samples, probs) > 1e-3
    # ... and the test can tell a wrong temperature apart
    assert chi_square_pvalue(samples, torch.softmax(logits.float()[0] / (1.6 * T), dim=-1)) < 1e-3


def test_chi_square_pvalues_are_uniform_across_seeds():
    """One fixed seed is one draw of the test; over 80 seeds its p-values must look uniform (no bias hides
    behind a lucky seed): about 5% below 0.05, mean about 1/2."""
    hidden, weight, norm = _lm_case(V=24, dtype=torch.bfloat16)
    positions = torch.full((800,), 2, dtype=torch.int64, device=DEVICE)
    logits = ref.lm_head_logits(hidden, weight, norm_weight=norm, positions=positions[:1], logit_dtype=None)
    probs = torch.softmax(logits.float()[0] / 0.8, dim=-1)
    pvalues = torch.tensor([chi_square_pvalue(ref.lm_head_sample(hidden, weight, 0.8, check_bounds=False, seed=_t([s]), norm_weight=norm,
                                                                        positions=positions), probs)
                            for s in range(80)])
    assert (pvalues < 0.05).float().mean() <= 0.15 and 0.35 < pvalues.mean() < 0.65


def test_seeded_sample_over_many_seeds_draws_from_softmax():
    """The seed axis: one row, one draw per seed value 0..1999 (the reference, compiled once)."""
    hidden, weight, norm = _lm_case(V=12)
    logits = ref.lm_head_logits(hidden, weight, norm_weight=norm, positions=_t([1]))
    probs = torch.softmax(logits[0] / 1.3, dim=-1)
    seeds = torch.arange(2000, device=DEVICE)
    draws = torch.stack([ref.lm_head_sample(hidden, weight, 1.3, check_bounds=False, seed=seeds[i:i + 1], norm_weight=norm,
                                                   positions=_t([1]))[0] for i in range(2000)])
    assert chi_square_pvalue(draws, probs) > 1e-3


PROCESSED = [(0.7, 5, None, None), (1.0, None, 0.8, None), (1.3, 10, 0.9, 0.05), (1.0, None, None, 0.1)]
# (setting, backend): every setting on the reference; under the interpreter two on Triton (the histogram path
# is slow there), every one on a GPU
PROCESSED_CASES = [(s, b) for b in BACKENDS for i, s in enumerate(PROCESSED)
                   if b == "reference" or DEVICE == "cuda" or i in (1, 2)]


@pytest.mark.parametrize("setting,backend", PROCESSED_CASES,
                         ids=[f"T{a}-k{b}-p{c}-m{d}-{be}" for (a, b, c, d), be in PROCESSED_CASES])
def test_seeded_processed_sample_draws_from_the_processed_distribution(setting, backend):
    T, k, p, m = setting
    hidden, weight, norm = _lm_case(V=40, dtype=torch.bfloat16)
    n = 1500 if backend == "reference" or DEVICE == "cuda" else 600
    positions = torch.full((n,), 1, dtype=torch.int64, device=DEVICE)
    logits = model_logits(HeadInputs(hidden, weight, norm, 1e-6, positions[:1], None), torch.bfloat16)
    expected = processed_probs(logits, T, k, p, m)[0]
    with force_backend(backend):
        samples = dk.lm_head_sample(hidden, weight, T, top_k=k, top_p=p, min_p=m, norm_weight=norm,
                                              positions=positions, seed=_t([77]), check_bounds=False)
    assert chi_square_pvalue(samples, expected) > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_seeded_processed_sample_backends_agree_and_chunks_do_not_matter(dtype, backend):
    hidden, weight, norm = _lm_case(V=700, dtype=dtype)
    positions = _t([3, 1, 5, 0, 5, 5, 2])
    kw = dict(top_k=50, top_p=0.9, min_p=0.01, norm_weight=norm, positions=positions)
    want = ref.lm_head_sample_processed(hidden, weight, 0.8, check_bounds=False, seed=_t([9]), **kw)
    with force_backend(backend):
        a = dk.lm_head_sample(hidden, weight, 0.8, seed=_t([9]), **kw)
        b = dk.lm_head_sample(hidden, weight, 0.8, check_bounds=False, seed=_t([9]), chunk_elements=3 * 256, **kw)
        c = dk.lm_head_sample(hidden, weight, 0.8, check_bounds=False, seed=_t([10]), **kw)
    assert torch.equal(a, want) and torch.equal(b, want) and not torch.equal(a, c)


def test_seed_tensor_errors():
    hidden, weight, _ = _lm_case()
    # no filter: the fused route; min_p=0 (a filter that keeps every token): the processed route
    for fn in (dk.lm_head_sample, functools.partial(dk.lm_head_sample, min_p=0.0)):
        with pytest.raises(TypeError, match="int64"):
            fn(hidden, weight, 1.0, seed=torch.tensor([1.0], device=DEVICE))
        with pytest.raises(ValueError, match=r"shape \[1\] or \[\]"):
            fn(hidden, weight, 1.0, seed=_t([1, 2]))
        with pytest.raises(ValueError, match="not both"):
            fn(hidden, weight, 1.0, seed=_t([1]), generator=torch.Generator(device=DEVICE))


def test_triton_seeded_sample_reads_nothing_on_the_host(monkeypatch):
    norm_stub, argmax_stub = KernelStub(), KernelStub()
    monkeypatch.setattr(lm_module, "_norm_rows_kernel", norm_stub)
    monkeypatch.setattr(lm_module, "_argmax_kernel", argmax_stub)
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    hidden, weight, norm = meta(40, 256), meta(1000, 256), meta(256)
    positions, seed = meta(9, dtype=torch.int64), meta(1, dtype=torch.int64)
    with force_backend("triton"):
        ids = dk.lm_head_sample(hidden, weight, 0.7, check_bounds=False, seed=seed, norm_weight=norm, positions=positions)
    assert ids.shape == (9,) and ids.dtype == torch.int64
    (grid, args, kwargs), = argmax_stub.launches
    assert kwargs["GUMBEL"] and kwargs["DEVICE_SEED"]
    assert args[-1].shape == (1,) and args[-1].dtype == torch.int64  # seed_ptr: the seed tensor, never read here


def test_reference_samplers_compile_without_graph_breaks_and_replay_new_noise():
    hidden, weight, norm = _lm_case(V=64, T=4)
    positions = _t([0, 1, 2, 3, 3, 3])
    counter = CompileCounter()

    def step(hidden, weight, seed):
        plain = ref.lm_head_sample(hidden, weight, 0.9, check_bounds=False, seed=seed, norm_weight=norm, positions=positions)
        processed = ref.lm_head_sample_processed(hidden, weight, 0.9, check_bounds=False, seed=seed, top_k=20, top_p=0.95,
                                                        min_p=0.02, norm_weight=norm, positions=positions)
        return plain, processed

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    seed = _t([100])
    seen = set()
    for value in range(100, 106):
        seed.fill_(value)  # the caller bumps the seed tensor; the compiled step draws new noise
        got = compiled(hidden, weight, seed)
        want = step(hidden, weight, _t([value]))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        seen.add(tuple(got[0].tolist()))
    assert counter.frame_count == 1 and len(seen) > 1


# ---------------------------------------------------------------------------------------------- custom ops

@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_overloads_compile_into_one_graph(backend):
    """The four tensor overloads in one fullgraph compile (aot_eager: fakes and the kv mutation functionalized)."""
    q, cache = _attention_case(t=5, prefix=6, smax=20, poison=False)
    bits = _tree_bits(5)
    hidden, weight, norm = _lm_case(V=50)
    kv = torch.randn(2, 2, 2, 20, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def step(q, k, v, prefix, seed, kv, rows, count):
        att = OPS.tree_attention.tensor(q, k, v, bits, prefix, None, None, None, None, None)
        tok = OPS.lm_head_sample.tensor(hidden, weight, 0.7, seed, norm, None, 1e-6, None, None)
        pro = OPS.lm_head_sample_processed(hidden, weight, 0.7, 5, 0.9, None, seed, norm, None, 1e-6, None, None)
        OPS.compact_kv_.tensor(kv, rows + prefix, prefix, count)
        return att.sum(), tok, pro

    args = (q, cache[0], cache[1], _t([6]), _t([1]), kv, _t([0, 2, 3]), _t([2]))
    with force_backend(backend):
        eager_kv = kv.clone()
        want = step(*args[:5], eager_kv, *args[6:])
        torch._dynamo.reset()
        counters.clear()
        got_kv = kv.clone()
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args[:5], got_kv, *args[6:])
        assert sum(counters["graph_break"].values()) == 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert torch.equal(got_kv, eager_kv)
