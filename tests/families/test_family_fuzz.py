"""Property-based fuzz: any family x layer count x head layout x window x block x budget x prompt x backend is lossless.

Hypothesis draws a tiny random target of one of the nine families
(tests/tiny_models.py ``tiny_family_target``) with 1-3 layers, a GQA layout
(kv heads 1/2/4, 1-4 query heads per kv head, head dims 4-16), a window of
2-8 positions (window 1 is tested against the no-cache forward: transformers'
own ``generate()`` is wrong there), a prompt of 1-20 tokens, and a method (ar / dflash / ddtree)
with a block size of 2-6 and a tree budget of 1-80 (up to past the
vocabulary of 64), on the reference ops or the Triton kernels (interpreter:
smaller trees, fewer tokens); the output must equal ``target.generate()``
greedy token for token. A failing example is printed by hypothesis (the
drawn arguments), and reproduces with ``@example(...)``.

Bounded to about two minutes on two loaded cores: ``FUZZ_EXAMPLES`` examples,
no deadline (the interpreter's time per example varies).
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dflash
import dflash_kernels
from tiny_models import FAMILY_NAMES, RiggedDraft, tiny_draft, tiny_family_target

VOCAB = 64
FUZZ_EXAMPLES = int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "60"))

# families whose config derives head_dim from hidden_size / heads (no head_dim argument)
_DERIVED_HEAD_DIM = ("qwen2", "phi3")


@st.composite
def cases(draw):
    family = draw(st.sampled_from(FAMILY_NAMES))
    backend = draw(st.sampled_from(["reference", "reference", "triton"]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * group
    if family in _DERIVED_HEAD_DIM or family == "gemma3":
        hidden = 32 if heads <= 8 else 64  # gemma3 also needs hidden % heads == 0
    else:
        hidden = 32
    head_dim = hidden // heads if family in _DERIVED_HEAD_DIM else draw(st.sampled_from([4, 8, 16]))
    method = draw(st.sampled_from(["ar", "dflash", "ddtree"]))
    triton = backend == "triton"
    return dict(
        family=family, backend=backend, layers=draw(st.integers(1, 3)), kv_heads=kv_heads, heads=heads,
        hidden=hidden, head_dim=head_dim, window=draw(st.integers(2, 8)), method=method,
        block_size=draw(st.integers(2, 6)), budget=draw(st.integers(1, 12 if triton else 80)),
        prompt_len=draw(st.integers(1, 20)), new_tokens=draw(st.integers(4, 8 if triton else 20)),
        rigged=draw(st.booleans()), seed=draw(st.integers(0, 3)),
    )


def _backend(name):
    if name == "triton" and "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    return dflash_kernels.force_backend(name)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_any_family_and_shape_is_lossless(case):
    target = tiny_family_target(case["family"], layers=case["layers"], hidden=case["hidden"], vocab=VOCAB,
                                heads=case["heads"], kv_heads=case["kv_heads"], head_dim=case["head_dim"],
                                window=case["window"], seed=case["seed"])
    g = torch.Generator().manual_seed(case["seed"])
    prompt = torch.randint(0, VOCAB - 1, (case["prompt_len"],), generator=g).tolist()
    n = case["new_tokens"]
    with torch.inference_mode():
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    draft = None
    if case["method"] != "ar":
        layers = case["layers"]
        draft = tiny_draft(target, block_size=case["block_size"], target_layer_ids=[0, layers - 1])
        if case["rigged"]:
            draft = RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.7,
                                second_right=case["method"] == "ddtree", seed=case["seed"])
    kw = dict(tree_budget=case["budget"]) if case["method"] == "ddtree" else {}
    with _backend(case["backend"]):
        out = dflash.generate(target, draft, prompt, method=case["method"], max_new_tokens=n, **kw)
    assert out.output_ids.tolist() == ref.tolist(), f"not lossless: {case}"


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2", "gpt_oss"])
def test_window_of_one_matches_the_models_full_forward(family):
    """A window of 1 (each token sees itself only): transformers' ``generate()`` keeps ``window - 1 = 0`` cached
    rows and disagrees with its own full forward there, so the reference is greedy decoding by full forwards."""
    target = tiny_family_target(family, layers=2, vocab=VOCAB, window=1)
    ids = [53, 7, 19]
    with torch.inference_mode():
        for _ in range(8):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    draft = tiny_draft(target, block_size=3, target_layer_ids=[0, 1])
    with dflash_kernels.force_backend("reference"):
        for method in ("ar", "dflash", "ddtree"):
            out = dflash.generate(target, None if method == "ar" else draft, ids[:3], method=method, max_new_tokens=8)
            assert out.output_ids[0].tolist() == ids, method
