"""Lossless at 32k-token prompts: every family of the table, the hybrids included, against its own ``generate()``.

For each row of :data:`dflash.target.families.FAMILIES` a tiny random model of the family's own transformers class
(fp32; hidden 16, one query head over one K/V head of 8 dims, vocabulary 64; one layer, two where the family's
point is two layer types) with ``max_position_embeddings`` past the prompt, a seeded random 32768-token prompt, and
``dflash.generate`` with ``method="ar"``, ``"dflash"`` and ``"ddtree"`` (a drafter steered to the reference text,
so rounds accept drafts and DDTree's trees branch) must equal ``model.generate(ids, do_sample=False)`` token for
token (``NEW`` new tokens), on the reference ops (the CPU path; the Triton interpreter would take hours here).

Windowed families slide over ``WINDOW`` = 3000 positions: far below the prompt, above our prefill chunk for
such targets (:data:`dflash.target.adapter.MASKED_PREFILL_CHUNK`, 2048 rows), so every window straddles a chunk
boundary and the rows the prompt's last row sees start in an earlier chunk. Mistral / Phi-3 / Qwen3-MoE slide on every layer (one layer);
Qwen2/3, Gemma2 and gpt-oss keep their one sliding layer (the softcap and the sinks on a window); Gemma3 and
Gemma 4 a sliding and a global layer (two rotary tables; Gemma 4: 16-dim global heads, per-layer inputs,
``attention_k_eq_v``, the MoE block; no KV-sharing layer, which would cost two more). Hybrids (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next) keep one Gated-DeltaNet layer (two value heads over one key head) and one attention
layer. The batch test: a left-padded Llama batch of the 32k prompt and a 12k one.

The model's own output is computed once per family (a module fixture shared by the three methods). For the
families whose own prefill would materialize a ``[P, P]`` mask or eager ``[H, P, P]`` scores (sliding windows;
Gemma2 and gpt-oss run eager attention for their softcap and sinks) it runs through transformers' own chunked
prefill, ``generate(..., prefill_chunk_size=REF_CHUNK)``: the ``GenerationConfig`` field of transformers 5.17 and
5.24, run by ``GenerationMixin._prefill`` inside the model's own ``generate()`` (the model's own forward on its
own cache, chunk by chunk; sliding layers on its sliding-window cache). ``REF_CHUNK`` = 3072 is not a multiple
of our 2048-row chunks, so the two prefills cut the prompt at different rows. Families without windows (Llama,
nanochat, the hybrids) prefill in one pass.

Cost: about 125 s on one core (torch 2.13 CPU, transformers 5.24; tests/shard_costs.json books it). A target
without masked layers prefills its 32k rows in one pass (causal SDPA, as its own ``generate()``); a windowed one
in 2048-row chunks whose windowed layers read only their window's keys; Gemma2's softcap and gpt-oss' sinks take
the explicit torch attention over those keys, hence their share.
"""

import pytest
import torch

import dflash
import dflash_kernels
from dflash.target import families
from tiny_models import RiggedDraft, tiny_draft, tiny_family_target, tiny_hybrid_target

pytestmark = pytest.mark.slow  # about 2 minutes on one core (the cost above)

P = 32768
NEW = 12
WINDOW = 3000
REF_CHUNK = 3072
VOCAB = 64
MAX_POS = P + 256
SHORT = 12288  # the batch test's shorter row
SMALL = dict(hidden=16, vocab=VOCAB, heads=1, kv_heads=1, head_dim=8)


def _dense(name, layers=1, **kw):
    return lambda: tiny_family_target(name, layers=layers, window=WINDOW, max_position_embeddings=MAX_POS,
                                      **SMALL, **kw)


def _hybrid(name):
    return lambda: tiny_hybrid_target(name, layers=2, hidden=16, vocab=VOCAB, heads=1, kv_heads=1, head_dim=8,
                                      linear_k_heads=1, linear_v_heads=2, max_position_embeddings=MAX_POS)


def _zoo(model_type, class_name, **kw):
    def build():
        from zoo import build_tiny

        return build_tiny(model_type, class_name, hidden_size=16, intermediate_size=32, num_attention_heads=1,
                          num_key_value_heads=1, head_dim=8, max_position_embeddings=MAX_POS, **kw)
    return build


#: model_type -> (builder, whether its own generate() prefills in chunks of REF_CHUNK)
BUILDERS = {
    "llama": (_dense("llama"), False),
    "qwen2": (_dense("qwen2"), True),
    "qwen3": (_dense("qwen3"), True),
    "mistral": (_dense("mistral"), True),
    "phi3": (_dense("phi3", original_max_position_embeddings=MAX_POS), True),
    "gemma2": (_dense("gemma2"), True),
    "gemma3_text": (_dense("gemma3", layers=2), True),
    "qwen3_moe": (_dense("qwen3_moe"), True),
    # yarn over a quarter of the positions (the factor the config's lengths imply: no mismatch warning)
    "gpt_oss": (_dense("gpt_oss", rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=MAX_POS // 4,
        beta_fast=32.0, beta_slow=1.0, truncate=False)), True),
    "qwen3_5_text": (_hybrid("qwen3_5"), False),
    "qwen3_5_moe_text": (_hybrid("qwen3_5_moe"), False),
    "qwen3_next": (_hybrid("qwen3_next"), False),
    "nanochat": (_zoo("nanochat", "NanoChatForCausalLM", num_hidden_layers=1), False),
    "gemma4_text": (_zoo("gemma4_text", "Gemma4ForCausalLM", num_hidden_layers=2, sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention"], global_head_dim=16,
                         num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True,
                         num_experts=4, top_k_experts=2, moe_intermediate_size=16, final_logit_softcapping=3.0),
                    True),
}


def test_every_family_of_the_table_is_covered():
    assert set(BUILDERS) == set(families.FAMILIES), set(BUILDERS) ^ set(families.FAMILIES)


def _prompt(seed=0, n=P):
    return torch.randint(2, VOCAB - 1, (1, n), generator=torch.Generator().manual_seed(seed))


def _own(target, ids, chunked, n=NEW):
    kw = dict(prefill_chunk_size=REF_CHUNK) if chunked else {}
    with torch.inference_mode():
        return target.generate(ids, max_new_tokens=n, do_sample=False, **kw)


def _divergence(target, ref, got, name):
    """The first differing new token and the model's own logit margin there (its generate() on the common prefix,
    chunked as the reference was): a margin near 0 is a near-tie (numerics), a large one a wrong token."""
    want = ref[0, P:].tolist()
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    kw = dict(prefill_chunk_size=REF_CHUNK) if BUILDERS[name][1] else {}
    with torch.inference_mode():
        z = target.generate(ref[:, :P + i], max_new_tokens=1, do_sample=False, output_logits=True,
                            return_dict_in_generate=True, **kw).logits[0][0].float()
    top = z.topk(2).values
    return (f"new token {i}: generate() {want[i]}, ours {got[i]}; logit margin {z[want[i]] - z[got[i]]:.4g} "
            f"(top-2 gap {top[0] - top[1]:.4g}); ours {got} vs {want}")


@pytest.fixture(scope="module", params=list(BUILDERS))
def case(request):
    build, chunked = BUILDERS[request.param]
    target = build()
    ids = _prompt()
    ref = _own(target, ids, chunked)
    layers = target.config.get_text_config().num_hidden_layers
    draft = tiny_draft(target, block_size=4, layers=1, target_layer_ids=[0, layers - 1])
    return request.param, target, draft, ids, ref


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_lossless_at_32k(case, method):
    name, target, draft, ids, ref = case
    head = target.get_output_embeddings().weight
    kw = {}
    if method == "dflash":
        draft = RiggedDraft(draft, head, ref, p_right=0.75)
    elif method == "ddtree":
        draft = RiggedDraft(draft, head, ref, p_right=0.6, second_right=True)
        kw = dict(tree_budget=8)
    else:
        draft = None
    with dflash_kernels.force_backend("reference"):
        out = dflash.generate(target, draft, ids, method=method, max_new_tokens=NEW, **kw)
    got, want = out.output_ids[0, P:].tolist(), ref[0, P:].tolist()
    assert got == want, f"{name} {method} differs from generate(): {_divergence(target, ref, got, name)}"
    if method != "ar":
        assert max(out.acceptance_lengths) >= 2, out.acceptance_lengths  # drafts accepted, not only bonus tokens


def test_batch_of_a_long_and_a_shorter_row():
    """A left-padded batch of two Llama rows, the 32k prompt and a 12k one (its first 20k columns padding): each
    row of ``dflash`` and ``ddtree`` equals the model's own ``generate()`` on that prompt alone (a random drafter:
    the rows' texts differ, and losslessness does not depend on acceptance)."""
    target = BUILDERS["llama"][0]()
    long, short = _prompt(), _prompt(seed=1, n=SHORT)
    refs = [_own(target, long, False), _own(target, short, False)]
    ids = torch.cat([long, torch.cat([torch.zeros(1, P - SHORT, dtype=long.dtype), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :P - SHORT] = 0
    draft = tiny_draft(target, block_size=4, layers=1, target_layer_ids=[0, 0])
    with dflash_kernels.force_backend("reference"):
        chain = dflash.generate(target, draft, ids, attention_mask=mask, max_new_tokens=NEW)
        tree = dflash.generate(target, draft, ids, attention_mask=mask, method="ddtree", max_new_tokens=NEW,
                               tree_budget=8)
    for r, ref in enumerate(refs):
        assert torch.equal(chain.rows[r].output_ids, ref), f"dflash row {r} differs from generate()"
        assert torch.equal(tree.rows[r].output_ids, ref), f"ddtree row {r} differs from generate()"
