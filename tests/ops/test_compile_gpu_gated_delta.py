"""The Gated-DeltaNet kernels compile for sm_90 and sm_80 at Qwen3.5 shapes, with their barriers in place.

``dflash_kernels.gated_delta.launch_configs`` enumerates every binary the
launchers pick at Qwen3.5-27B (``Hk = 16, Hv = 48``) and 9B (``Hk = 16, Hv =
32``) linear-attention shapes (``Dk = Dv = 128``, conv kernel 4, bf16 and fp32
inputs): the tree scan in its four modes (chain without / with a scratch,
tree storing every node / only the reloaded ones), the replay, the tree conv
(chain and tree). The integer arguments carry the Triton runtime's
specialization for the real layout (q / k / v as views of the conv output
``[N, C]``; unit strides are constexprs, multiples of 16 get the divisibility
hint; the node and row counts are ``do_not_specialize``). Each binary must
compile with no spills (neither local memory nor a stack frame) and shared
memory within the per-block limit.

The interpreter cannot show a race between threads, so the PTX is checked
for the orderings the kernels' proofs rely on (module docstring of
``dflash_kernels.gated_delta``):

* tree scan with reloads: after each load of ``parents[i]`` (the only 64-bit
  global load of the kernel) the next global load is preceded by a CTA
  barrier: the parent's slice is read back only after the barrier; and no
  load goes through the non-coherent path (``ld.global.nc``), which could
  serve a stale copy of a slice stored in this kernel;
* replay: every global load precedes the stores, and the stores' basic block
  (after the row loop, which may run zero times) holds a barrier before them:
  the state slice is overwritten only after every thread loaded it.
"""

import re

import pytest

from dflash_kernels import gated_delta as gd
from gpu_compile import assert_fits, compile_many_for_gpu, gpu_compile_unavailable_reason

ARCHS = (90, 80)
CONFIGS = gd.launch_configs()
CASES = [(cfg, arch) for cfg in CONFIGS for arch in ARCHS]

_BARRIER = re.compile(r"\b(?:bar\.sync|barrier\.sync|bar\.cta\.sync|barrier\.cta\.sync)\b")
_LOAD = re.compile(r"\bld\.global\b")
_LOAD64 = re.compile(r"\bld\.global(?:\.\w+)*\.[bsu]64\s")
_STORE = re.compile(r"\bst\.global\b")
_LABEL = re.compile(r"^\s*\$L__BB\w*:")  # basic-block labels (not the debug $L__tmp ones)
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s")


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


def _result(compiled, cfg, arch):
    res = compiled[(cfg["name"], arch)]
    if isinstance(res, Exception):
        raise res
    return res


def assert_barrier_before_reload(ptx: str, what: str = "kernel") -> None:
    """After every 64-bit global load (``parents[i]``), a barrier comes before the next global load."""
    lines = ptx.splitlines()
    parent_loads = [i for i, line in enumerate(lines) if _LOAD64.search(line)]
    assert parent_loads, f"{what}: no 64-bit load of parents[i] found"
    for i in parent_loads:
        later = [j for j in range(i + 1, len(lines)) if _LOAD.search(lines[j])]
        assert later, f"{what}: no global load after the parents load at PTX line {i}"
        between = [j for j in range(i + 1, later[0]) if _BARRIER.search(lines[j])]
        assert between, (f"{what}: the global load at PTX line {later[0]} follows the parents load (line {i}) "
                         "with no bar.sync in between")
    assert "ld.global.nc" not in ptx, f"{what}: non-coherent loads could read a stale scratch slice"


def assert_barrier_before_stores(ptx: str, what: str = "kernel") -> None:
    """The global stores come after every global load, in a basic block that starts with a barrier before
    them (the barrier after the row loop, not one of the loop's own reduction barriers, which a loop of
    zero rows skips)."""
    lines = ptx.splitlines()
    loads = [i for i, line in enumerate(lines) if _LOAD.search(line)]
    stores = [i for i, line in enumerate(lines) if _STORE.search(line)]
    assert loads and stores, f"{what}: expected global loads and stores"
    first = min(stores)
    assert max(loads) < first, f"{what}: a global load after the first store (PTX lines {max(loads)}, {first})"
    block = max([i for i in range(first) if _LABEL.match(lines[i]) or _BRANCH.search(lines[i])], default=-1)
    assert any(_BARRIER.search(lines[j]) for j in range(block + 1, first)), (
        f"{what}: no bar.sync in the block of the first store (PTX lines {block + 1}..{first}): the state "
        "slice could be overwritten before another thread loaded it")


def _key(cfg):
    return (cfg["kernel"].fn.__name__, tuple(sorted(cfg["signature"].items())),
            tuple(sorted(cfg["constexprs"].items())), tuple(sorted(cfg["divisible_by_16"])))


def test_configs_cover_qwen35_shapes():
    """Both models' binaries are compiled: 9B's (Hv = 32) specialize exactly as 27B's (Hv = 48), so they
    are the same 7 binaries per dtype (4 tree modes, replay, 2 conv) and the list holds them once."""
    keys = {_key(cfg) for cfg in CONFIGS}
    assert len(keys) == len(CONFIGS) == 14
    for shape in gd.QWEN35_SHAPES:
        per_shape = gd.launch_configs(shapes=(shape,))
        assert len(per_shape) == 14 and {_key(cfg) for cfg in per_shape} <= keys, shape
    for cfg in CONFIGS:
        assert not set(cfg["divisible_by_16"]) & {"n_nodes", "n_rows"}  # round-varying counts: no hints
        if cfg["kernel"] is gd._gated_delta_tree_kernel:
            assert {"dim_k", "dim_v", "stride_qn", "stride_sh"} <= set(cfg["divisible_by_16"])
            assert cfg["constexprs"]["stride_qd"] == 1 and cfg["constexprs"]["stride_sv"] == 1
    assert {c["constexprs"]["STORE"] for c in CONFIGS if c["kernel"] is gd._gated_delta_tree_kernel} == {0, 1, 2}
    assert {c["signature"]["q_ptr"] for c in CONFIGS if "q_ptr" in c["signature"]} == {"*bf16", "*fp32"}


@pytest.mark.parametrize("cfg,arch", CASES, ids=[f"{c['name']}-sm{a}" for c, a in CASES])
def test_compiles_without_spills(compiled, cfg, arch):
    res = _result(compiled, cfg, arch)
    assert_fits(res, arch, cfg["name"])
    assert 0 < res["registers"] <= 255
    if cfg["kernel"] is gd._gated_delta_tree_kernel and not cfg["constexprs"]["CHAIN"]:
        assert_barrier_before_reload(res["ptx"], f"{cfg['name']} on sm_{arch}")
    if cfg["kernel"] is gd._gated_delta_replay_kernel:
        assert_barrier_before_stores(res["ptx"], f"{cfg['name']} on sm_{arch}")


def test_the_ptx_checks_reject_missing_barriers():
    """The checks themselves: a reload right after the parents load, a store with no barrier, both fail."""
    reload = "\n".join(["ld.global.b64 { %rd74 }, [ %rd103 + 0 ];", "@%p13 bra $L__BB0_4;",
                        "@%p14 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd76 + 0 ];"])
    with pytest.raises(AssertionError, match="no bar.sync"):
        assert_barrier_before_reload(reload)
    store = "\n".join(["ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd73 + 0 ];", "$L__BB0_3:",
                       "st.global.v4.b32 [ %rd73 + 0 ], { %r1, %r2, %r3, %r4 };"])
    with pytest.raises(AssertionError, match="no bar.sync"):
        assert_barrier_before_stores(store)
    # a barrier inside the row loop only (the loop's reductions) does not count
    loop_only = "\n".join(["ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd73 + 0 ];", "$L__BB0_2:",
                           "ld.global.b64 { %rd60 }, [ %rd81 + 0 ];", "bar.sync 0;", "@%p12 bra $L__BB0_2;",
                           "$L__BB0_3:", "st.global.v4.b32 [ %rd73 + 0 ], { %r1, %r2, %r3, %r4 };"])
    with pytest.raises(AssertionError, match="no bar.sync"):
        assert_barrier_before_stores(loop_only)
    assert_barrier_before_stores(loop_only.replace("$L__BB0_3:", "$L__BB0_3:\nbar.sync 0;"))


def test_launch_configs_match_the_launcher():
    """The enumerated tiles are the launcher's (state_config), so the compiled binary is the one that runs."""
    cfg = gd.state_config(128, 128)
    assert (cfg["BK"], cfg["BV"], cfg["num_warps"]) == (128, 8, 1)
    for c in CONFIGS:
        if c["kernel"] is not gd._causal_conv_tree_kernel:
            assert (c["constexprs"]["BK"], c["constexprs"]["BV"], c["num_warps"]) == (128, 8, 1)
