"""Training for long prompts: packing exactness, sliding-window drafters (training forward = inference forward),
the trainer's new flags end to end and their errors, and the chunked target capture."""

from __future__ import annotations

import json

import pytest
import torch

import dflash_kernels
from dflash import DFlashDraftModel, TargetAdapter
from dflash.drafter.cache import DraftKVCache
from dflash.training.data import (TrainingSequence, pack_sequences, segment_starts, sequence_anchor_mask,
                                  valid_anchor_mask, write_jsonl)
from dflash.training.train import (BlockTrainingConfig, block_attention_mask, capture_target, main, sample_anchors,
                                   sequence_block_losses)
from tiny_models import tiny_draft, tiny_target

B = 4
LAYERS = 4
IDS = [1, 2]
LOGIT = LAYERS - 1
WINDOW = 6


@pytest.fixture(autouse=True)
def reference_backend_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with dflash_kernels.force_backend("reference"):
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    t = tiny_target(layers=LAYERS, hidden=32)
    t.requires_grad_(False)
    return t


@pytest.fixture
def adapter(target):
    ad = TargetAdapter(target, IDS + [LOGIT])
    yield ad
    ad.close()


def _sample(T, prompt, seed, line):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(T, dtype=torch.bool)
    mask[:prompt] = False
    return TrainingSequence(torch.randint(0, 90, (T,), generator=g), mask, line=line)


def _samples():
    return [_sample(23, 4, 0, 1), _sample(17, 0, 1, 2), _sample(30, 9, 2, 3)]


# ------------------------------------------------------------------ packing


def test_pack_sequences_next_fit_in_order_keeps_segments():
    samples = _samples() + [_sample(12, 0, 3, 4)]
    packs = pack_sequences(samples, 45, B)
    assert [p.segments for p in packs] == [(23, 17), (30, 12)]
    assert [p.lines for p in packs] == [(1, 2), (3, 4)] and [p.line for p in packs] == [1, 3]
    assert torch.equal(packs[0].input_ids, torch.cat([samples[0].input_ids, samples[1].input_ids]))
    assert torch.equal(packs[1].loss_mask, torch.cat([samples[2].loss_mask, samples[3].loss_mask]))
    # a pack of one sample is the sample itself
    assert pack_sequences(samples[:1], 64, B)[0] is samples[0]
    starts = segment_starts(packs[0])
    assert starts[:23].eq(0).all() and starts[23:].eq(23).all()
    # anchors stay inside one sample: its B-1 supervised rows and at least one context row of its own
    valid = sequence_anchor_mask(packs[0], B)
    assert torch.equal(valid, torch.cat([valid_anchor_mask(samples[0].loss_mask, B),
                                         valid_anchor_mask(samples[1].loss_mask, B)]))
    assert not valid[23] and not valid[23 - B + 1: 23].any()


@pytest.mark.parametrize("limit, message", [(4, "must be >= 5"), (20, "line 1: a sample of 23 tokens")])
def test_pack_sequences_errors_say_what_is_allowed(limit, message):
    with pytest.raises(ValueError, match=message):
        pack_sequences(_samples(), limit, B)


def test_packed_capture_equals_each_sample_alone(adapter):
    samples = _samples()
    packed = pack_sequences(samples, 128, B)[0]
    cap = capture_target(adapter, packed.input_ids, len(IDS), LOGIT, segments=packed.segments)
    alone = [capture_target(adapter, s.input_ids, len(IDS), LOGIT) for s in samples]
    torch.testing.assert_close(cap.context, torch.cat([a.context for a in alone]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cap.logit_hidden, torch.cat([a.logit_hidden for a in alone]), rtol=1e-5, atol=1e-5)
    # chunked capture (the trainer's default is PREFILL_CHUNK rows per pass) equals one pass
    chunked = capture_target(adapter, samples[2].input_ids, len(IDS), LOGIT, chunk_size=7)
    torch.testing.assert_close(chunked.context, alone[2].context, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="summing to the sequence's 70 tokens"):
        capture_target(adapter, packed.input_ids, len(IDS), LOGIT, segments=(23, 17))


@pytest.mark.parametrize("window", [None, WINDOW])
def test_packed_losses_and_gradients_equal_the_samples_trained_alone(target, adapter, window):
    """The invariant: with the same anchors, every block of a packed sequence has the loss (and gradient) it has
    when its sample is trained alone; so the packed loss sum / weight sum is the weighted mean of the samples'."""
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=window) if window else {}
    draft = tiny_draft(target, block_size=B, target_layer_ids=IDS, **kw).train()
    cfg = BlockTrainingConfig(block_size=B, blocks_per_seq=3, logit_layer=LOGIT)
    samples = _samples()
    packed = pack_sequences(samples, 128, B)[0]
    offsets = [0, 23, 40]
    anchors = [sample_anchors(valid_anchor_mask(s.loss_mask, B), 3, torch.Generator().manual_seed(i))
               for i, s in enumerate(samples)]
    alone = [sequence_block_losses(draft, adapter, s, cfg, anchors=a) for s, a in zip(samples, anchors)]
    draft.zero_grad()
    sum(o["losses"].sum() for o in alone).backward()
    grads_alone = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()
    out = sequence_block_losses(draft, adapter, packed, cfg,
                                anchors=torch.cat([a + off for a, off in zip(anchors, offsets)]))
    torch.testing.assert_close(out["losses"], torch.cat([o["losses"] for o in alone]), rtol=1e-5, atol=1e-6)
    assert torch.equal(out["labels"], torch.cat([o["labels"] for o in alone]))
    out["losses"].sum().backward()
    for name, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, grads_alone[name], rtol=1e-4, atol=1e-6, msg=name)
    packed_loss = out["losses"].sum() / out["weight_sum"]
    mean = sum(o["losses"].sum() for o in alone) / sum(o["weight_sum"] for o in alone)
    torch.testing.assert_close(packed_loss, mean)
    # without the sample boundary (one long sequence) the blocks of later samples see earlier samples: different
    unpacked = TrainingSequence(packed.input_ids, packed.loss_mask, line=99)
    crossed = sequence_block_losses(draft, adapter, unpacked, cfg, anchors=torch.cat(
        [a + off for a, off in zip(anchors, offsets)]))
    assert not torch.allclose(crossed["losses"][3:], out["losses"][3:], atol=1e-4)


# ------------------------------------------------------------------ sliding windows: training = inference


def _inference_block(draft, context, block):
    """The decoding round's pass: ``context`` ingested as the committed prompt, then one block drafted."""
    cache = DraftKVCache(draft.config, context.shape[0] + 16, torch.float32, "cpu")
    draft.ingest_context(context, cache)
    cache.freeze()
    waiting = torch.zeros(8, context.shape[1])
    return draft.draft_block(block, waiting, torch.tensor([0]), cache)


def _training_blocks(draft, context, blocks, anchors, row_starts=None):
    """The training pass of :func:`dflash.training.objective.drafter_block_losses` (all blocks at once)."""
    C = int(anchors.max())
    offsets = torch.arange(B)
    if row_starts is None:
        positions = torch.cat([torch.arange(C), (anchors[:, None] + offsets).flatten()])
        mask = block_attention_mask(anchors, B, C)
    else:
        s = row_starts[anchors]
        positions = torch.cat([torch.arange(C) - row_starts[:C], ((anchors - s)[:, None] + offsets).flatten()])
        mask = block_attention_mask(anchors, B, C, context_start=s)
    return draft(blocks, context[:C], positions, attn_mask=mask, block_size=B).view(-1, B, blocks.shape[-1])


def test_window_drafter_training_forward_equals_inference_forward(trained_window_drafter):
    draft = trained_window_drafter.float().eval()
    assert draft.layers[0].sliding_window == 8 and draft.layers[1].sliding_window is None
    n, H = len(draft.target_layer_ids), draft.config.hidden_size
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(40, n * H, generator=g)
    anchors = torch.tensor([3, 11, 25, 39])  # windows of 8 cut the context of the last three
    blocks = torch.randn(anchors.numel() * B, H, generator=g)
    with torch.no_grad():
        train = _training_blocks(draft, feats, blocks, anchors)
        for b, a in enumerate(anchors.tolist()):
            infer = _inference_block(draft, feats[:a], blocks[b * B:(b + 1) * B])
            torch.testing.assert_close(train[b], infer, rtol=1e-5, atol=1e-5)
        # packed: a sample starting at row 20 is drafted at inference as its own prompt (positions from 0)
        starts = torch.tensor([0] * 20 + [20] * 20)
        anchors = torch.tensor([9, 24, 31, 39])
        packed = _training_blocks(draft, feats, blocks, anchors, row_starts=starts)
        for b, a in enumerate(anchors.tolist()):
            s = int(starts[a])
            infer = _inference_block(draft, feats[s:a], blocks[b * B:(b + 1) * B])
            torch.testing.assert_close(packed[b], infer, rtol=1e-5, atol=1e-5)
        # the window is in force: the same weights without it draft otherwise
        wide = DFlashDraftModel(draft.config)
        wide.load_state_dict(draft.state_dict())
        for layer in wide.layers:
            layer.sliding_window = None
        assert not torch.allclose(_inference_block(wide, feats[:39], blocks[-B:]), train[-1], atol=1e-4)


# ------------------------------------------------------------------ the trainer's flags


@pytest.fixture(scope="module")
def byte_target_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.tiny.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=256, tie_word_embeddings=True)).eval()
    d = tmp_path_factory.mktemp("byte_target")
    model.save_pretrained(d)
    ByteTokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def train_data(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    records = [{"input_ids": torch.randint(0, 256, (T,), generator=g).tolist(),
                "loss_mask": [0] * 4 + [1] * (T - 4)} for T in (30, 24, 40, 19, 33, 28)]
    return write_jsonl(records, tmp_path_factory.mktemp("data") / "d.jsonl")


def _common(target_dir, data, out):
    return ["--target", str(target_dir), "--data", str(data), "--out", str(out), "--block-size", str(B),
            "--batch-size", "2", "--blocks-per-seq", "4", "--quiet", "--seed", "1", "--save-dtype", "fp32",
            "--target-layer-ids", "1,2"]


@pytest.fixture(scope="module")
def trained_window_drafter(byte_target_dir, train_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("window_drafter")
    with dflash_kernels.force_backend("reference"):
        rc = main(_common(byte_target_dir, train_data, out) + [
            "--layers", "2", "--steps", "3", "--pack", "--max-length", "64", "--sliding-window", "8",
            "--layer-types", "sliding,full", "--grad-checkpoint", "--cache-target"])
    assert rc == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["data"]["samples"] == 6 and log["data"]["sequences"] == 3 and log["data"]["packed"]
    assert log["drafter"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert log["drafter"]["sliding_window"] == 8 and log["steps"] == 3
    return DFlashDraftModel.from_pretrained(str(out))


def test_cli_trains_a_packed_window_drafter_that_generates(trained_window_drafter, byte_target_dir):
    from dflash import generate
    from dflash.tiny.pair import load_target

    cfg = trained_window_drafter.config
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 8
    target = load_target(str(byte_target_dir))
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = target.generate(prompt[None], max_new_tokens=12, do_sample=False)[0, 40:]
    out = generate(target, trained_window_drafter.float(), prompt, max_new_tokens=12)
    assert out.generated_ids[0].tolist() == ref.tolist()


@pytest.mark.parametrize("extra, message", [
    (["--sliding-window", "0"], "--sliding-window must be >= 1"),
    (["--layer-types", "sliding"], "--layer-types lists 1 layer type(s) for --layers 2"),
    (["--layer-types", "sliding,full"], "give their window with --sliding-window W"),
    (["--layer-types", "full,full", "--sliding-window", "4"], "has no sliding_attention layer"),
    (["--pack"], "--pack needs --max-length"),
    (["--pack", "--max-length", "4"], "shorter than one block plus one context token (5 for block size 4)"),
    (["--max-length", "0"], "--max-length must be a positive number of tokens"),
])
def test_cli_bad_long_training_values_exit_2_naming_the_rule(byte_target_dir, train_data, tmp_path, capsys, extra,
                                                             message):
    rc = main(_common(byte_target_dir, train_data, tmp_path / "o") + ["--layers", "2", "--steps", "1"] + extra)
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_unknown_layer_type_lists_the_allowed_names(byte_target_dir, train_data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(_common(byte_target_dir, train_data, tmp_path / "o") + ["--layer-types", "sliding,local"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown layer type(s) ['local']" in err and "allowed: full_attention (or full)" in err


def test_cli_window_flags_refused_with_init(byte_target_dir, train_data, tmp_path, capsys, trained_window_drafter):
    init = tmp_path / "init"
    trained_window_drafter.save_pretrained(str(init))
    rc = main(_common(byte_target_dir, train_data, tmp_path / "o") + ["--init", str(init), "--steps", "1",
                                                                      "--sliding-window", "16"])
    assert rc == 2 and "the checkpoint's config sets its layers" in capsys.readouterr().err


# ------------------------------------------------------------------ the tau-against-length benchmark


def test_tau_vs_prompt_length_script_runs_small(tmp_path, capsys):
    """``bench/tau_vs_prompt_length.py`` at two short lengths: one row per length, DFlash and DDTree tau, the
    target's bits/byte, the Markdown table."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "tau_vs_prompt_length.py"
    spec = importlib.util.spec_from_file_location("tau_vs_prompt_length", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "tau.json"
    report = module.main(["--lengths", "32,96", "--prompts", "1", "--new-tokens", "8", "--budgets", "4",
                          "--window", "40", "--json", str(out)])
    assert json.loads(out.read_text()) == report and report["window"] == 40
    assert [r["prompt_tokens"] for r in report["rows"]] == [32, 96]
    for r in report["rows"]:
        assert 1.0 <= r["dflash"] <= report["block_size"] and 1.0 <= r["ddtree_4"] <= report["block_size"]
        assert r["target_bits_per_byte"] > 0
    assert "| prompt tokens | DFlash tau | DDTree-4 tau |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        module.main(["--lengths", "0,64"])
    # --window: the same weights, every layer a non-causal sliding-window layer
    draft = DFlashDraftModel.from_pretrained(report["drafter"], dtype=torch.float32)
    windowed = module.with_window(draft, 40)
    assert [(layer.sliding_window, layer.causal) for layer in windowed.layers] == [(40, False)] * len(draft.layers)
    assert all(torch.equal(a, b) for a, b in zip(windowed.state_dict().values(), draft.state_dict().values()))


def test_train_long_memory_step_runs_small():
    """``bench/train_long_memory.py``'s measured step (packed, checkpointed, windowed) at smoke size, in this
    process."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "train_long_memory.py"
    spec = importlib.util.spec_from_file_location("train_long_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        row = module.child(dict(seq_len=96, blocks=2, layers=2, target=str(module.DEFAULT_TARGET), sliding_window=16,
                                pack=2, grad_checkpoint=1))
    finally:
        torch.set_num_threads(threads)
    assert row["seq_len"] == 96 and row["pack"] == 2 and row["blocks"] == 2 and row["grad_checkpoint"]
    assert row["peak_extra_mib"] >= 0 and row["loss"] > 0
