"""Command line: demo and generate run end to end and print what they promise; bad arguments print one line and
exit 2 (no traceback, unless --debug); generate reads its prompt from --prompt, a file or stdin, applies the
tokenizer's chat template and streams text."""

import io
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


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_target("qwen3", layers=6, vocab=258)
    target.save_pretrained(root / "t")
    (root / "t" / "tokenizer_config.json").write_text(json.dumps({"type": "byte", "vocab_size": 258}))
    tiny_draft(target, block_size=4).save_pretrained(root / "d")
    tiny_draft(tiny_target("qwen3", layers=4, vocab=258), block_size=4).save_pretrained(root / "d4")
    return root


def pair_args(dirs, draft="d"):
    return ["--target", str(dirs / "t"), "--draft", str(dirs / draft)]


@pytest.mark.parametrize("method,budget", [("dflash", "8"), ("ddtree", "8"), ("ddtree", "auto")])
def test_demo_prints_text_tau_speed_and_speedup(capsys, method, budget):
    assert main(["demo", "--max-new-tokens", "24", "--method", method, "--tree-budget", budget]) == 0
    out = capsys.readouterr().out
    for key in ("tau", "tokens/s", "speedup", "lossless          yes"):
        assert key in out, key


def test_generate_from_local_directories(dirs, capsys):
    rc = main(["generate", *pair_args(dirs), "--prompt", "def f(x):", "--max-new-tokens", "10", "--method", "ddtree",
               "--tree-budget", "4"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "[ddtree] tau" in captured.err


def one_error_line(capsys, needle):
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert "error:" in lines[0] and needle in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize("extra,needle", [
    (["--tree-budget", "0"], "--tree-budget must be an int >= 1 (draft nodes per round) or 'auto'"),
    (["--tree-budget", "lots"], "--tree-budget must be an int >= 1 (draft nodes per round) or 'auto'"),
    (["--block-size", "1"], "--block-size must be >= 2"),
    (["--method", "beam"], "invalid choice: 'beam'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--target", "/nonexistent/t", "--draft", "/nonexistent/d"], "no such directory"),
    (["--target", "/tmp"], "give both --target and --draft"),
    (["--top-k", "-1", "--do-sample"], "--top-k must be >= 0"),
    (["--acceptance", "maybe"], "invalid choice: 'maybe'"),
    (["--method", "ddtree", "--acceptance", "rejection"], "not to method 'ddtree'"),
])
def test_bad_arguments_print_one_line_and_exit_2(capsys, extra, needle):
    assert main(["generate", "--prompt", "x", "--max-new-tokens", "4", *extra]) == 2
    one_error_line(capsys, needle)


def test_a_drafter_that_does_not_fit_the_target(dirs, capsys):
    assert main(["generate", *pair_args(dirs, "d4"), "--prompt", "x", "--max-new-tokens", "4"]) == 2
    one_error_line(capsys, "4-layer target")


def test_debug_shows_the_traceback(dirs):
    with pytest.raises(Exception, match="4-layer target"):
        main(["generate", *pair_args(dirs, "d4"), "--prompt", "x", "--max-new-tokens", "4", "--debug"])


def test_unknown_command_exits_2(capsys):
    assert main(["frobnicate"]) == 2
    one_error_line(capsys, "frobnicate")


def test_generate_reads_stdin_and_prompt_files(dirs, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("sys.stdin", io.StringIO("def g(y):"))
    assert main(["generate", *pair_args(dirs), "--max-new-tokens", "8"]) == 0
    from_stdin = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["generate", *pair_args(dirs), "--prompt", "def g(y):", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == from_stdin  # the same continuation, streamed to stdout
    (tmp_path / "p.txt").write_text("def g(y):")
    assert main(["generate", *pair_args(dirs), "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == from_stdin
    assert main(["generate", *pair_args(dirs), "--max-new-tokens", "8"]) == 2  # empty stdin, no prompt
    one_error_line(capsys, "no prompt")


def test_generate_applies_the_chat_template_and_decodes_with_the_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<user>", "<bot>"] + [f"w{i}" for i in range(90)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", chat_template=template)
    target = tiny_target("qwen3", layers=3, hidden=32, vocab=len(words))
    target.save_pretrained(tmp_path / "t")
    fast.save_pretrained(tmp_path / "t")
    tiny_draft(target, block_size=4, target_layer_ids=[0, 1]).save_pretrained(tmp_path / "d")
    args = ["generate", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--prompt", "w5 w6",
            "--max-new-tokens", "6"]
    assert main(args) == 0
    chat = capsys.readouterr().out.strip()
    ids = fast.apply_chat_template([{"role": "user", "content": "w5 w6"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        ref = target.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
    assert chat == fast.decode(ref.tolist(), skip_special_tokens=True).strip()
    assert main(args + ["--no-chat"]) == 0  # the raw prompt, without the template
    assert main(args[:-4] + ["--prompt", "w5 w6", "--max-new-tokens", "6", "--chat"]) == 0
    assert capsys.readouterr().out.strip().endswith(chat)


def test_demo_drafter_dflash2_needs_the_shipped_drafter(monkeypatch, tmp_path, capsys):
    from dflash.tiny import pair

    monkeypatch.setitem(pair.DRAFTERS, "dflash2", tmp_path / "drafter2")
    assert main(["demo", "--drafter", "dflash2", "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "the tiny DFlash2 drafter is not shipped in this checkout" in err and "drafter2" in err
    assert "Traceback" not in err


def test_drafter_choice_is_for_the_embedded_pair_only(dirs, capsys):
    assert main(["demo", *pair_args(dirs), "--drafter", "dflash2"]) == 2
    assert "--drafter picks an embedded tiny drafter: give it without --target / --draft" in capsys.readouterr().err
    assert main(["demo", "--drafter", "eagle"]) == 2
    assert "invalid choice: 'eagle'" in capsys.readouterr().err


def test_demo_with_the_shipped_dflash2_drafter(capsys):
    assert main(["demo", "--drafter", "dflash2", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "lossless          yes" in out and "tau" in out
