"""The DFlash2 kernels (dynamic conv, selector chain) compile for sm_90 and sm_80 without spills.

``dflash_kernels.dynamic_conv.launch_configs`` and
``dflash_kernels.selector.launch_configs`` enumerate the binaries their
launchers pick at drafter shapes (hidden 2560 / 4096 / 5120, block 16, 2 or 4
taps, 32..128 channels per group; 8..32 candidates, rank 48..256; bf16 and
fp32), with the integer specialization the Triton runtime applies at those
layouts (unit strides constexprs, multiples of 16 hinted; the selector's seed
pointer without the alignment hint, as the kernel declares). Each must compile
with no local memory or stack frame (no spills) and shared memory under the
per-block limit; the registers and shared memory of each are printed (``-s``).
"""

import importlib

import pytest

from dflash_kernels import selector
from gpu_compile import assert_fits, compile_many_for_gpu, gpu_compile_unavailable_reason

# (the package attribute ``dflash_kernels.dynamic_conv`` is the op; the module is looked up by name)
dynamic_conv = importlib.import_module("dflash_kernels.dynamic_conv")

ARCHS = (90, 80)
CONFIGS = dynamic_conv.launch_configs() + selector.launch_configs()
CASES = [(cfg, arch) for cfg in CONFIGS for arch in ARCHS]


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


def test_configs_cover_both_kernels_and_variants():
    conv = [cfg for cfg in CONFIGS if cfg["kernel"] is dynamic_conv._dynamic_conv_kernel]
    sel = [cfg for cfg in CONFIGS if cfg["kernel"] is selector._selector_kernel]
    assert len(conv) + len(sel) == len(CONFIGS)
    assert {(c["signature"]["x_ptr"], c["constexprs"]["HAS_RESIDUAL"]) for c in conv} == {
        (t, r) for t in ("*bf16", "*fp32") for r in (False, True)}
    assert {c["constexprs"]["K"] for c in conv} == {2, 4}
    assert {(c["signature"]["proj_ptr"], c["constexprs"]["SAMPLE"]) for c in sel} == {
        (t, s) for t in ("*bf16", "*fp32") for s in (False, True)}
    # real layouts: unit channel strides are constexprs, the hidden size and row strides are hinted; the
    # strided half of the projection output keeps its (non-unit) tap stride an argument
    for c in conv:
        assert c["constexprs"]["stride_xc"] == 1 and c["constexprs"]["stride_dg"] == 1
        assert {"H", "stride_xt", "stride_dn"} <= set(c["divisible_by_16"])
        assert "stride_do" in c["signature"]
    # the rank-chunk loop runs more than once at rank 128 / 256
    assert {c["constexprs"]["BLOCK_R"] for c in sel} == {64}
    assert all("seed_ptr" in selector.UNALIGNED_PTRS for _ in sel)


@pytest.mark.parametrize("cfg,arch", CASES, ids=[f"{c['name']}-sm{a}" for c, a in CASES])
def test_compiles_without_spills(compiled, cfg, arch):
    res = compiled[(cfg["name"], arch)]
    if isinstance(res, Exception):
        raise res
    print(f"{cfg['name']} sm_{arch}: {res['registers']} registers, {res['shared_bytes']} B shared")
    assert_fits(res, arch, cfg["name"])
    assert 0 < res["registers"] <= 128, f"{cfg['name']} on sm_{arch}: {res['registers']} registers"
