"""Drafter training data (dflash/training/data.py): prompts, greedy continuations, JSONL reading."""

from __future__ import annotations

import json

import pytest
import torch

from dflash.training.data import (DataError, build_greedy_records, greedy_continuations, heldin_prompts,
                                 read_prompts_jsonl, read_training_jsonl, valid_anchor_mask, write_jsonl)
from dflash.tiny.corpus import HELDOUT_PACKAGES, stdlib_files
from dflash.tiny.tokenizer import ByteTokenizer
from tiny_models import tiny_target


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_valid_anchors_need_context_and_a_supervised_block():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    # B=3: anchor a needs mask[a+1], mask[a+2] and a >= 1, a+2 <= 9
    assert valid_anchor_mask(mask, 3).nonzero().flatten().tolist() == [2, 3, 4, 5]
    assert valid_anchor_mask(torch.ones(5, dtype=torch.bool), 4).nonzero().flatten().tolist() == [1]
    assert not valid_anchor_mask(torch.ones(4, dtype=torch.bool), 4).any()  # only anchor 0: no context


def test_heldin_prompts_are_deterministic_line_starts_of_train_files():
    a = heldin_prompts(6, 40, seed=3, following=16)
    assert a == heldin_prompts(6, 40, seed=3, following=16)
    assert a != heldin_prompts(6, 40, seed=4, following=16)
    assert all(len(p) == 40 for p in a)
    train = [p.read_bytes() for p in stdlib_files("train")]
    heldout = b"\n".join(p.read_bytes() for p in stdlib_files("heldout"))
    for p in a:
        chunk = bytes(p)
        assert chunk[:1] not in (b"\n", b"\r")
        assert any(chunk in data for data in train)
    assert HELDOUT_PACKAGES and heldout  # the split exists; prompts come from the other side
    with pytest.raises(ValueError):
        heldin_prompts(1, 0)


def test_greedy_records_are_the_targets_own_argmax_continuations():
    target = tiny_target(layers=2, hidden=32, vocab=96)
    prompts = [torch.randint(0, 90, (10,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    conts = greedy_continuations(target, prompts, 12, batch_size=2)
    for p, c in zip(prompts, conts):
        ids = list(p)
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert c == ids[len(p):]
    records = build_greedy_records(target, prompts, 12, batch_size=3, min_new_tokens=4)
    assert [r["input_ids"] for r in records] == [p + c for p, c in zip(prompts, conts)]
    assert all(r["loss_mask"] == [0] * 10 + [1] * 12 for r in records)
    # a continuation is cut after the end-of-text id; too short ones are dropped
    eos = conts[0][3]
    cut = greedy_continuations(target, prompts[:1], 12, eos_token_id=eos)[0]
    assert cut == conts[0][:conts[0].index(eos) + 1]
    assert build_greedy_records(target, prompts[:1], 12, eos_token_id=eos, min_new_tokens=len(cut) + 1) == []


def test_jsonl_roundtrip_token_ids_and_text(tmp_path):
    path = write_jsonl([{"input_ids": list(range(12)), "loss_mask": [0] * 4 + [1] * 8}], tmp_path / "a.jsonl")
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"text": "héllo, world"}) + "\n")
    seqs = read_training_jsonl(path, vocab_size=258, block_size=4, tokenizer=ByteTokenizer())
    assert [s.line for s in seqs] == [1, 3]
    assert seqs[0].input_ids.tolist() == list(range(12)) and seqs[0].loss_mask.tolist() == [False] * 4 + [True] * 8
    assert seqs[1].input_ids.tolist() == list("héllo, world".encode()) and bool(seqs[1].loss_mask.all())
    cropped = read_training_jsonl(path, 258, 4, ByteTokenizer(), max_length=9)
    assert [s.input_ids.numel() for s in cropped] == [9, 9]
    with pytest.raises(DataError, match="line 3: a text record needs a tokenizer"):
        read_training_jsonl(path, 258, 4)


@pytest.mark.parametrize("content, message", [
    ("", "is empty: no sequences"),
    ("\n\n", "is empty: no sequences"),
    ('{"input_ids": [1, 2, 3, 4, 5]}\n[1, 2]\n', "line 2: expected a JSON object"),
    ('{"input_ids": [1, 2, 3, 4, 5]}\n{"input_ids": [1, 2, 3, 4, 5}\n', "line 2: malformed JSON"),
    ('{"input_ids": [1, -2, 3, 4, 5]}\n', "line 1: token id -2 at index 1"),
    ('{"input_ids": [1, 2, 3, 4, 258]}\n', "line 1: token id 258 at index 4 is outside the vocabulary [0, 258)"),
    ('{"input_ids": [1, 2.5, 3, 4, 5]}\n', "line 1: 'input_ids' must be a list of integer"),
    ('{"input_ids": [1, 2, 3, 4]}\n', "line 1: sequence of 4 tokens is shorter than one block"),
    ('{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [1, 1, 1, 1, 2]}\n', "line 1: 'loss_mask' entries must be 0 or 1"),
    ('{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [1, 1, 1, 0, 1]}\n', "line 1: no block of 4 positions fits"),
    ('{"text": 5}\n', "line 1: 'text' must be a string"),
])
def test_bad_training_data_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as e:
        read_training_jsonl(path, vocab_size=258, block_size=4, tokenizer=ByteTokenizer())
    assert message in str(e.value) and str(path) in str(e.value)


def test_missing_file_and_prompt_reader(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_training_jsonl(tmp_path / "nope.jsonl", 258, 4)
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "def f():"}\n{"input_ids": [1, 2]}\n')
    assert read_prompts_jsonl(path, 258, ByteTokenizer()) == [list(b"def f():"), [1, 2]]
    path.write_text('{"input_ids": []}\n')
    with pytest.raises(DataError, match="line 1: empty prompt"):
        read_prompts_jsonl(path, 258)
