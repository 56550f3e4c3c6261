"""The DDTree kernels compile for real GPUs (sm_90, sm_80) at every config their launchers choose.

The interpreter accepts code a real compile rejects and says nothing about
registers or shared memory, so each kernel is compiled through Triton's NVIDIA
pipeline (no GPU needed, see ``gpu_compile.py``) and checked for: no register
spills (neither ``LOCAL`` nor a ptxas stack frame, which is where ptxas 13
puts them), shared memory within the per-block limit, the K/V loads
pipelined (``cp.async`` and ``num_stages - 1`` K/V buffers in shared memory),
and tensor-core instructions in the half-precision attention (``wgmma`` on
sm_90 for 64/128-row tiles, ``mma`` else).

Signatures are those of a real launch: contiguous last dims specialize their
unit strides to the constant 1, the other strides (and head dims) are
multiples of 16 and get the divisibility hint, and the ints the kernels list
in ``do_not_specialize`` (prefix length, tree size, window, ...) are plain
``i32`` without hints; the bits / positions pointers (slices at any offset)
are not marked 16-byte aligned. ``group`` (Hq / Hkv) is the constant 1 for MHA and a
plain ``i32`` for G = 4 or 8 (one binary for both).

Attention softcap and sinks (``HAS_SOFTCAP`` / ``HAS_SINKS``): the heaviest
variant (bitmask + window + split + softcap + sinks) at every bf16 and fp32
config of every head dim (fp16 runs the bf16 lines), the unsplit one (the
sink starts the running softmax) and the chain one at Qwen3-8B's T = 65
tile, and the bf16 merge kernel with sinks; not the whole cross product.

Device-side prefix (``PREFIX_IN_MEMORY``: the committed length loaded from
``prefix_ptr``, the static op of a compiled / CUDA-graph step): the heaviest
variant at every bf16 and fp32 config of every head dim, and every
chain / window / split combination at the T = 65 tile, with the same checks;
every chain / split / prefix-in-memory one without a window at the T = 257
tile (128 rows; on sm_90 the ``m64n64k16`` scores of 64-key tiles). Each
arch compiles its own table (``tree_attention_configs(..., arch)``).

Batch: every variant is the batched kernel (b sequences on grid axis 1; the
batch strides of q / k / v / out are hinted multiples of 16, 0 for one row,
those of bits / positions / the prefix plain ``i32``). A batched static step
over a cache of 2^31 elements or more passes its K/V batch strides as ``i64``:
that signature at the heaviest variant of every bf16 / fp32 config and head
dim, chain / tree x whole / split at the T = 65 and 32-row tiles (the latter
also with ``i32`` strides), and one kv head (``n_kv_heads`` specialized to 1).

The attention launches pass ``maxnreg`` (see ``MAX_REGISTERS``), which
``compile_for_gpu`` has no argument for, so they compile through
:func:`_compile_with_options` (the same steps plus the option) on the same
worker processes.
"""

import importlib
import threading

import pytest
import torch

import gpu_compile
from gpu_compile import assert_fits, compile_for_gpu, require_gpu_compiler
from dflash_kernels.tree import (ANCESTOR_BITS_CONFIGS, WALK_DYNAMIC_INTS, _ancestor_bits_kernel,
                                 _walk_tree_kernel, walk_num_warps)
from dflash_kernels.tree_attention import (
    MERGE_BLOCK_M,
    MERGE_DYNAMIC_INTS,
    MERGE_NUM_WARPS,
    MERGE_UNALIGNED_PTRS,
    TREE_ATTENTION_DYNAMIC_INTS,
    TREE_ATTENTION_UNALIGNED_PTRS,
    TREE_MASK_CONFIGS,
    _input_precision,
    _merge_splits_kernel,
    _tree_attention_kernel,
    _tree_mask_kernel,
    tree_attention_configs,
)

ARCHS = [90, 80]
TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@pytest.fixture(scope="module", autouse=True)
def gpu_compiler():
    require_gpu_compiler()


def check_resources(result, arch):
    assert_fits(result, arch)


#: the variants a launch specializes to: the tensors' pointers 16-byte aligned (torch's allocations), and either
#: a tree count of nodes that is a multiple of 16 or one word of bits (``n_words == 1``, up to 32 nodes: the
#: runtime makes an int equal to 1 a constant)
ANCESTOR_BITS_RUNTIME = {
    "n16": ({"n_words": "i32"}, {}, ("parents_ptr", "bits_ptr", "n_nodes")),
    "w1": ({"n_words": "constexpr"}, {"n_words": 1}, ("parents_ptr", "bits_ptr")),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", ANCESTOR_BITS_CONFIGS, ids=lambda c: f"R{c['BLOCK_R']}")
@pytest.mark.parametrize("variant", list(ANCESTOR_BITS_RUNTIME))
def test_ancestor_bits_kernel(arch, cfg, variant):
    words, constants, divisible = ANCESTOR_BITS_RUNTIME[variant]
    result = compile_for_gpu(
        _ancestor_bits_kernel,
        {"parents_ptr": "*i64", "bits_ptr": "*i32", "n_nodes": "i32", **words},
        {"BLOCK_R": cfg["BLOCK_R"], **constants},
        arch=arch, num_warps=cfg["num_warps"], num_stages=1, divisible_by_16=divisible,
    )
    check_resources(result, arch)


#: the walk's lane counts: trees of up to 32 .. 4096 nodes, path vectors for depth bounds up to 15 and 31
WALK_BLOCKS = (32, 128, 256, 1024, 4096)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block", WALK_BLOCKS)
@pytest.mark.parametrize("block_w", (16, 32))
@pytest.mark.parametrize("index_type", ("*i64", "*i32"))
def test_walk_tree_kernel(arch, block, block_w, index_type):
    """The device walk's kernel at every lane count, int64 and int32 trees, as the runtime specializes a launch:
    the inputs never specialized on alignment (``WALK_UNALIGNED_PTRS``: views at any offset), the outputs
    aligned (fresh), the node count and depth bound never specialized (``WALK_DYNAMIC_INTS``)."""
    assert set(WALK_DYNAMIC_INTS) == {"n_nodes", "max_depth"}
    assert set(gpu_compile.unaligned_pointers(_walk_tree_kernel)) == {"parents_ptr", "tokens_ptr", "choice_ptr"}
    result = compile_for_gpu(
        _walk_tree_kernel,
        {"parents_ptr": index_type, "tokens_ptr": index_type, "choice_ptr": index_type, "path_ptr": "*i64",
         "len_ptr": "*i64", "committed_ptr": "*i64", "n_nodes": "i32", "max_depth": "i32"},
        {"BLOCK": block, "BLOCK_W": block_w},
        arch=arch, num_warps=walk_num_warps(block), num_stages=1,
        divisible_by_16=("parents_ptr", "tokens_ptr", "choice_ptr", "path_ptr", "len_ptr", "committed_ptr"),
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


# ----------------------------------------------------------------------------
# Attention: compiled once per module on the two worker processes
# ----------------------------------------------------------------------------

def _compile_with_options(module, name, signature, constexprs, arch, num_warps, num_stages, divisible, maxnreg):
    """:func:`gpu_compile.compile_for_gpu`'s compile step with ``maxnreg`` (runs where Triton compiles); the
    pointers the kernel lists in ``do_not_specialize_on_alignment`` get no divisibility hint
    (:func:`gpu_compile._attrs_for`), as at run time."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = getattr(importlib.import_module(module), name)
    full_sig = {arg: "constexpr" if arg in constexprs else signature[arg] for arg in fn.arg_names}
    attrs = gpu_compile._attrs_for(fn, full_sig, divisible)
    src = gpu_compile._ast_source(fn, full_sig, dict(constexprs), attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    usage = gpu_compile._resource_usage(compiled.asm["cubin"], name)
    return {
        "name": name, "arch": arch, "ptx": compiled.asm["ptx"], "registers": usage["REG"],
        "spill_bytes": usage.get("LOCAL", 0), "stack_bytes": usage.get("STACK", 0),
        "shared_bytes": int(getattr(compiled.metadata, "shared", 0) or 0) + usage.get("SHARED", 0),
    }


def _compile_all(calls, workers=2):
    """Run ``_compile_with_options(*call)`` for every call, ``workers`` at a time; exceptions are returned."""
    results = [None] * len(calls)
    if not gpu_compile._interpreting():
        for i, call in enumerate(calls):
            try:
                results[i] = _compile_with_options(*call)
            except Exception as exc:
                results[i] = exc
        return results
    pending = list(range(len(calls)))
    lock = threading.Lock()

    def drain(worker):
        while True:
            with lock:
                if not pending:
                    return
                i = pending.pop(0)
            try:
                results[i] = worker.call(_compile_with_options, *calls[i])
            except Exception as exc:
                results[i] = exc

    threads = [threading.Thread(target=drain, args=(w,)) for w in gpu_compile._live_workers(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


ATTENTION_INTS = ["stride_qb", "stride_qh", "stride_qt", "stride_kb", "stride_kh", "stride_ks", "stride_vb",
                  "stride_vh", "stride_vs", "stride_bits_b", "stride_bits_row", "stride_pos_b", "stride_pos",
                  "stride_prefix_b", "stride_ob", "stride_oh", "stride_ot", "n_tree", "prefix_len", "window",
                  "n_kv_heads", "group"]
# Multiples of 16 at real shapes (head_dim 64/128/256 strides; the batch strides are 0 for one row and
# multiples of the head dim else); never a do_not_specialize int.
ALIGNED = ["stride_qb", "stride_qh", "stride_qt", "stride_kb", "stride_kh", "stride_ks", "stride_vb", "stride_vh",
           "stride_vs", "stride_ob", "stride_oh", "stride_ot"]
UNIT_STRIDES = {"stride_qd": 1, "stride_kd": 1, "stride_vd": 1, "stride_bits_word": 1, "stride_od": 1}
# The batch strides of K / V when the cache [b, L, 2, Hkv, S_max, D] holds 2^31 elements or more: i64 arguments.
WIDE_BATCH_STRIDES = ("stride_kb", "stride_vb")


def attention_call(arch, dtype, head_dim, cfg, chain, window, split, group=4, softcap=False, sinks=False,
                   prefix_in_memory=False, wide_batch=False, kv_heads=8):
    ptr = f"*{TRITON_TYPE[dtype]}"
    sig = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "out_ptr": ptr, "bits_ptr": "*i32", "pos_ptr": "*i64",
           "prefix_ptr": "*i64",
           "sinks_ptr": ptr if sinks else "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
           "qk_scale": "fp32", "softcap_scale": "fp32"}
    sig.update({name: "i32" for name in ATTENTION_INTS})
    if wide_batch:
        sig.update({name: "i64" for name in WIDE_BATCH_STRIDES})
    constexprs = dict(UNIT_STRIDES, HEAD_DIM=head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                      BLOCK_D=cfg["BLOCK_D"], CHAIN=chain, WINDOW=window, SPLIT_KEYS=split, HAS_SOFTCAP=softcap,
                      HAS_SINKS=sinks, DOT_FP32=False, INPUT_PRECISION=_input_precision(dtype),
                      PREFIX_IN_MEMORY=prefix_in_memory, UNMASKED_PREFIX=cfg.get("UNMASKED_PREFIX", True))
    for name, value in (("group", group), ("n_kv_heads", kv_heads)):
        if value == 1:  # the runtime specializes an int equal to 1
            del sig[name]
            constexprs[name] = 1
    return ("dflash_kernels.tree_attention", "_tree_attention_kernel", sig, constexprs, arch, cfg["num_warps"],
            cfg["num_stages"], tuple(ALIGNED), cfg.get("maxnreg"))


def _flags(chain, window, split, group=4, softcap=False, sinks=False, prefix_in_memory=False, wide_batch=False,
           kv_heads=8):
    return (f"{'chain' if chain else 'tree'}{'-window' if window else ''}-{'split' if split else 'whole'}-G{group}"
            f"{'-softcap' if softcap else ''}{'-sinks' if sinks else ''}{'-prefixmem' if prefix_in_memory else ''}"
            f"{'-i64batch' if wide_batch else ''}{'-Hkv1' if kv_heads == 1 else ''}")


def _case(arch, dtype, head_dim, cfg, chain, window, split, group=4, softcap=False, sinks=False,
          prefix_in_memory=False, wide_batch=False, kv_heads=8):
    """``(arch, dtype, head_dim, cfg, chain, window, split, group, softcap, sinks, prefix_in_memory,
    wide_batch, kv_heads)``, :func:`attention_call`'s arguments."""
    return (arch, dtype, head_dim, cfg, chain, window, split, group, softcap, sinks, prefix_in_memory, wide_batch,
            kv_heads)


def _case_id(case):
    arch, dtype, head_dim, cfg = case[:4]
    return f"sm{arch}-{TRITON_TYPE[dtype]}-D{head_dim}-M{cfg['BLOCK_M']}-N{cfg['BLOCK_N']}-{_flags(*case[4:])}"


ATTENTION_CASES = []
for _arch in ARCHS:
    for _dtype in (torch.bfloat16, torch.float16, torch.float32):
        for _d in (64, 128, 256):
            if _dtype == torch.float16 and _d != 128:
                continue  # fp16 shares every line with bf16; checked at the target's head dim
            for _cfg in tree_attention_configs(_d, _dtype, _arch):
                # Every config: the heaviest variant (bitmask + window + split) and the
                # two lightest (chain / tree, whole), whose loops ptxas allocates differently.
                variants = [(False, True, True), (True, False, False), (False, False, False)]
                if _dtype == torch.float16:
                    variants = variants[:1]
                for _chain, _window, _split in variants:
                    ATTENTION_CASES.append(_case(_arch, _dtype, _d, _cfg, _chain, _window, _split))
                if _dtype != torch.float16:  # the heaviest softcap / sinks variant (fp16: the bf16 code)
                    ATTENTION_CASES.append(_case(_arch, _dtype, _d, _cfg, False, True, True, 4, True, True))
                    # ... and with the committed lengths read from memory (the static op)
                    ATTENTION_CASES.append(_case(_arch, _dtype, _d, _cfg, False, True, True, 4, True, True, True))
                    # ... and so over a cache of 2^31 elements or more (K/V batch strides are i64 arguments)
                    ATTENTION_CASES.append(_case(_arch, _dtype, _d, _cfg, False, True, True, 4, True, True, True,
                                                 True))
    # Every flag combination at Qwen3-8B's T = 65 tile (D 128, bf16, 64 rows), and MHA (G = 1).
    _cfg = next(c for c in tree_attention_configs(128, torch.bfloat16, _arch) if c["BLOCK_M"] == 64)
    for _chain in (False, True):
        for _window in (False, True):
            for _split in (False, True):
                for _mem in (False, True):
                    case = _case(_arch, torch.bfloat16, 128, _cfg, _chain, _window, _split, 4, False, False, _mem)
                    if case not in ATTENTION_CASES:
                        ATTENTION_CASES.append(case)
    for _chain in (False, True):
        ATTENTION_CASES.append(_case(_arch, torch.bfloat16, 128, _cfg, _chain, False, False, 1))
    # The T = 257 tile (1028 rows: 128 rows, 64-key tiles on sm_90): every chain / split / prefix-in-memory
    # combination without a window (the variants whose whole prefix tiles run unmasked).
    _tile128 = next(c for c in tree_attention_configs(128, torch.bfloat16, _arch) if c["BLOCK_M"] == 128)
    for _chain in (False, True):
        for _split in (False, True):
            for _mem in (False, True):
                case = _case(_arch, torch.bfloat16, 128, _tile128, _chain, False, _split, 4, False, False, _mem)
                if case not in ATTENTION_CASES:
                    ATTENTION_CASES.append(case)
    # softcap + sinks unsplit (sink-initialized softmax, normalized store) and in chain mode, at the T = 65 tile
    ATTENTION_CASES.append(_case(_arch, torch.bfloat16, 128, _cfg, False, True, False, 4, True, True))
    ATTENTION_CASES.append(_case(_arch, torch.bfloat16, 128, _cfg, True, True, True, 4, True, True))
    # A batched static step over a big cache (i64 K/V batch strides), chain / tree, whole / split, at the T = 65
    # tile; at the 32-row one (the tightest bf16 tile on sm_90) with both batch stride widths.
    _tile32 = next(c for c in tree_attention_configs(128, torch.bfloat16, _arch) if c["BLOCK_M"] == 32)
    for _tile, _wides in ((_cfg, (True,)), (_tile32, (False, True))):
        for _chain in (False, True):
            for _split in (False, True):
                for _wide in _wides:
                    ATTENTION_CASES.append(_case(_arch, torch.bfloat16, 128, _tile, _chain, False, _split, 4, False,
                                                 False, True, _wide))
    # One kv head (G = 8: the runtime specializes n_kv_heads = 1, the batch row is the grid's axis 1 itself).
    for _chain in (False, True):
        ATTENTION_CASES.append(_case(_arch, torch.bfloat16, 128, _cfg, _chain, False, False, 8, False, False, True,
                                     False, 1))

MERGE_CASES = [(arch, dtype, d, sinks) for arch in ARCHS for dtype in (torch.bfloat16, torch.float32)
               for d in (64, 128, 256) for sinks in (False, True) if not (sinks and dtype == torch.float32)]


def merge_call(arch, dtype, head_dim, sinks=False):
    sig = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "sinks_ptr": f"*{TRITON_TYPE[dtype]}",
           "out_ptr": f"*{TRITON_TYPE[dtype]}", "n_tree": "i32", "n_kv_heads": "i32", "group": "i32",
           "num_splits": "i32", "stride_ob": "i32", "stride_oh": "i32", "stride_ot": "i32"}
    constexprs = {"stride_od": 1, "HEAD_DIM": head_dim, "BLOCK_M": MERGE_BLOCK_M, "BLOCK_D": head_dim,
                  "HAS_SINKS": sinks}
    return ("dflash_kernels.tree_attention", "_merge_splits_kernel", sig, constexprs, arch, MERGE_NUM_WARPS, 1,
            ("stride_ob", "stride_oh", "stride_ot"), None)


@pytest.fixture(scope="module")
def compiled():
    calls = [attention_call(*case) for case in ATTENTION_CASES] + [merge_call(*case) for case in MERGE_CASES]
    results = _compile_all(calls)
    return dict(zip([_case_id(c) for c in ATTENTION_CASES] + [("merge",) + c for c in MERGE_CASES], results))


def _result(compiled, key):
    result = compiled[key]
    if isinstance(result, Exception):
        raise result
    return result


def test_signatures_match_the_runtime_specialization():
    assert not set(ALIGNED) & set(TREE_ATTENTION_DYNAMIC_INTS)
    assert set(TREE_ATTENTION_DYNAMIC_INTS) <= set(ATTENTION_INTS)
    assert set(MERGE_DYNAMIC_INTS) <= {"n_tree", "n_kv_heads", "group", "num_splits"}
    assert len({_case_id(c) for c in ATTENTION_CASES}) == len(ATTENTION_CASES)
    call = attention_call(90, torch.bfloat16, 128, tree_attention_configs(128, torch.bfloat16)[0], False, False, False)
    assert set(_tree_attention_kernel.arg_names) == set(call[2]) | set(call[3])
    # the static op's variant (prefix read from memory) is compiled at every head dim of both float widths
    every_dim = {(dt, d) for dt in (torch.bfloat16, torch.float32) for d in (64, 128, 256)}
    assert {(c[1], c[2]) for c in ATTENTION_CASES if c[10]} == every_dim
    # ... and so is its batched form over a cache past 2^31 elements (i64 batch strides)
    assert {(c[1], c[2]) for c in ATTENTION_CASES if c[11]} == every_dim
    wide = attention_call(*_case(90, torch.bfloat16, 128, tree_attention_configs(128, torch.bfloat16)[0], False,
                                 False, False, wide_batch=True))
    assert {name for name, ty in wide[2].items() if ty == "i64"} == set(WIDE_BATCH_STRIDES)
    call = merge_call(90, torch.bfloat16, 128)
    assert set(_merge_splits_kernel.arg_names) == set(call[2]) | set(call[3])


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[_case_id(c) for c in ATTENTION_CASES])
def test_tree_attention_kernel(compiled, case):
    arch, dtype, head_dim, cfg = case[:4]
    result = _result(compiled, _case_id(case))
    check_resources(result, arch)
    ptx = result["ptx"]
    if cfg["num_stages"] > 1:
        elem = torch.finfo(dtype).bits // 8
        kv_tile_bytes = 2 * cfg["BLOCK_N"] * cfg["BLOCK_D"] * elem
        assert "cp.async" in ptx and result["shared_bytes"] >= (cfg["num_stages"] - 1) * kv_tile_bytes, (
            f"the K/V loads are not pipelined ({result['shared_bytes']} B of shared memory)"
        )
    if dtype != torch.float32:
        if arch == 90 and cfg["BLOCK_M"] >= 64:
            assert "wgmma" in ptx, "the 64/128-row bf16/fp16 tiles should use Hopper's wgmma"
        else:
            assert "mma.sync" in ptx, "bf16/fp16 attention must run on tensor cores"
        if arch == 90 and cfg["BLOCK_M"] == 128:
            # one warpgroup per 64 rows: the scores of a whole key tile are one m64n{BLOCK_N} wgmma chain
            assert f"m64n{cfg['BLOCK_N']}k16" in ptx and cfg["BLOCK_N"] == 64, "128-row tiles: m64n64 scores"


@pytest.mark.parametrize("arch,dtype,head_dim,sinks", MERGE_CASES,
                         ids=[f"sm{a}-{TRITON_TYPE[d]}-D{h}{'-sinks' if s else ''}" for a, d, h, s in MERGE_CASES])
def test_merge_splits_kernel(compiled, arch, dtype, head_dim, sinks):
    check_resources(_result(compiled, ("merge", arch, dtype, head_dim, sinks)), arch)


def test_compile_hints_follow_the_runtime_alignment_rules():
    """A pointer a kernel lists in ``do_not_specialize_on_alignment`` (a device scalar such as the committed
    length, the seed or the compaction count; a slice at any offset) gets no 16-byte hint in these compile
    tests, since the runtime never gives it one; every other pointer does, as an aligned allocation gets."""
    from dflash_kernels.kv_compaction import UNALIGNED_PTRS as KV_UNALIGNED, _compact_kv_kernel
    from dflash_kernels.gated_delta import REPLAY_UNALIGNED_PTRS, _gated_delta_replay_kernel
    from dflash_kernels.lm_head import UNALIGNED_PTRS as LM_UNALIGNED, _argmax_kernel

    cases = [(_tree_attention_kernel, TREE_ATTENTION_UNALIGNED_PTRS), (_merge_splits_kernel, MERGE_UNALIGNED_PTRS),
             (_argmax_kernel, LM_UNALIGNED["_argmax_kernel"]), (_compact_kv_kernel, KV_UNALIGNED),
             (_gated_delta_replay_kernel, REPLAY_UNALIGNED_PTRS)]
    for kernel, unaligned in cases:
        assert set(unaligned) <= set(gpu_compile.unaligned_pointers(kernel)), kernel.__name__
        signature = {a: "*fp32" if a.endswith("_ptr") else "i32" for a in kernel.arg_names}
        hinted = {kernel.arg_names[i] for (i,) in gpu_compile._attrs_for(kernel, signature, ())}
        pointers = {a for a in kernel.arg_names if a.endswith("_ptr")}
        assert hinted == pointers - set(unaligned), kernel.__name__
