"""The KV compaction kernel compiles for sm_90 and sm_80 at real cache shapes, race free by construction.

``dflash_kernels.kv_compaction.launch_configs`` enumerates every binary the
launcher picks for real caches (head dim 128 / 64, bf16 / fp16 / fp32,
int64 / int32 positions, host or device row count, host or device first
destination row), with the integer
specializations the Triton runtime applies at those shapes (``stride_dim ==
1`` is a constexpr, head dim and strides ``divisible_by_16``; the row count
and ``dst_start`` are ``do_not_specialize``). Each must compile with no local
memory (0 spills) and no shared memory, and its PTX must order every row
chunk as *global loads, then a CTA barrier (``bar.sync`` / ``barrier.sync``),
then global stores* in the loop body: the barrier is what makes overlapping
source/destination rows race free across warps (see the kernel module's
docstring), and the interpreter cannot show its absence.

The batched kernel (``kv [b, L, 2, Hkv, Smax, D]``, per-row ``[b]`` counts and
destinations, ``kv_compaction.batched_launch_configs``: b = 4, the same real
shapes, dtypes and position dtypes, with and without counts, contiguous
``[b]`` counts and destinations whose unit strides the runtime makes
constexprs) is held to the same: no spills, no shared memory, the barrier
between each chunk's loads and stores.
"""

import re

import pytest

from dflash_kernels import kv_compaction
from gpu_compile import assert_fits, compile_many_for_gpu, gpu_compile_unavailable_reason

ARCHS = (90, 80)
CONFIGS = kv_compaction.launch_configs()
BATCHED_CONFIGS = kv_compaction.batched_launch_configs()
CASES = [(cfg, arch) for cfg in CONFIGS + BATCHED_CONFIGS for arch in ARCHS]

_LABEL = re.compile(r"^\s*(\$L\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L\w+);")
_BARRIER = re.compile(r"\b(?:bar\.sync|barrier\.sync|bar\.cta\.sync|barrier\.cta\.sync)\b")


def ptx_loops(ptx: str):
    """Bodies of the PTX loops: the lines from a label to a later branch back to it."""
    lines = ptx.splitlines()
    labels, loops = {}, []
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
        m = _BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append(lines[labels[m.group(1)]:i + 1])
    return loops


def chunk_order(body):
    """Line numbers of ``ld.global``, barriers and ``st.global`` in one loop body."""
    loads = [i for i, line in enumerate(body) if "ld.global" in line]
    barriers = [i for i, line in enumerate(body) if _BARRIER.search(line)]
    stores = [i for i, line in enumerate(body) if "st.global" in line]
    return loads, barriers, stores


def assert_loads_barrier_stores(ptx: str, what: str = "kernel") -> None:
    """Every global store of the kernel sits in a loop whose body is: loads, then a barrier, then stores."""
    assert "cp.async" not in ptx, f"{what}: asynchronous copies would bypass the barrier ordering"
    loops = [body for body in ptx_loops(ptx) if any("st.global" in line for line in body)]
    assert loops, f"{what}: no loop with global stores found in the PTX"
    n_stores = sum(1 for line in ptx.splitlines() if "st.global" in line)
    assert n_stores == sum(1 for body in loops for line in body if "st.global" in line), (
        f"{what}: global stores outside the row-chunk loop")
    for body in loops:
        loads, barriers, stores = chunk_order(body)
        assert loads, f"{what}: a store loop without loads"
        between = [b for b in barriers if max(loads) < b < min(stores)]
        assert between, (f"{what}: no bar.sync between the chunk's global loads (last at body line {max(loads)}) "
                         f"and its global stores (first at body line {min(stores)}); barriers at {barriers}")


@pytest.fixture(scope="module")
def compiled():
    reason = gpu_compile_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    jobs = [dict(kernel=cfg["kernel"], signature=cfg["signature"], constexprs=cfg["constexprs"], arch=arch,
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                 divisible_by_16=cfg["divisible_by_16"]) for cfg, arch in CASES]
    results = compile_many_for_gpu(jobs, workers=2)
    return {(cfg["name"], arch): res for (cfg, arch), res in zip(CASES, results)}


def test_configs_cover_real_shapes():
    assert {cfg["head_dim"] for cfg in CONFIGS} == {64, 128}
    assert {cfg["signature"]["kv_ptr"] for cfg in CONFIGS} == {"*bf16", "*fp16", "*fp32"}
    assert {cfg["constexprs"]["HAS_COUNT"] for cfg in CONFIGS} == {False, True}
    # the static op's form (first destination row read from memory, device count) at every shape and dtype
    static = {(cfg["head_dim"], cfg["signature"]["kv_ptr"], cfg["signature"]["src_ptr"]) for cfg in CONFIGS
              if cfg["constexprs"]["DST_IN_MEMORY"]}
    assert static == {(d, t, s) for d in (64, 128) for t in ("*bf16", "*fp16", "*fp32") for s in ("*i64", "*i32")}
    assert all(cfg["constexprs"]["HAS_COUNT"] and cfg["signature"]["dst_ptr"] == "*i64" for cfg in CONFIGS
               if cfg["constexprs"]["DST_IN_MEMORY"])
    for cfg in CONFIGS:
        assert cfg["constexprs"]["BLOCK_A"] == 16
        assert cfg["constexprs"]["stride_dim"] == 1  # the runtime turns a unit int argument into a constexpr
        assert {"head_dim", "stride_layer", "stride_kv", "stride_head", "stride_pos"} <= set(cfg["divisible_by_16"])
        assert not {"n_rows", "dst_start"} & set(cfg["divisible_by_16"])
        assert "n_heads" not in cfg["divisible_by_16"]  # 8 kv heads


def test_batched_configs_cover_real_shapes():
    assert len({cfg["name"] for cfg in CONFIGS + BATCHED_CONFIGS}) == len(CONFIGS) + len(BATCHED_CONFIGS)
    assert {(cfg["head_dim"], cfg["signature"]["kv_ptr"], cfg["signature"]["src_ptr"], cfg["constexprs"]["HAS_COUNT"])
            for cfg in BATCHED_CONFIGS} == {(d, t, s, c) for d in (64, 128) for t in ("*bf16", "*fp16", "*fp32")
                                            for s in ("*i64", "*i32") for c in (False, True)}
    for cfg in BATCHED_CONFIGS:
        assert cfg["kernel"] is kv_compaction._compact_kv_batched_kernel and cfg["batch"] == 4
        assert cfg["constexprs"]["BLOCK_A"] == 16
        # unit strides (the head dim, contiguous [b] counts and destinations) are constexprs at run time
        assert {cfg["constexprs"][k] for k in ("stride_dim", "stride_count", "stride_dst")} == {1}
        assert {"head_dim", "stride_batch", "stride_layer", "stride_kv", "stride_head", "stride_pos"} <= set(
            cfg["divisible_by_16"])
        assert "n_rows" not in cfg["divisible_by_16"] and "n_rows" in cfg["signature"]  # A: never specialized
        assert "n_heads" not in cfg["divisible_by_16"]  # 8 kv heads


@pytest.mark.parametrize("cfg,arch", CASES, ids=[f"{c['name']}-sm{a}" for c, a in CASES])
def test_compiles_without_spills_with_a_barrier_per_chunk(compiled, cfg, arch):
    res = compiled[(cfg["name"], arch)]
    if isinstance(res, Exception):
        raise res
    assert_fits(res, arch, cfg["name"])
    assert 0 < res["registers"] <= 128, f"{cfg['name']} on sm_{arch}: {res['registers']} registers"
    assert_loads_barrier_stores(res["ptx"], f"{cfg['name']} on sm_{arch}")


def test_the_ptx_check_rejects_a_kernel_without_the_barrier():
    """The order check itself: a loop of loads then stores with no barrier in between fails."""
    ptx = "\n".join([
        "$L__BB0_2:",
        "\tld.global.b64 { %rd1 }, [ %rd2 + 0 ];",
        "\tld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd3 + 0 ];",
        "\tst.global.v4.b32 [ %rd4 + 0 ], { %r1, %r2, %r3, %r4 };",
        "\tbar.sync 0;",
        "\t@%p1 bra $L__BB0_2;",
    ])
    with pytest.raises(AssertionError, match="no bar.sync between"):
        assert_loads_barrier_stores(ptx)
