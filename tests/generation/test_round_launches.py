"""Launches of one eager tree-verify round, per layer and per round, against the plain-torch round.

The round is ``bench/gpu_round_latency.py``'s (``our_round``: the adapter's pass over a 257-row DDTree, the
fused head, the device walk, the compaction, the features; ``plain_round``: what a transformers user writes,
a dense tree mask and a DynamicCache) on its tiny Qwen3 shape (fp32, CPU, reference backend), counted by
its :class:`RoundLaunches` (``dflash.benchmark.launches.LaunchCounter``: every aten op that computes is one
kernel launch of an eager GPU round). Per layer is what two more decoder layers add, halved; per round the
rest.

Our bounds are what the round does now. A layer runs 26 ops: 4 RMSNorms (one op each on the CPU,
:mod:`dflash.target.norms`), 7 linears, the rotary embedding in 8 (:mod:`dflash.target.rope`; the model's
own function runs 10), the K/V write (2), the attention (1), the MLP's activation and product (2) and the
residual adds (2). Before the pass shared its visibility mask and signed sine table among its layers, a
layer ran 39 (the mask rebuilt per layer: about ten; the rotary embedding two more) and a 4-layer round 272
ops (now 233). The per-round part grew from 116 to 129 by what moved out of the layers (the mask, once; the
sine table, two ops), and is mostly the tree bits and the walk on the reference backend.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import dflash_kernels

ROOT = Path(__file__).resolve().parents[2]

#: ops inside one decoder layer / outside the layers, of our eager 257-row tree round (see the docstring)
PER_LAYER, PER_ROUND = 26, 129
PREFIX, BLOCK, BUDGET = 48, 16, 256


def _bench():
    name = "bench_gpu_round_latency"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "gpu_round_latency.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _round_launches(layers: int):
    """``(ours, plain)``: :meth:`RoundLaunches.summary` of one eager 257-row tree round of each path, on a
    tiny Qwen3 of ``layers`` decoder layers capturing layers 0 and 1 (the rounds' second run: the first
    warms up)."""
    from transformers import DynamicCache

    from dflash.target import TargetAdapter

    bench = _bench()
    model = bench.build_target(bench.TINY, layers, torch.float32, torch.device("cpu"))
    prompt = torch.randint(0, bench.TINY["vocab_size"], (PREFIX,), generator=torch.Generator().manual_seed(2))
    [tree] = [s for s in bench.make_scenarios(BLOCK, [BUDGET], bench.TINY["vocab_size"], PREFIX) if not s.chain]
    tree.to(torch.device("cpu"))
    assert tree.ids_d.numel() == BUDGET + 1
    captured = [0, 1]
    with dflash_kernels.force_backend("reference"), torch.inference_mode():
        with TargetAdapter(model, captured) as adapter:
            cache = adapter.new_cache(PREFIX + BUDGET + 8)
            adapter.prefill(prompt, cache)
            bench.our_round(adapter, cache, tree)
            ours = bench.count_launches(lambda: bench.our_round(adapter, cache, tree), adapter.layers)
        dyn = DynamicCache(config=model.config)
        model(input_ids=prompt[None], **{bench._cache_keyword(model): dyn, "use_cache": True})
        bench.plain_round(model, dyn, captured, tree, BLOCK - 1)
        plain = bench.count_launches(lambda: bench.plain_round(model, dyn, captured, tree, BLOCK - 1),
                                     model.model.layers)
    return ours, plain


@pytest.fixture(scope="module")
def launches():
    return {layers: _round_launches(layers) for layers in (2, 4)}


def _split(launches, path: int):
    """``(per layer, per round)`` of one path (0 ours, 1 plain) by the difference of the 2- and 4-layer rounds."""
    two, four = launches[2][path]["total"], launches[4][path]["total"]
    per_layer = (four - two) / 2
    return per_layer, two - 2 * per_layer


def test_tree_round_launches_per_layer_and_per_round_stay_at_their_bounds(launches):
    per_layer, per_round = _split(launches, 0)
    assert per_layer <= PER_LAYER, f"{per_layer} ops per decoder layer, bound {PER_LAYER}"
    assert per_round <= PER_ROUND, f"{per_round} ops per round outside the layers, bound {PER_ROUND}"
    assert launches[4][0]["total"] <= 4 * PER_LAYER + PER_ROUND


def test_our_layers_launch_no_more_than_the_plain_path_layers(launches):
    ours, _ = _split(launches, 0)
    plain, _ = _split(launches, 1)
    assert ours <= plain, f"ours: {ours} ops per layer, the plain path's {plain}"
    # what runs inside a layer's forward, counted by the forward hooks, agrees: the layer itself, no more
    assert launches[4][0]["per_layer"] <= plain


def test_our_round_work_outside_the_layers_does_not_grow_with_the_layers(launches):
    """Everything of our round that scales with the layers runs inside them (the compaction and the features
    are one op for every layer): the hooks' split and the difference of two layer counts agree."""
    assert launches[2][0]["per_round"] == launches[4][0]["per_round"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, T, heads, kv_heads, D", [(1, 7, 4, 2, 16), (2, 5, 3, 1, 6), (1, 1, 2, 2, 130)])
def test_rotary_pair_is_the_models_rotary_embedding_bit_for_bit(dtype, b, T, heads, kv_heads, D):
    """:func:`dflash.target.rope.rotate_pair` against transformers' canonical function on the projections'
    transposed layout: the same bits (signed zeros and infinities included) and the same strides."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from dflash.target.rope import rotate_pair

    g = torch.Generator().manual_seed(T * D)
    q = (torch.randn(b, T, heads, D, generator=g) * 3).to(dtype).transpose(1, 2)
    k = (torch.randn(b, T, kv_heads, D, generator=g) * 3).to(dtype).transpose(1, 2)
    q[..., 0, 0], k[..., -1, -1] = -0.0, float("inf")
    angles = torch.randn(b, T, D, generator=g) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    sin[..., 0] = 0.0
    for want, got in zip(apply_rotary_pos_emb(q, k, cos, sin), rotate_pair(q, k, cos, sin)):
        assert got.stride() == want.stride()
        bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
        assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits))
