"""Target pretraining: measures, schedule, a tiny end-to-end run, and the shipped weights."""

import json
import math

import pytest
import torch

from dflash.tiny.corpus import encode_corpus
from dflash.tiny.pretrain import (
    _lr_at,
    build_target_config,
    ends_in_loop,
    eval_windows,
    greedy_continuations,
    heldout_bits_per_byte,
    main,
    parse_args,
    sample_windows,
    train_target,
)
from dflash.tiny.models import TINY_TARGET_DIR, load_tiny_target, load_tiny_tokenizer

# Measured bits/byte of the shipped target on the 16-window slice below is in
# dflash/assets/tiny/target/README.md; the floor sits a little above it, so a
# broken load (random or mis-tied weights give ~8 bits/byte) fails.
SHIPPED_BPB_FLOOR = 1.6

TINY_ARGS = [
    "--steps", "4", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
    "--intermediate", "64", "--seq-len", "64", "--batch", "4", "--eval-every", "2", "--eval-windows", "2",
    "--final-eval-windows", "4", "--loop-prompts", "2", "--loop-new-tokens", "128", "--quiet",
]


def test_ends_in_loop():
    assert ends_in_loop([7] * 65)
    assert ends_in_loop(list(range(50)) + [1, 2, 3] * 30)
    assert ends_in_loop(list(b"x = 0\n" * 20))  # period 6
    assert not ends_in_loop(list(range(100)))
    assert not ends_in_loop([1, 2, 3] * 30 + [4])  # the last id breaks the period
    assert not ends_in_loop(list(range(17)) * 6)  # period 17 > max_period
    assert ends_in_loop(list(range(17)) * 6, max_period=17)
    assert not ends_in_loop([5] * 10)  # too short to decide


def test_lr_schedule():
    peak, warmup = 1e-3, 10
    assert _lr_at(0.0, 0, peak, warmup) == pytest.approx(peak / warmup)
    assert _lr_at(0.01, 9, peak, warmup) == pytest.approx(peak)
    assert _lr_at(0.0, 10, peak, warmup) == pytest.approx(peak)
    assert _lr_at(0.5, 500, peak, warmup) == pytest.approx(peak * 0.55)
    assert _lr_at(1.0, 1000, peak, warmup) == pytest.approx(peak * 0.1)
    lrs = [_lr_at(p / 10, 100 + p, peak, warmup) for p in range(11)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_windows():
    tokens = torch.arange(100)
    g = torch.Generator().manual_seed(0)
    w = sample_windows(tokens, 5, 10, g)
    assert w.shape == (5, 10)
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(5, 9, dtype=torch.long))
    e = eval_windows(tokens, 4, 10)
    assert e[:, 0].tolist() == [0, 30, 60, 90] and e[-1, -1] == 99
    with pytest.raises(ValueError, match="longer than"):
        sample_windows(tokens, 1, 100, g)


class _ConstantLogits(torch.nn.Module):
    """Stands in for a causal LM: the same logits at every position."""

    def __init__(self, logits):
        super().__init__()
        self.bias = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids):
        out = self.bias.expand(*input_ids.shape, -1)
        return type("Out", (), {"logits": out})()


def test_bits_per_byte_formula():
    uniform = _ConstantLogits(torch.zeros(258))
    windows = torch.tensor([[1, 2, 3, 257, 4], [5, 257, 6, 7, 8]])
    assert heldout_bits_per_byte(uniform, windows) == pytest.approx(math.log2(258), rel=1e-6)
    # Certain of byte 9: 0 bits where the target is 9; EOS targets are skipped.
    sure = torch.full((258,), -1e4)
    sure[9] = 0.0
    windows = torch.tensor([[9, 9, 9, 257, 9]])
    assert heldout_bits_per_byte(_ConstantLogits(sure), windows) == pytest.approx(0.0, abs=1e-6)


def test_config_defaults():
    config = build_target_config()
    assert (config.vocab_size, config.num_hidden_layers, config.hidden_size) == (258, 6, 256)
    assert config.tie_word_embeddings and config.eos_token_id == 257
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        build_target_config(heads=3, kv_heads=2)


def test_bad_arguments():
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--steps", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--loop-new-tokens", "100"])


def test_tiny_run_saves_and_reloads(tmp_path):
    out = tmp_path / "target"
    threads = torch.get_num_threads()
    result = train_target(parse_args(["--out", str(out), "--seed", "1"] + TINY_ARGS))
    assert torch.get_num_threads() == threads
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", "train_log.json"):
        assert (out / name).is_file(), name
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 4 and log["tokens_seen"] == 4 * 4 * 64 and log["seed"] == 1
    assert len(log["history"]) == 2 and log["storage_dtype"] == "bf16"
    assert 0.0 < log["heldout_bits_per_byte"] < 9.0 and 0.0 <= log["loop_rate"] <= log["loop_rate_period64"] <= 1.0
    assert log["weights_bytes"] == (out / "model.safetensors").stat().st_size

    loaded = load_tiny_target(path=out)
    assert load_tiny_tokenizer(out).eos_token_id == 257
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = encode_corpus("heldout")[:48].unsqueeze(0)
    with torch.no_grad():
        expected = result.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    # Greedy decoding with the KV cache matches recomputing the whole prefix each step.
    prompts = [encode_corpus("heldout")[i:i + 20].tolist() for i in (0, 100)]
    cached = greedy_continuations(loaded, prompts, 6)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, loaded(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert cached == ids[:, 20:].tolist()

    # Same seed, same steps: the same weights.
    again = train_target(parse_args(["--out", str(tmp_path / "again"), "--seed", "1"] + TINY_ARGS))
    for a, b in zip(result.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_main_prints_summary(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "m")] + TINY_ARGS) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["parameters"] > 0


@pytest.mark.skipif(not (TINY_TARGET_DIR / "model.safetensors").is_file(), reason="shipped target not trained yet")
def test_shipped_target_bits_per_byte():
    model = load_tiny_target(torch.float32)
    assert model.config.vocab_size == 258 and model.config.num_hidden_layers >= 1
    windows = eval_windows(encode_corpus("heldout"), 16, 257)
    bpb = heldout_bits_per_byte(model, windows, batch=16)
    assert bpb < SHIPPED_BPB_FLOOR, f"shipped target reaches {bpb:.3f} bits/byte, floor {SHIPPED_BPB_FLOOR}"
