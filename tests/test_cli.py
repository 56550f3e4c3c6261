"""Command line: demo and generate run end to end and print what they promise."""

import json

import pytest
import torch

import dflash_kernels
from dflash.cli import main
from tiny_models import tiny_draft, tiny_target


@pytest.fixture(autouse=True)
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_demo_prints_text_tau_speed_and_speedup(capsys, method):
    assert main(["demo", "--max-new-tokens", "24", "--method", method, "--tree-budget", "8"]) == 0
    out = capsys.readouterr().out
    for key in ("tau", "tokens/s", "speedup", "lossless          yes"):
        assert key in out, key


def test_generate_from_local_directories(tmp_path, capsys):
    target = tiny_target("qwen3", layers=6, vocab=258)
    target.save_pretrained(tmp_path / "t")
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps({"type": "byte", "vocab_size": 258}))
    tiny_draft(target, block_size=4).save_pretrained(tmp_path / "d")
    rc = main(["generate", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--prompt", "def f(x):",
               "--max-new-tokens", "10", "--method", "ddtree", "--tree-budget", "4"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "[ddtree] tau" in captured.err


def test_half_a_pair_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="give both --target and --draft"):
        main(["generate", "--target", str(tmp_path), "--max-new-tokens", "4"])


def test_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit):
        main(["frobnicate"])
