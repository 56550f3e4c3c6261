"""Drafter training step and CLI (dflash.training) on small random models.

Most tests force the reference backend of dflash_kernels (the Triton
interpreter is slow); one test checks that the step gives the same loss and
gradients on the Triton path.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import dflash_kernels
from dflash import DFlashDraftModel, TargetAdapter
from dflash.training.data import TrainingSequence, write_jsonl
from dflash.training.train import (BlockTrainingConfig, block_visibility, capture_target, default_gamma,
                          drafter_block_losses, loss_weights, main, perturb_context, resolve_logit_layer,
                          sequence_block_losses, step_loss)
from tiny_models import tiny_draft, tiny_target

B = 4
LAYERS = 4
IDS = [1, 2]
LOGIT = LAYERS - 1


@pytest.fixture(autouse=True)
def reference_backend_one_thread():
    """Reference kernels; one torch thread (tiny shapes: more threads only add spin-wait on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with dflash_kernels.force_backend("reference"):
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(layers=LAYERS, hidden=32)
    target.requires_grad_(False)
    draft = tiny_draft(target, block_size=B, target_layer_ids=IDS).train()
    return target, draft


@pytest.fixture
def adapter(pair):
    ad = TargetAdapter(pair[0], IDS + [LOGIT])
    yield ad
    ad.close()


def _seq(T=24, prompt=4, seed=0, vocab=90):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (T,), generator=g)
    mask = torch.ones(T, dtype=torch.bool)
    mask[:prompt] = False
    return TrainingSequence(ids, mask, line=seed + 1)


# ------------------------------------------------------------------ weights and masks


def test_default_gamma_published_points_and_between():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert default_gamma(4) == 2 and default_gamma(12) == pytest.approx(5 + 2 / 3)
    gammas = [default_gamma(b) for b in range(2, 40)]
    assert all(a < b for a, b in zip(gammas, gammas[1:]))


def test_loss_weights_anchor_zero_then_exponential_decay():
    w = loss_weights(8)
    assert w.shape == (8,) and w[0] == 0 and w[1] == 1
    for k in range(1, 8):
        assert w[k].item() == pytest.approx(math.exp(-(k - 1) / 4.0))
    assert loss_weights(5, gamma=2.0)[3].item() == pytest.approx(math.exp(-1.0))
    with pytest.raises(ValueError):
        loss_weights(8, gamma=0.0)


def test_block_visibility_layout():
    vis = block_visibility(torch.tensor([2, 5]), block_size=3, context_len=5)
    assert vis.shape == (6, 5 + 6)
    # block 0 (anchor 2): context rows 0, 1; block 1 (anchor 5): rows 0..4
    assert vis[:3, :5].tolist() == [[True, True, False, False, False]] * 3
    assert vis[3:, :5].all()
    blocks = vis[:, 5:].int()
    assert blocks.tolist() == [[1, 1, 1, 0, 0, 0]] * 3 + [[0, 0, 0, 1, 1, 1]] * 3


def _block_inputs(adapter, draft, seq, anchors):
    cap = capture_target(adapter, seq.input_ids, len(IDS), LOGIT)
    ids = torch.full((len(anchors), B), draft.mask_token_id)
    ids[:, 0] = seq.input_ids[anchors]
    embeds = adapter.embed(ids.flatten()).detach()
    labels = torch.randint(0, 90, (len(anchors), B - 1), generator=torch.Generator().manual_seed(5))
    return cap.context[: int(anchors.max())].clone(), embeds, labels


def test_block_sees_only_context_before_its_anchor_and_not_other_blocks(pair, adapter):
    _, draft = pair
    seq = _seq()
    anchors = torch.tensor([8, 14])
    context, embeds, labels = _block_inputs(adapter, draft, seq, anchors)
    W, w = adapter.lm_head.weight, loss_weights(B)

    def losses(ctx, emb):
        with torch.no_grad():
            return drafter_block_losses(draft, W, emb, ctx, anchors, labels, w)[0]

    base = losses(context, embeds)
    # context at and after anchor 0 (rows 8..13): block 0 unchanged, block 1 changes
    ctx = context.clone()
    ctx[8:] += 3 * torch.randn_like(ctx[8:])
    out = losses(ctx, embeds)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=1e-6)
    assert not torch.allclose(out[1], base[1], atol=1e-4)
    # earlier context (row 3) changes block 0
    ctx = context.clone()
    ctx[3] += 3 * torch.randn_like(ctx[3])
    assert not torch.allclose(losses(ctx, embeds)[0], base[0], atol=1e-4)
    # the other block's tokens: perturbing block 1 leaves block 0 alone and vice versa
    emb = embeds.clone()
    emb[B:] += 3 * torch.randn_like(emb[B:])
    out = losses(context, emb)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=1e-6)
    assert not torch.allclose(out[1], base[1], atol=1e-4)
    emb = embeds.clone()
    emb[:B] += 3 * torch.randn_like(emb[:B])
    out = losses(context, emb)
    torch.testing.assert_close(out[1], base[1], rtol=0, atol=1e-6)
    # inside a block attention is bidirectional: the last MASK slot moves the first position's loss
    emb = embeds.clone()
    emb[B - 1] += 3 * torch.randn_like(emb[B - 1])
    assert not torch.allclose(losses(context, emb)[0, 0], base[0, 0], atol=1e-5)


def test_block_losses_match_unfused_path(pair, adapter):
    _, draft = pair
    seq = _seq()
    anchors = torch.tensor([5, 9, 17])
    context, embeds, labels = _block_inputs(adapter, draft, seq, anchors)
    w = loss_weights(B)
    fused, _ = drafter_block_losses(draft, adapter.lm_head.weight, embeds, context, anchors, labels, w)
    naive, _ = drafter_block_losses(draft, adapter.lm_head.weight, embeds, context, anchors, labels, w, fused=False)
    torch.testing.assert_close(fused, naive, rtol=1e-5, atol=1e-5)
    assert fused.shape == (3, B - 1)
    # the whole naive recipe (full-sequence target logits for the labels too) gives the same step
    cfg = dict(block_size=B, logit_layer=LOGIT)
    a = sequence_block_losses(draft, adapter, seq, BlockTrainingConfig(**cfg), anchors=anchors)
    b = sequence_block_losses(draft, adapter, seq, BlockTrainingConfig(**cfg, fused=False), anchors=anchors)
    assert torch.equal(a["labels"], b["labels"])
    torch.testing.assert_close(a["losses"], b["losses"], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ labels, capture, noise


def test_labels_are_target_argmax_after_previous_position(pair, adapter):
    target, draft = pair
    seq = _seq(T=30)
    anchors = torch.tensor([4, 11, 20, 26])
    cfg = BlockTrainingConfig(block_size=B, logit_layer=LOGIT)
    out = sequence_block_losses(draft, adapter, seq, cfg, anchors=anchors)
    with torch.no_grad():
        greedy = target(input_ids=seq.input_ids[None]).logits[0].argmax(-1)  # greedy[t] = choice after t
    for b, a in enumerate(anchors.tolist()):
        assert out["labels"][b].tolist() == greedy[a:a + B - 1].tolist()
    store = {}
    first = sequence_block_losses(draft, adapter, seq, cfg, anchors=anchors, store=store)
    again = sequence_block_losses(draft, adapter, seq, cfg, anchors=anchors, store=store)
    assert seq.line in store
    assert torch.equal(first["labels"], out["labels"]) and torch.equal(again["labels"], out["labels"])
    torch.testing.assert_close(again["losses"], out["losses"])


def test_context_holds_mapped_layers_only_never_the_logit_layer(pair, adapter):
    target, _ = pair
    seq = _seq()
    cap = capture_target(adapter, seq.input_ids, len(IDS), LOGIT)
    with torch.no_grad():
        hs = target(input_ids=seq.input_ids[None], output_hidden_states=True).hidden_states
    H = target.config.hidden_size
    assert cap.context.shape == (seq.input_ids.numel(), len(IDS) * H)
    want = torch.cat([hs[k + 1][0] for k in IDS], dim=-1)
    torch.testing.assert_close(cap.context, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cap.logit_hidden, adapter.captured_layer(LOGIT))
    for i in range(len(IDS)):  # no slice of the context is the logit layer's output
        assert not torch.allclose(cap.context[:, i * H:(i + 1) * H], cap.logit_hidden, atol=1e-3)
    with pytest.raises(ValueError, match="capture"):
        capture_target(TargetAdapter(target, IDS), seq.input_ids, len(IDS), LOGIT)


def test_noise_changes_context_only_never_labels(pair, adapter):
    _, draft = pair
    seq = _seq()
    anchors = torch.tensor([6, 12])
    clean = sequence_block_losses(draft, adapter, seq, BlockTrainingConfig(B, logit_layer=LOGIT), anchors=anchors)
    logit_before = adapter.captured_layer(LOGIT).clone()
    noisy = sequence_block_losses(draft, adapter, seq, BlockTrainingConfig(B, logit_layer=LOGIT, context_noise=0.5),
                                  generator=torch.Generator().manual_seed(0), anchors=anchors)
    assert torch.equal(noisy["labels"], clean["labels"])
    assert not torch.allclose(noisy["losses"], clean["losses"])
    torch.testing.assert_close(adapter.captured_layer(LOGIT), logit_before)
    # noise is out of place and scaled per row and layer slice
    f = torch.randn(50, 2 * 8) * torch.tensor([1.0] * 8 + [100.0] * 8)
    g = perturb_context(f, 2, 0.1, torch.Generator().manual_seed(1))
    assert not torch.equal(f, g)
    d = (g - f).view(50, 2, 8)
    assert 3 < d[:, 1].std() / d[:, 0].std() < 300
    assert perturb_context(f, 2, 0.0) is f


def test_logit_layer_choice(pair):
    assert resolve_logit_layer("last", IDS, LAYERS) == LAYERS - 1
    assert resolve_logit_layer(2, [1], LAYERS) == 2
    with pytest.warns(UserWarning, match="proxy"):
        assert resolve_logit_layer("last-mapped", IDS, LAYERS) == 2
    with pytest.raises(ValueError):
        resolve_logit_layer(9, IDS, LAYERS)


# ------------------------------------------------------------------ gradients and learning


def test_gradient_reaches_drafter_only(pair, adapter):
    target, draft = pair
    before = {k: v.clone() for k, v in target.state_dict().items()}
    draft.zero_grad(set_to_none=True)
    cfg = BlockTrainingConfig(B, blocks_per_seq=3, logit_layer=LOGIT)
    out = step_loss(draft, adapter, [_seq(seed=1), _seq(seed=2)], cfg, torch.Generator().manual_seed(0))
    out.loss.backward()
    grads = {n: p.grad for n, p in draft.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert grads["fc.weight"].abs().sum() > 0 and grads["layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in target.parameters())
    torch.optim.SGD(draft.parameters(), lr=0.1).step()
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k
    draft.zero_grad(set_to_none=True)


def test_triton_path_gives_the_same_step(pair, adapter):
    _, draft = pair
    cfg = BlockTrainingConfig(B, blocks_per_seq=2, logit_layer=LOGIT)
    seqs = [_seq(seed=3)]
    results = []
    for backend in ("reference", "triton"):
        if backend not in dflash_kernels.available_backends(torch.device("cpu")):
            pytest.skip("Triton interpreter not active")
        draft.zero_grad(set_to_none=True)
        with dflash_kernels.force_backend(backend):
            out = step_loss(draft, adapter, seqs, cfg, torch.Generator().manual_seed(0))
            out.loss.backward()
        results.append((out.loss.detach(), draft.fc.weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-3, atol=1e-5)
    draft.zero_grad(set_to_none=True)


def test_a_few_steps_reduce_the_loss_on_a_tiny_set(pair):
    target, _ = pair
    draft = tiny_draft(target, block_size=B, target_layer_ids=IDS, seed=3).train()
    ad = TargetAdapter(target, IDS + [LOGIT])
    seqs = [_seq(T=20, seed=s) for s in range(2)]
    cfg = BlockTrainingConfig(B, blocks_per_seq=6, logit_layer=LOGIT)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    losses = []
    for step in range(25):
        out = step_loss(draft, ad, seqs, cfg, torch.Generator().manual_seed(0))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    ad.close()
    assert losses[-1] < 0.5 * losses[0], losses


# ------------------------------------------------------------------ CLI


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


def _records(n=4, T=40, prompt=8):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 256, (T,), generator=g).tolist(), "loss_mask": [0] * prompt + [1] * (T - prompt)}
            for _ in range(n)]


def test_cli_trains_checkpoints_and_resumes(byte_target_dir, tmp_path):
    data = write_jsonl(_records() + [{"text": "def f(x):\n    return x + 1\n"}], tmp_path / "d.jsonl")
    out = tmp_path / "drafter"
    common = ["--target", str(byte_target_dir), "--data", str(data), "--out", str(out), "--layers", "1",
              "--block-size", "4", "--batch-size", "2", "--blocks-per-seq", "2", "--quiet", "--seed", "3"]
    assert main(common + ["--steps", "2", "--save-every", "1"]) == 0
    draft = DFlashDraftModel.from_pretrained(str(out))
    assert draft.block_size == 4 and draft.mask_token_id == 256 and draft.fc.weight.dtype == torch.bfloat16
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 2 and log["data"]["sequences"] == 5
    state = json.loads((out / "training_state" / "training_state.json").read_text())
    assert state["step"] == 2 and state["tensors"]["file"].endswith(".safetensors")
    assert main(common + ["--steps", "4", "--resume"]) == 0
    assert json.loads((out / "training_state" / "training_state.json").read_text())["step"] == 4
    assert json.loads((out / "train_log.json").read_text())["steps"] == 4
    resumed = DFlashDraftModel.from_pretrained(str(out))
    assert not torch.equal(resumed.fc.weight, draft.fc.weight)
    # continue from a published drafter directory
    out2 = tmp_path / "from_init"
    assert main(["--target", str(byte_target_dir), "--data", str(data), "--out", str(out2), "--init", str(out),
                 "--steps", "1", "--batch-size", "1", "--quiet", "--save-dtype", "fp32"]) == 0
    assert DFlashDraftModel.from_pretrained(str(out2)).config.num_hidden_layers == 1


@pytest.mark.parametrize("lines, message", [
    ([], "is empty"),
    (['{"input_ids": [1, 2, 3, 4, 5, 6, 7]}', '{"input_ids": [1, 2,'], "line 2: malformed JSON"),
    (['{"input_ids": [1, 2, 3, 4, 5, 6]}', '', '{"input_ids": [1, 2, 3, 400, 5, 6]}'],
     "line 3: token id 400 at index 3 is outside the vocabulary"),
    (['{"input_ids": [1, 2, 3]}'], "line 1: sequence of 3 tokens is shorter than one block"),
    (['{"text": "abcdefgh", "loss_mask": [1, 1]}'], "line 1: 'loss_mask' must be a list as long"),
    (['{"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [1, 1, 1, 0, 1, 1]}'], "line 1: no block"),
    (['{"ids": [1, 2, 3]}'], "line 1: the object has neither"),
])
def test_cli_bad_data_names_the_line(byte_target_dir, tmp_path, capsys, lines, message):
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + ("\n" if lines else ""))
    rc = main(["--target", str(byte_target_dir), "--data", str(data), "--out", str(tmp_path / "o"), "--layers", "1",
               "--block-size", "4", "--steps", "1", "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and str(data) in err
