"""Parity with z-lab's ``dflash`` 0.1.0: the same tokens and the same per-round acceptance lengths.

tests/fixtures/zlab_dflash2/ was written by bench/zlab_reference.py in an environment holding z-lab's package
(not this one): a tiny Qwen3 target, a z-lab ``DFlash2DraftModel`` and ``DFlashDraftModel`` saved with their
own ``save_pretrained`` (codebooks named as published), with z-lab's drafter scalars set
(``input_embedding_scale`` 2, ``output_multiplier`` 0.5, DFlash2 ``final_logit_softcapping`` 15), and
``reference.json``: z-lab's greedy ``dflash_generate`` on four prompts, with a stop token and with a length
limit. Here the same checkpoints load into this package and generate through ``dflash.generate``, the
transformers drop-in (``target.generate`` after ``dflash.apply``, and with ``assistant_model=``) and the CLI.

Rounds whose verified block z-lab shortened (the last rounds before ``max_new_tokens``: z-lab drafts a
shorter block there, which changes a bidirectional drafter's proposals; this package always drafts ``B``) are
compared on tokens only; every other round's acceptance length must match.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

import dflash
import dflash_kernels
from dflash import DFlash2DraftModel, DFlashDraftModel
from dflash.cli import main
from dflash.decoding import hf as dropin
from dflash.tiny.tokenizer import ByteTokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "zlab_dflash2"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
B = REFERENCE["block_size"]


@pytest.fixture(autouse=True)
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module")
def target():
    return Qwen3ForCausalLM.from_pretrained(FIXTURE / "target").eval()


@pytest.fixture(scope="module")
def drafters(target):
    return {kind: DFlashDraftModel.from_pretrained(str(FIXTURE / kind), target_config=target.config)
            for kind in ("dflash2", "dflash")}


def runs(kind, scenario=None):
    return [r for r in REFERENCE["drafters"][kind]["runs"] if scenario in (None, r["scenario"])]


def full_rounds(run):
    """z-lab's rounds before the first one that verified a shortened block."""
    sizes = run["verify_sizes"]
    return next((i for i, s in enumerate(sizes) if s < B), len(sizes))


def check(run, output_ids, acceptance_lengths):
    assert list(output_ids) == run["output_ids"], "tokens differ from z-lab's"
    n = full_rounds(run)
    assert list(acceptance_lengths[:n]) == run["acceptance_lengths"][:n], "acceptance lengths differ from z-lab's"
    if n == len(run["verify_sizes"]):
        assert list(acceptance_lengths) == run["acceptance_lengths"]


def test_fixture_exercises_what_it_claims(drafters):
    assert isinstance(drafters["dflash2"], DFlash2DraftModel) and not isinstance(drafters["dflash"],
                                                                                  DFlash2DraftModel)
    d2 = drafters["dflash2"]
    assert (d2.input_embedding_scale, d2.output_multiplier, d2.logit_softcap) == (2.0, 0.5, 15.0)
    # the selector moved many drafted positions off the drafter's argmax; rounds accepted several tokens
    moves = REFERENCE["drafters"]["dflash2"]["selector"]
    assert moves["moved"] >= 0.05 * moves["positions"]
    for kind in ("dflash2", "dflash"):
        assert max(max(r["acceptance_lengths"]) for r in runs(kind)) >= 3
        stopped = [r for r in runs(kind, "stop") if r["output_ids"][-1] == REFERENCE["stop_token_id"]]
        assert len(stopped) >= 2 and all(full_rounds(r) == len(r["verify_sizes"]) for r in stopped)


@pytest.mark.parametrize("kind", ["dflash2", "dflash"])
def test_generate_matches_zlab(target, drafters, kind):
    for run in runs(kind):
        kw = dict(eos_token_id=run["stop_token_ids"]) if run["stop_token_ids"] else {}
        out = dflash.generate(target, drafters[kind], run["prompt"], max_new_tokens=run["max_new_tokens"], **kw)
        check(run, out.output_ids[0].tolist(), out.acceptance_lengths)
        with torch.no_grad():
            plain = target.generate(torch.tensor([run["prompt"]]), max_new_tokens=run["max_new_tokens"],
                                    do_sample=False, **kw)
        assert plain[0].tolist() == run["output_ids"]  # z-lab's output is the target's own, too


def test_compiled_rounds_match_zlab(target, drafters):
    for run in runs("dflash2", "stop")[:2]:
        out = dflash.generate(target, drafters["dflash2"], run["prompt"], max_new_tokens=run["max_new_tokens"],
                              eos_token_id=run["stop_token_ids"], compile="static")
        check(run, out.output_ids[0].tolist(), out.acceptance_lengths)


def test_drop_in_matches_zlab(target, drafters, monkeypatch):
    """The drop-in with method dflash (its default is ddtree) gives z-lab's tokens and acceptance lengths."""
    results = []
    real = dropin.run_generation

    def spy(*a, **k):
        results.append(real(*a, **k))
        return results[-1]

    monkeypatch.setattr(dropin, "run_generation", spy)
    draft = drafters["dflash2"]
    with dflash.apply(target, draft, method="dflash"):
        for run in runs("dflash2"):
            ids = torch.tensor([run["prompt"]])
            kw = dict(eos_token_id=run["stop_token_ids"]) if run["stop_token_ids"] else {}
            out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=run["max_new_tokens"], do_sample=False, **kw)
            check(run, out[0].tolist(), results[-1].acceptance_lengths)
    run = runs("dflash2", "stop")[0]
    ids = torch.tensor([run["prompt"]])
    with dflash.apply(target):  # the drafter as transformers' assistant_model
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                              max_new_tokens=run["max_new_tokens"], do_sample=False,
                              eos_token_id=run["stop_token_ids"])
    check(run, out[0].tolist(), results[-1].acceptance_lengths)
    assert len(results) == len(runs("dflash2")) + 1


def test_cli_matches_zlab(tmp_path, capsys, monkeypatch):
    """``python -m dflash generate`` on the fixture directories: the text of z-lab's tokens, its tau and
    acceptance lengths (the target's generation_config names the stop token, as a user's would)."""
    shutil.copytree(FIXTURE / "target", tmp_path / "target")
    gen = json.loads((tmp_path / "target" / "generation_config.json").read_text())
    gen["eos_token_id"] = REFERENCE["stop_token_id"]
    (tmp_path / "target" / "generation_config.json").write_text(json.dumps(gen))
    streams = []
    real = dflash.stream

    def spy(*a, **k):
        streams.append(real(*a, **k))
        return streams[-1]

    monkeypatch.setattr(dflash, "stream", spy)
    tok = ByteTokenizer()
    for run in runs("dflash2", "stop"):
        text = bytes(run["prompt"]).decode()
        assert main(["generate", "--target", str(tmp_path / "target"), "--draft", str(FIXTURE / "dflash2"),
                     "--prompt", text, "--max-new-tokens", str(run["max_new_tokens"])]) == 0
        captured = capsys.readouterr()
        assert captured.out == tok.decode(run["output_ids"][len(run["prompt"]):]) + "\n"
        lengths = run["acceptance_lengths"]
        assert f"[dflash] tau {sum(lengths) / len(lengths):.2f}," in captured.err
        result = streams[-1].result
        check(run, result.output_ids[0].tolist(), result.acceptance_lengths)
