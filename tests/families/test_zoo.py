"""The family zoo: every causal-LM family of the installed transformers, lossless or refused by name.

The families are enumerated from transformers' causal-LM auto mapping when the
tests are collected (``tests/zoo.py``), so a new transformers release is
covered without editing a list. Each is built tiny from its own config class
and runs ``ar``, ``dflash`` and ``ddtree`` on the reference ops against its own
greedy ``generate()``; a sample of families whose passes differ in kind runs on
the Triton kernels too (the interpreter on a CPU). A family must end:

* lossless: all three methods equal ``generate()`` token for token, or
* refused: :class:`~dflash.target.UnsupportedTargetFeature` /
  :class:`~dflash.target.TargetStructureError` naming what is missing.

A different token or any other exception fails. A family the zoo cannot build
tiny (or whose own ``generate()`` fails on the tiny build) must be listed in
:data:`UNBUILDABLE` with its reason, or the test fails. Each family's ending is
also held to ``tests/fixtures/zoo_status.json`` on the transformers release
that wrote it (the README's table of supported targets is generated from it,
and ``test_readme_lists_every_family`` keeps the two equal); a family whose
ending changes fails until the fixture is rewritten on purpose
(``python tests/zoo.py --write``, then ``python tests/zoo.py --readme``).
"""

import json
import os

import pytest
import torch
import transformers

import dflash_kernels
from zoo import UNBUILDABLE, build_or_reason, run_family, short_reason, zoo_families

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "zoo_status.json")
README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")

#: Families the Triton interpreter runs too (one per kind of pass: decoder layers that drop the attention keywords
#: (StableLM, Nemotron), windows read from layer types, attention sinks on a family outside the table, an attention
#: softcap read by its transformers name (VaultGemma), a final-logit softcap with a norm on the embeddings, K/V
#: shapes per layer: Gemma 4's 512-dim global heads past the kernel, MiMo-V2-Flash's doubled sliding K/V heads).
TRITON_SAMPLE = ("stablelm", "nemotron", "exaone4", "granite_swa", "vaultgemma", "nanochat", "gemma4_text",
                 "mimo_v2_flash")

FAMILIES = zoo_families()


def _fixture():
    with open(FIXTURE) as f:
        return json.load(f)


def _ending(model_type, class_name, backend="reference"):
    model, reason = build_or_reason(model_type, class_name)
    if model is None:
        return "unbuildable", reason
    with dflash_kernels.force_backend(backend):
        status, detail = run_family(model, n=12 if backend == "reference" else 6)
    return status, detail


@pytest.mark.parametrize("model_type,class_name", FAMILIES, ids=[m for m, _ in FAMILIES])
def test_family_is_lossless_or_refused_by_name(model_type, class_name):
    status, detail = _ending(model_type, class_name)
    if status == "unbuildable":
        assert model_type in UNBUILDABLE, (f"{model_type} ({class_name}) cannot be built tiny: {detail}. List it in "
                                           "UNBUILDABLE with the reason, or teach tests/zoo.py its knobs")
        return
    assert status in ("lossless", "refused"), f"{model_type} ({class_name}): {status}: {detail}"
    if status == "refused":
        assert "cannot be used as a target" in detail, detail
    fixture = _fixture()
    want = fixture["families"].get(model_type)
    if want is not None and fixture["transformers"] == transformers.__version__:
        assert [status, short_reason(detail)] == want, (
            f"{model_type} ended {status} ({short_reason(detail)}), the fixture says {want}: rewrite the fixture "
            "(python tests/zoo.py --write) and the README table if the change is meant")


@pytest.mark.parametrize("model_type", TRITON_SAMPLE)
def test_family_sample_on_the_kernels(model_type):
    if "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is off)")
    classes = dict(FAMILIES)
    if model_type not in classes:
        pytest.skip(f"{model_type} is not in this transformers' causal-LM mapping")
    status, detail = _ending(model_type, classes[model_type], backend="triton")
    assert status == "lossless", f"{model_type}: {status}: {detail}"


def test_readme_lists_every_family():
    """The README's supported-targets table is the fixture's, row for row (``python tests/zoo.py --readme``)."""
    from zoo import readme_table

    text = open(README).read()
    start, end = "<!-- zoo table start -->", "<!-- zoo table end -->"
    assert start in text and end in text, "the README lost its zoo table markers"
    table = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert table == readme_table(_fixture()).strip(), "README's zoo table is stale: python tests/zoo.py --readme"
