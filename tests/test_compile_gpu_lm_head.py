"""Every Triton kernel of gather + lm_head compiles for sm_90 and sm_80 at every launch config.

The configs are not hard-coded here: ``dflash_kernels.lm_head.launch_configs``
and ``dflash_kernels.gather.launch_configs`` enumerate what their launchers
choose for real model shapes (hidden 48 / 2560 / 4096, positions 1..8192,
bf16 / fp16 / fp32; the vocabulary size only changes grids). Each must compile
with no local memory (no spills), with shared memory under the chip's
per-block limit, and, where the GEMM runs bf16/fp16 ``tl.dot``, with tensor
core instructions (``wgmma`` on sm_90 for 128-row tiles, ``mma`` otherwise)
in the PTX. Everything is compiled once per session (two worker processes),
then checked per config.
"""

import pytest

from dflash_kernels import gather, lm_head
from gpu_compile import SHARED_MEMORY_LIMIT_BYTES, compile_many_for_gpu, gpu_compile_unavailable_reason

ARCHS = (90, 80)
CONFIGS = gather.launch_configs() + lm_head.launch_configs()
CASES = [(cfg, arch) for cfg in CONFIGS for arch in ARCHS]


@pytest.fixture(scope="module")
def compiled():
    reason = gpu_compile_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    jobs = [dict(kernel=cfg["kernel"], signature=cfg["signature"], constexprs=cfg["constexprs"], arch=arch,
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) for cfg, arch in CASES]
    results = compile_many_for_gpu(jobs, workers=2)
    return {(cfg["name"], arch): res for (cfg, arch), res in zip(CASES, results)}


def test_configs_cover_every_kernel():
    names = {cfg["kernel"].__name__ for cfg in CONFIGS}
    assert names == {"_gather_concat_kernel", "_norm_rows_kernel", "_logits_kernel", "_argmax_kernel",
                     "_ce_grad_kernel"}
    # decode-sized and large position counts pick different GEMM tiles; both are listed
    tiles = {(cfg["constexprs"]["BLOCK_M"], cfg["signature"]["a_ptr"]) for cfg in CONFIGS
             if cfg["kernel"].__name__ == "_argmax_kernel"}
    assert tiles == {(16, "*bf16"), (128, "*bf16"), (16, "*fp16"), (128, "*fp16"), (16, "*fp32"), (128, "*fp32")}


@pytest.mark.parametrize("cfg,arch", CASES, ids=[f"{c['name']}-sm{a}" for c, a in CASES])
def test_compiles_without_spills(compiled, cfg, arch):
    res = compiled[(cfg["name"], arch)]
    if isinstance(res, Exception):
        raise res
    assert res["local_bytes"] == 0, f"{cfg['name']} on sm_{arch} uses {res['local_bytes']} B of local memory (spills)"
    assert res["shared_bytes"] <= SHARED_MEMORY_LIMIT_BYTES[arch], (
        f"{cfg['name']} on sm_{arch} needs {res['shared_bytes']} B of shared memory, "
        f"limit {SHARED_MEMORY_LIMIT_BYTES[arch]}")
    assert 0 < res["registers"] <= 255
    if cfg.get("tensor_core_dot"):
        ptx = res["ptx"]
        if arch == 90 and cfg["constexprs"]["BLOCK_M"] >= 64:
            assert "wgmma" in ptx, f"{cfg['name']} on sm_90 does not use wgmma"
        else:
            assert "mma.sync" in ptx or "wgmma" in ptx, f"{cfg['name']} on sm_{arch} uses no tensor-core mma"
