"""Targets whose layers keep K/V of different shapes: lossless on both backends.

* Gemma 4 (``Gemma4ForCausalLM``): the global layers' heads are ``global_head_dim`` wide (16 here; the zoo's
  default build keeps transformers' 512, past the attention kernel's 256, so those layers take the torch path on
  the Triton backend too), with ``num_global_key_value_heads`` K/V heads; per-layer inputs, KV sharing (the last
  two layers ``reuse`` the K/V their type's ``store`` layer returned from our cache, and keep no slot of their
  own), ``attention_k_eq_v``, the
  MoE block beside the MLP, query scale 1, a final-logit softcap;
* MiMo-V2-Flash: twice the K/V heads on the sliding layers (with sinks), values narrower than the keys
  (``v_head_dim``), so the Triton backend runs its layers on the torch path as well.

The cache pads every layer to the largest ``(Hkv, D)`` and hands layer ``l`` its corner
(:class:`dflash.cache.KVBuffer` ``geometry``); each model runs ``ar``, ``dflash`` and ``ddtree`` against its own
greedy ``generate()`` (one prompt, and a batch of two prompts of different lengths), on the reference ops and on
the Triton kernels (interpreter on a CPU), and the compiled round's pooled storage (``compile="static"``).
"""

import pytest
import torch

import dflash
import dflash_kernels
from dflash.cache import KVBuffer
from dflash.target import TargetAdapter
from tiny_models import tiny_draft
from zoo import PROMPT, build_tiny, greedy, run_family


def _gemma4(global_head_dim=16):
    return build_tiny("gemma4_text", "Gemma4ForCausalLM", num_hidden_layers=4,
                      layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                      attention_k_eq_v=True, global_head_dim=global_head_dim, num_global_key_value_heads=1,
                      enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                      final_logit_softcapping=3.0)


def _mimo():
    return build_tiny("mimo_v2_flash", "MiMoV2FlashForCausalLM", v_head_dim=4)


MODELS = {"gemma4": _gemma4, "gemma4-wide": lambda: _gemma4(512), "mimo_v2_flash": _mimo}


def backend(name):
    if name == "triton" and "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is off)")
    return dflash_kernels.force_backend(name)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return request.param, MODELS[request.param]()


def test_the_models_keep_per_layer_geometries(model):
    name, target = model
    with TargetAdapter(target) as adapter:
        geometry = adapter.spec.kv_geometry
        cache = adapter.new_cache(32)
    assert geometry is not None and len(set(geometry)) > 1, geometry
    assert cache.geometry == geometry
    if name.startswith("gemma4"):
        # the global layer's own K/V head count; the two KV-sharing layers keep no slot
        assert [g[0] for g in geometry] == [2, 1] and adapter.spec.kv_layers == [0, 1]
        assert cache.kv.shape[0] == 2 and cache.kv_slot(1) == 1
        assert target.model.layers[2].self_attn.is_kv_shared_layer
        assert target.model.layers[1].self_attn.v_proj is None  # attention_k_eq_v
    else:
        assert [g[0] for g in geometry] == [4, 2] and all(g[2] == 4 for g in geometry)
        assert adapter.spec.kv_layers == [0, 1]


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_lossless(model, backend_name):
    name, target = model
    with backend(backend_name):
        status, detail = run_family(target, n=12 if backend_name == "reference" else 6)
    assert status == "lossless", (name, detail)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_batch_rows_are_lossless(model, backend_name):
    """Two prompts of 12 and 7 tokens, left-padded: every row of ar, dflash and ddtree is its own greedy text."""
    name, target = model
    n = 10 if backend_name == "reference" else 5
    prompts = [PROMPT, PROMPT[3:10]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    layers = target.config.num_hidden_layers
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, layers - 1])
    with backend(backend_name):
        results = {
            "ar": dflash.generate(target, None, ids, attention_mask=mask, method="ar", max_new_tokens=n),
            "dflash": dflash.generate(target, draft, ids, attention_mask=mask, max_new_tokens=n),
            "ddtree": dflash.generate(target, draft, ids, attention_mask=mask, method="ddtree", max_new_tokens=n,
                                      tree_budget=6),
        }
    for r, prompt in enumerate(prompts):
        ref = greedy(target, n, prompt)
        for method, res in results.items():
            assert torch.equal(res.rows[r].output_ids, ref), f"{name} {method} row {r} differs from generate()"


def test_compiled_round_storage(model):
    """The pooled round (``compile="static"``: the compiled round's caches and steps, called eagerly)."""
    name, target = model
    n = 10
    ref = greedy(target, n)
    layers = target.config.num_hidden_layers
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, layers - 1])
    with backend("reference"):
        for method in ("dflash", "ddtree"):
            kw = dict(tree_budget=8) if method == "ddtree" else {}
            out = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=n, compile="static", **kw)
            assert torch.equal(out.output_ids, ref), (name, method)


def test_kv_buffer_geometry_layout():
    """Slot ``l`` lives in the corner ``[:Hkv_l, :, :D_l]`` (keys) / ``[:Hkv_l, :, :Dv_l]`` (values) of the padded
    storage, eager and round writes alike; the rest stays zero. One geometry keeps the plain layout."""
    geometry = [(2, 4, 4), (1, 8, 2)]
    buf = KVBuffer(2, 2, 8, 16, torch.float32, "cpu", geometry=geometry)
    assert buf.kv.shape == (2, 2, 2, 16, 8)
    k1, v1 = torch.randn(1, 3, 8), torch.randn(1, 3, 2)
    k, v = buf.write(1, k1, v1)
    assert k.shape == (1, 3, 8) and v.shape == (1, 3, 2)
    assert torch.equal(buf.kv[1, 0, :1, :3], k1) and torch.equal(buf.kv[1, 1, :1, :3, :2], v1)
    buf.commit(3)
    buf.freeze()
    k0, v0 = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    k, v = buf.write_rows(0, k0, v0, buf.length_t, buf.key_rows(2))
    assert k.shape == (1, 2, 5, 4)
    assert torch.equal(buf.kv[0, 0, :, 3:5, :4], k0[0]) and torch.equal(buf.kv[0, 1, :, 3:5, :4], v0[0])
    assert buf.kv[0, :, :, :, 4:].abs().sum() == 0 and buf.kv[1, :, 1:].abs().sum() == 0
    assert buf.kv[1, 1, :, :, 2:].abs().sum() == 0
    assert KVBuffer(2, 2, 8, 16, torch.float32, "cpu", geometry=[(2, 8, 8)] * 2).geometry is None


def test_gemma4_bidirectional_attention():
    """``use_bidirectional_attention="vision"`` only changes the multimodal model's mask (Gemma 4's text model is
    causal): lossless; ``"all"`` is refused by name."""
    from dflash.target import UnsupportedTargetFeature

    vision = build_tiny("gemma4_text", "Gemma4ForCausalLM", use_bidirectional_attention="vision")
    assert run_family(vision, n=6, methods=("ar",)) == ("lossless", "")
    both = build_tiny("gemma4_text", "Gemma4ForCausalLM", use_bidirectional_attention="all")
    with pytest.raises(UnsupportedTargetFeature, match="bidirectional attention"):
        TargetAdapter(both)


@pytest.mark.parametrize("name", ["gemma4", "mimo_v2_flash"])
def test_warmup_launches_every_geometry(name):
    """:func:`dflash.warmup` warms the attention kernel at each layer geometry the kernel runs (Gemma 4: 2 K/V
    heads of 8 dims and 1 of 16), so a generation launches nothing new; layers on the torch path launch none."""
    from triton_launches import LaunchKeys

    target = MODELS[name]()
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, target.config.num_hidden_layers - 1])
    kw = dict(method="ddtree", block_size=4, tree_budget=5)
    with backend("triton"):
        with LaunchKeys() as warm:
            dflash.warmup(target, draft, **kw)
        with LaunchKeys() as run:
            dflash.generate(target, draft, PROMPT, max_new_tokens=12, **kw)
    new = run.keys - warm.keys
    assert not new, f"launches the warm-up did not compile: {sorted(new)}"
