"""Every Triton kernel of gather + lm_head + cross_entropy compiles for sm_90 and sm_80 at every launch config.

The configs are not hard-coded here: ``dflash_kernels.lm_head.launch_configs``,
``dflash_kernels.cross_entropy.launch_configs`` and
``dflash_kernels.gather.launch_configs`` enumerate what their launchers
choose for real model shapes ((H, V) = tiny (128, 258), Qwen3-4B / 8B,
Llama-3.1-8B; positions 1..8192; bf16 / fp16 / fp32; argmax with the model's
and fp32 logit dtypes). Each is compiled with the divisibility hints the
Triton runtime gives at that shape (every integer argument that is a multiple
of 16 and not ``do_not_specialize`` is ``divisible_by_16``), so the checked
binary is the one that runs. Each must compile with no local memory (no
spills), with shared memory under the chip's per-block limit, and, where the
GEMM runs bf16/fp16 ``tl.dot``, with tensor core instructions (``wgmma`` on
sm_90 for 64- and 128-row tiles, of the heads' per-warpgroup width ``n``;
``mma`` otherwise) in the PTX. The final-logit softcap variants (``HAS_SOFTCAP``: logits, Gumbel sampling, CE gradient) are
among the configs, with the same checks, and so are the device-seed
sampling epilogues (``DEVICE_SEED``: the seed loaded from memory, Philox of
(vocab id, row), at every tile, capped or not) and the Gumbel noise kernel of
processed sampling with a device seed. Everything is
compiled once per session (two worker processes), then checked per config.
"""

import pytest

from dflash_kernels import cross_entropy, gather, lm_head, noise
from gpu_compile import assert_fits, compile_many_for_gpu, gpu_compile_unavailable_reason

ARCHS = (90, 80)
CONFIGS = gather.launch_configs() + lm_head.launch_configs() + cross_entropy.launch_configs()
# each arch compiles its own table (the fused top-K's row tiles differ)
CASES = [(cfg, arch) for arch in ARCHS
         for cfg in gather.launch_configs() + lm_head.launch_configs(arch=arch) + cross_entropy.launch_configs()]


@pytest.fixture(scope="module")
def compiled():
    reason = gpu_compile_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    jobs = [dict(kernel=cfg["kernel"], signature=cfg["signature"], constexprs=cfg["constexprs"], arch=arch,
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                 divisible_by_16=cfg["divisible_by_16"], maxnreg=cfg.get("maxnreg")) for cfg, arch in CASES]
    results = compile_many_for_gpu(jobs, workers=2)
    return {(cfg["name"], arch): res for (cfg, arch), res in zip(CASES, results)}


def test_configs_cover_every_kernel():
    names = {cfg["kernel"].__name__ for cfg in CONFIGS}
    assert names == {"_gather_concat_kernel", "_norm_rows_kernel", "_logits_kernel", "_argmax_kernel",
                     "_topk_kernel", "_ce_grad_kernel", "_gumbel_noise_kernel"}
    # the fused top-K at every real width, both row tiles and every dot dtype; capped at DDTree's width
    topk = {(cfg["constexprs"]["BLOCK_M"], cfg["constexprs"]["BLOCK_N"], cfg["constexprs"]["K_BLOCK"],
             cfg["signature"]["a_ptr"], cfg["constexprs"]["HAS_SOFTCAP"]) for cfg in CONFIGS
            if cfg["kernel"].__name__ == "_topk_kernel"}
    half = {(m, max(64 if m == 16 else 128, k), k, d, c) for m in (16, 64) for k in (8, 64, 128)
            for d in ("*bf16", "*fp16") for c in (False, k == 64)}
    half |= {(16, 256, 256, d, False) for d in ("*bf16", "*fp16")}  # 256 keys: the 16-row tile at every row count
    full = {(16, 64, k, "*fp32", c) for k in lm_head.REAL_TOPK if k <= 64 for c in (False, k == 64)}
    assert topk == half | full
    # sm_80: 32-row tiles above 16 rows, where sm_90 takes 64 rows (wgmma)
    sm80 = {(cfg["constexprs"]["BLOCK_M"], cfg["constexprs"]["K_BLOCK"]) for cfg in lm_head.launch_configs(arch=80)
            if cfg["kernel"].__name__ == "_topk_kernel" and cfg["signature"]["a_ptr"] == "*bf16"}
    assert sm80 == {(16, k) for k in lm_head.REAL_TOPK} | {(32, k) for k in (8, 64, 128)}
    # the device-seed Gumbel epilogue at every tile and dot dtype, with and without the final softcap
    seeded = {(cfg["constexprs"]["BLOCK_M"], cfg["signature"]["a_ptr"], cfg["constexprs"]["HAS_SOFTCAP"])
              for cfg in CONFIGS if cfg["constexprs"].get("DEVICE_SEED")}
    heads = {(m, d) for m in (16, 64, 128) for d in ("*bf16", "*fp16")} | {(64, "*fp32")}
    assert seeded == {(m, d, c) for m, d in heads for c in (False, True)}
    assert all(cfg["constexprs"]["GUMBEL"] and cfg["signature"]["seed_ptr"] == "*i64" for cfg in CONFIGS
               if cfg["constexprs"].get("DEVICE_SEED"))
    # decode-sized and large position counts pick different GEMM tiles; every one is listed (the bf16/fp16 heads:
    # 64-row tiles where they pad less, e.g. 17, 64 and 257 rows; the Gumbel epilogue 64 ids wide at 128 rows)
    tiles = {(cfg["constexprs"]["BLOCK_M"], cfg["signature"]["a_ptr"]) for cfg in CONFIGS
             if cfg["kernel"].__name__ == "_argmax_kernel"}
    assert tiles == heads
    widths = {(cfg["constexprs"]["BLOCK_M"], cfg["constexprs"]["GUMBEL"], cfg["constexprs"]["BLOCK_N"])
              for cfg in CONFIGS if cfg["kernel"].__name__ == "_argmax_kernel" and cfg["signature"]["a_ptr"] == "*bf16"}
    assert widths == {(16, False, 64), (16, True, 64), (64, False, 128), (64, True, 128), (128, False, 128),
                      (128, True, 64)}
    # the greedy/sample epilogue in the model's dtype (default) and in fp32
    rounding = {(cfg["signature"]["a_ptr"], str(cfg["constexprs"]["LOGIT_DTYPE"])) for cfg in CONFIGS
                if cfg["kernel"].__name__ == "_argmax_kernel"}
    assert rounding == {("*bf16", "bf16"), ("*bf16", "fp32"), ("*fp16", "fp16"), ("*fp16", "fp32"),
                        ("*fp32", "fp32")}
    # the final-logit softcap epilogues: logits (top-K, CE) and Gumbel sampling at every tile, the CE gradient
    capped = {(cfg["kernel"].__name__, cfg["constexprs"].get("BLOCK_M"), cfg["signature"].get("a_ptr",
               cfg["signature"].get("grad_ptr"))) for cfg in CONFIGS if cfg["constexprs"].get("HAS_SOFTCAP")}
    dots = ("*bf16", "*fp16", "*fp32")
    assert capped == ({("_logits_kernel", m, d) for m in (16, 128) for d in dots}
                      | {("_argmax_kernel", m, d) for m, d in heads}
                      | {("_topk_kernel", m, d) for m in (16, 64) for d in ("*bf16", "*fp16")}
                      | {("_topk_kernel", 16, "*fp32")}
                      | {("_ce_grad_kernel", None, d) for d in dots})
    assert all(cfg["constexprs"]["GUMBEL"] for cfg in CONFIGS
               if cfg["kernel"].__name__ == "_argmax_kernel" and cfg["constexprs"]["HAS_SOFTCAP"])


def _declared_do_not_specialize(kernel):
    """The kernel's do_not_specialize names (compiled JITFunction or interpreter object)."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:
        names = kernel.kwargs.get("do_not_specialize") or ()
    return {kernel.arg_names[n] if isinstance(n, int) else n for n in names}


def test_divisibility_hints_are_the_runtime_ones():
    """Every int argument is either do_not_specialize (as the kernel declares it) or hinted as the runtime would."""
    for cfg in CONFIGS:
        kernel = cfg["kernel"]
        declared = _declared_do_not_specialize(kernel)
        assert set(cfg["do_not_specialize"]) == declared, cfg["name"]
        ints = {name for name, ty in cfg["signature"].items() if ty in ("i32", "i64")}
        assert not declared & set(cfg["divisible_by_16"]), cfg["name"]
        assert set(cfg["divisible_by_16"]) <= ints, cfg["name"]
    # real shapes: hidden sizes, vocab sizes and the strides built from them are multiples of 16
    big = [cfg for cfg in CONFIGS if cfg["kernel"].__name__ == "_argmax_kernel" and "V" in cfg["divisible_by_16"]]
    assert big and all({"H", "stride_am", "stride_wn"} <= set(cfg["divisible_by_16"]) for cfg in big)
    gathers = [cfg for cfg in CONFIGS if cfg["kernel"].__name__ == "_gather_concat_kernel"]
    # addresses (aligned activations) and row strides (H) of every layer slot too
    slots = {f"p{i}" for i in range(8)} | {f"s{i}" for i in range(8)}
    assert all(set(cfg["divisible_by_16"]) == {"H", "stride_out"} | slots for cfg in gathers)


def test_varying_int_arguments_are_not_specialized():
    """Row counts (they change every decoding round), vocab chunk bounds and row offsets never pick a new binary."""
    expected = {"_gather_concat_kernel": {"R"}, "_norm_rows_kernel": {"N"}, "_logits_kernel": {"N", "V0", "V_END"},
                "_argmax_kernel": {"N", "seed", "tiles_per_split", "n_splits"},
                "_topk_kernel": {"N", "tiles_per_split", "n_splits"}, "_ce_grad_kernel": {"N", "row0"},
                "_gumbel_noise_kernel": {"n_rows", "n_cols", "row0", "col0"}}
    for name, wanted in expected.items():
        module = {"_gather_concat_kernel": gather, "_ce_grad_kernel": cross_entropy,
                  "_gumbel_noise_kernel": noise}.get(name, lm_head)
        kernel = getattr(module, name)
        assert wanted <= _declared_do_not_specialize(kernel), name


@pytest.mark.parametrize("cfg,arch", CASES, ids=[f"{c['name']}-sm{a}" for c, a in CASES])
def test_compiles_without_spills(compiled, cfg, arch):
    res = compiled[(cfg["name"], arch)]
    if isinstance(res, Exception):
        raise res
    assert_fits(res, arch, cfg["name"])
    assert 0 < res["registers"] <= 255
    if cfg.get("tensor_core_dot"):
        ptx = res["ptx"]
        if arch == 90 and cfg["constexprs"]["BLOCK_M"] >= 64:
            assert "wgmma" in ptx, f"{cfg['name']} on sm_90 does not use wgmma"
            if cfg["kernel"].__name__ in ("_argmax_kernel", "_topk_kernel"):  # one warpgroup's n: its width
                n = cfg["constexprs"]["BLOCK_N"] // (2 if cfg["constexprs"]["BLOCK_M"] == 64 else 1)
                assert f"wgmma.mma_async.sync.aligned.m64n{n}k16" in ptx, cfg["name"]
        else:
            assert "mma.sync" in ptx or "wgmma" in ptx, f"{cfg['name']} on sm_{arch} uses no tensor-core mma"
    if cfg["kernel"].__name__ == "_gather_concat_kernel" and cfg["constexprs"].get("ALIGNED"):
        # addresses come in as int64 arguments: the alignment hints must still give 16-byte vectors
        assert "ld.global.v4" in res["ptx"] and "st.global.v4" in res["ptx"], f"{cfg['name']}: scalar copies"
