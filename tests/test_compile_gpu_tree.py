"""The DDTree kernels compile for real GPUs (sm_90, sm_80) at every config their launchers choose.

The interpreter accepts code a real compile rejects and says nothing about
registers or shared memory, so each kernel is compiled through Triton's NVIDIA
pipeline (no GPU needed, see ``gpu_compile.py``) at the shapes of a real
target (head_dim 128, Hq 32, Hkv 8) and checked for: no register spills,
shared memory within the per-block limit, and tensor-core instructions in the
half-precision attention (``wgmma`` on sm_90 for 64-row tiles, ``mma`` else).
Strides are given as a launch of contiguous-last-dim tensors specializes them:
the unit stride as the constant 1, the others as multiples of 16.
"""

import pytest
import torch

from gpu_compile import SHARED_MEMORY_LIMIT_BYTES, compile_for_gpu, require_gpu_compiler
from dflash_kernels.kv_compaction import _compact_kv_kernel, kv_compaction_config
from dflash_kernels.tree import ANCESTOR_BITS_CONFIGS, _ancestor_bits_kernel
from dflash_kernels.tree_attention import (
    TREE_MASK_CONFIGS,
    _merge_splits_kernel,
    _tree_attention_kernel,
    _tree_mask_kernel,
    tree_attention_configs,
)

ARCHS = [90, 80]
HEAD_DIM = 128
TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@pytest.fixture(scope="module", autouse=True)
def gpu_compiler():
    require_gpu_compiler()


def check_resources(result, arch):
    assert result["spill_bytes"] == 0, f"{result['name']} spills {result['spill_bytes']} bytes on sm_{arch}"
    assert result["shared_bytes"] <= SHARED_MEMORY_LIMIT_BYTES[arch], (
        f"{result['name']} needs {result['shared_bytes']} B of shared memory, sm_{arch} allows "
        f"{SHARED_MEMORY_LIMIT_BYTES[arch]}"
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", ANCESTOR_BITS_CONFIGS, ids=lambda c: f"R{c['BLOCK_R']}")
def test_ancestor_bits_kernel(arch, cfg):
    result = compile_for_gpu(
        _ancestor_bits_kernel,
        {"parents_ptr": "*i64", "bits_ptr": "*i32", "n_nodes": "i32", "n_words": "i32"},
        {"BLOCK_R": cfg["BLOCK_R"]},
        arch=arch, num_warps=cfg["num_warps"], num_stages=1,
    )
    check_resources(result, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_mask_kernel(arch, dtype):
    cfg = TREE_MASK_CONFIGS[0]
    result = compile_for_gpu(
        _tree_mask_kernel,
        {"bits_ptr": "*i32", "mask_ptr": f"*{TRITON_TYPE[dtype]}", "n_tree": "i32", "prefix_len": "i32",
         "n_keys": "i32", "stride_bits_row": "i32", "stride_mask_row": "i32", "hidden_value": "fp32"},
        {"stride_bits_word": 1, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_K": cfg["BLOCK_K"]},
        arch=arch, num_warps=cfg["num_warps"], num_stages=1,
    )
    check_resources(result, arch)


def attention_signature(dtype):
    ptr = f"*{TRITON_TYPE[dtype]}"
    sig = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "out_ptr": ptr, "bits_ptr": "*i32",
           "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
    for name in ("stride_qh", "stride_qt", "stride_kh", "stride_ks", "stride_vh", "stride_vs",
                 "stride_bits_row", "stride_oh", "stride_ot",
                 "n_tree", "prefix_len", "head_dim", "group", "tiles_per_split"):
        sig[name] = "i32"
    return sig


ALIGNED = ["stride_qh", "stride_qt", "stride_kh", "stride_ks", "stride_vh", "stride_vs", "stride_oh", "stride_ot",
           "head_dim"]
UNIT_STRIDES = {"stride_qd": 1, "stride_kd": 1, "stride_vd": 1, "stride_bits_word": 1, "stride_od": 1}

ATTENTION_CASES = [
    (dtype, cfg, split)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for cfg in tree_attention_configs(HEAD_DIM, dtype)
    for split in ((False, True) if dtype == torch.bfloat16 else (False,))
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "dtype,cfg,split", ATTENTION_CASES,
    ids=[f"{TRITON_TYPE[d]}-M{c['BLOCK_M']}-N{c['BLOCK_N']}-{'split' if s else 'whole'}" for d, c, s in ATTENTION_CASES],
)
def test_tree_attention_kernel(arch, dtype, cfg, split):
    constexprs = dict(UNIT_STRIDES, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
                      SPLIT_KEYS=split, DOT_FP32=False,
                      INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    result = compile_for_gpu(_tree_attention_kernel, attention_signature(dtype), constexprs, arch=arch,
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], divisible_by_16=ALIGNED)
    check_resources(result, arch)
    if dtype != torch.float32:
        ptx = result["ptx"]
        if arch == 90 and cfg["BLOCK_M"] == 64:
            assert "wgmma" in ptx, "the 64-row bf16/fp16 tile should use Hopper's wgmma"
        else:
            assert "mma" in ptx, "bf16/fp16 attention must run on tensor cores"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_merge_splits_kernel(arch, block_m):
    result = compile_for_gpu(
        _merge_splits_kernel,
        {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16", "n_tree": "i32", "head_dim": "i32",
         "num_splits": "i32", "stride_oh": "i32", "stride_ot": "i32"},
        {"stride_od": 1, "BLOCK_M": block_m, "BLOCK_D": HEAD_DIM},
        arch=arch, num_warps=4, num_stages=1, divisible_by_16=["head_dim", "stride_oh", "stride_ot"],
    )
    check_resources(result, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n_rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_compaction_kernel(arch, n_rows, dtype):
    cfg = kv_compaction_config(n_rows, HEAD_DIM)
    result = compile_for_gpu(
        _compact_kv_kernel,
        {"kv_ptr": f"*{TRITON_TYPE[dtype]}", "src_ptr": "*i64", "n_rows": "i32", "dst_start": "i32",
         "n_heads": "i32", "head_dim": "i32", "stride_layer": "i32", "stride_kv": "i32", "stride_head": "i32",
         "stride_pos": "i32"},
        {"stride_dim": 1, "BLOCK_A": cfg["BLOCK_A"], "BLOCK_D": cfg["BLOCK_D"]},
        arch=arch, num_warps=cfg["num_warps"], num_stages=1,
        divisible_by_16=["head_dim", "stride_layer", "stride_kv", "stride_head", "stride_pos"],
    )
    check_resources(result, arch)
