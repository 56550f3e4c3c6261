"""The DFlash2 kernels (dynamic conv and its backward, selector chain) compile for sm_90 and sm_80 without spills.

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
import os

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
    bwd = [cfg for cfg in CONFIGS if cfg["kernel"] is dynamic_conv._dynamic_conv_bwd_kernel]
    sel = [cfg for cfg in CONFIGS if cfg["kernel"] is selector._selector_kernel]
    assert len(conv) + len(bwd) + len(sel) == len(CONFIGS)
    # the backward at every shape and dtype; its tile holds whole groups (128-channel groups: a 128 tile)
    assert {(c["signature"]["x_ptr"], c["constexprs"]["GROUP"]) for c in bwd} == {
        (t, g) for t in ("*bf16", "*fp32") for g in (32, 64, 128)}
    assert all(c["constexprs"]["BLOCK_C"] % c["constexprs"]["GROUP"] == 0 for c in bwd)
    assert {(c["signature"]["x_ptr"], c["constexprs"]["HAS_RESIDUAL"]) for c in conv} == {
        (t, r) for t in ("*bf16", "*fp32") for r in (False, True)}
    assert {c["constexprs"]["K"] for c in conv} == {2, 4}
    assert {(c["signature"]["proj_ptr"], c["constexprs"]["SAMPLE"], c["constexprs"]["FILTER"]) for c in sel} == {
        (t, s, f) for t in ("*bf16", "*fp32") for s, f in ((False, False), (True, False), (True, True))}
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


def _launch_key(fn):
    """The compile key of the single Triton launch ``fn()`` makes (tests/triton_launches.py)."""
    from triton_launches import LaunchKeys

    with LaunchKeys() as rec:
        fn()
    assert len(rec.keys) == 1, rec.keys
    return dict(next(iter(rec.keys))[1])


def _assert_config_is_the_launch(cfg, key):
    """Every argument of the enumerated binary is specialized as the runtime specializes the real launch."""
    for name, value in key.items():
        if name in ("num_warps", "num_stages"):  # launch options
            assert cfg[name] == value, (cfg["name"], name, value)
        elif name in cfg["constexprs"] and value[0] == "constexpr":
            assert repr(cfg["constexprs"][name]) == value[1], (cfg["name"], name, value)
        elif value[0] == "tensor":
            assert value[2], f"{cfg['name']}: {name} is not 16-byte aligned at the real layout"
        elif value[0] in ("i32", "i64") and len(value) == 3:
            width, is_one, div16 = value
            assert is_one == (cfg["constexprs"].get(name) == 1), (cfg["name"], name, value)
            if not is_one:
                assert cfg["signature"][name] == width, (cfg["name"], name, value)
                assert div16 == (name in cfg["divisible_by_16"]), (cfg["name"], name, value)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="records interpreter launches")
def test_enumerated_binaries_are_the_ones_that_run():
    """The launchers' real calls at a config's shape (the projection's half of dynamic, base a slice of
    base_kernel, contiguous top-k outputs) need exactly the binary the compile test builds."""
    import torch

    import dflash_kernels as dk

    # a narrow shape of the same layout (the enumeration is shape-generic; the interpreter runs every program)
    shape = ("narrow", 1024, 16, 2, 128)
    name, H, B, K, g = shape
    configs = dynamic_conv.launch_configs(shapes=(shape,), dtypes=(torch.bfloat16,))
    x = torch.randn(1, B, H, dtype=torch.bfloat16)
    proj = torch.randn(1, B, 2, K, H // g, dtype=torch.bfloat16)
    base = torch.randn(2, K, H, dtype=torch.bfloat16)
    for residual in (None, x.clone()):
        key = _launch_key(lambda: dk.dynamic_conv(x, proj[:, :, 1], base[1], residual, backend="triton"))
        cfg = next(c for c in configs if c["name"] == f"dynamic_conv[{name} bf16 residual={residual is not None}]")
        _assert_config_is_the_launch(cfg, key)
    grad = torch.randn(1, B, H, dtype=torch.bfloat16)
    key = _launch_key(lambda: dynamic_conv.dynamic_conv_backward(grad, x, proj[:, :, 1], base[1], backend="triton"))
    _assert_config_is_the_launch(next(c for c in configs if c["name"] == f"dynamic_conv_backward[{name} bf16]"), key)
    name, D, k, r, V = selector.SELECTOR_SHAPES[1]
    logits = torch.randn(D, 200)
    unary, candidates = logits.topk(k, dim=-1)
    cb = torch.randn(V, r, dtype=torch.bfloat16)
    args = (unary, candidates, torch.randn(D, r, dtype=torch.bfloat16), cb, cb, torch.tensor([3]))
    for sample, filtered in ((False, False), (True, False), (True, True)):
        filters = dict(top_k=5, top_p=0.9, min_p=0.05) if filtered else {}
        key = _launch_key(lambda: dk.select_candidates(*args, 0.7 if sample else 0.0, torch.tensor([9]),
                                                       backend="triton", **filters))
        cfg = next(c for c in CONFIGS if c["name"] == f"selector[{name} bf16 sample={sample} filter={filtered}]")
        _assert_config_is_the_launch(cfg, key)
