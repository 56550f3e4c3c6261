"""Training a DFlash2 drafter: the selector's K-way objective beside the token loss, and the CLI's --arch dflash2.

Small random models on the reference backend of dflash_kernels.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import dflash_kernels
from dflash import DFlash2DraftModel, DFlashDraftModel, TargetAdapter
from dflash.drafter.config import DraftConfigError, dflash2_config, make_draft_config
from dflash.training.data import TrainingSequence, write_jsonl
from dflash.training.selector_objective import selector_block_losses, training_candidates
from dflash.training.train import BlockTrainingConfig, drafter_block_losses, loss_weights, main, sequence_block_losses, step_loss
from tiny_models import tiny_target

B = 4
LAYERS = 4
IDS = [1, 2]
LOGIT = LAYERS - 1
TOP_K = 4


@pytest.fixture(autouse=True)
def reference_backend_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with dflash_kernels.force_backend("reference"):
        yield
    torch.set_num_threads(threads)


def dflash2_draft(target, seed=1, sharp_selector=True):
    cfg = target.config
    torch.manual_seed(seed)
    config = make_draft_config(
        hidden_size=cfg.hidden_size, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=2 * cfg.hidden_size, vocab_size=cfg.vocab_size, num_target_layers=cfg.num_hidden_layers,
        block_size=B, mask_token_id=cfg.vocab_size - 1, target_layer_ids=IDS, max_position_embeddings=512,
        **dflash2_config(cfg.hidden_size, cfg.vocab_size, B, conv_group_size=8, selector_rank=6,
                         selector_top_k=TOP_K))
    draft = DFlash2DraftModel(config)
    if sharp_selector:
        with torch.no_grad():  # a selector whose bilinear term matters next to the unary scores
            for p in draft.candidate_selector.parameters():
                p.normal_(0, 0.7)
    return draft.train()


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(layers=LAYERS, hidden=32)
    target.requires_grad_(False)
    return target, dflash2_draft(target)


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


def test_dflash2_config_defaults_and_bad_values():
    assert dflash2_config(256, 258, 8) == dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                                               selector_top_k=16)
    assert dflash2_config(32, 50, 4, selector_top_k=3, selector_rank=None)["selector_top_k"] == 3
    for kw, message in [(dict(conv_group_size=12), "must divide hidden_size"),
                        (dict(conv_kernel_size=5), "conv_kernel_size must be in 1..block_size"),
                        (dict(selector_top_k=60), "selector_top_k must be in 1..vocab_size"),
                        (dict(selector_rank=0), "selector_rank must be >= 1"),
                        (dict(rank=3), "unknown DFlash2 keys")]:
        with pytest.raises(DraftConfigError, match=message):
            dflash2_config(32, 50, 4, **kw)


def test_training_candidates_put_a_missing_label_in_the_last_slot():
    cand = torch.tensor([[5, 7, 9], [5, 7, 9], [1, 2, 3]])
    out, slot, present = training_candidates(cand, torch.tensor([7, 4, 3]))
    assert out.tolist() == [[5, 7, 9], [5, 7, 4], [1, 2, 3]]
    assert slot.tolist() == [1, 2, 2] and present.tolist() == [True, False, True]
    assert cand.tolist() == [[5, 7, 9], [5, 7, 9], [1, 2, 3]]  # not modified in place


def _drafter_logits(h, W, multiplier=1.0, cap=None):
    """The drafter's logits spelled out: softcap(multiplier * W h)."""
    logits = multiplier * (h @ W.T)
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _naive_selector(draft, W, states, prev, labels, weights):
    """The objective spelled out on full [N, V] logits (what the trainer must not build)."""
    nb = labels.shape[0]
    rows = (torch.arange(nb)[:, None] * B + torch.arange(1, B)[None, :]).flatten()
    h = states[rows]
    logits = _drafter_logits(h, W, draft.output_multiplier, draft.logit_softcap)
    cand = logits.detach().topk(TOP_K, dim=-1).indices
    y = labels.flatten()
    losses, correct = [], []
    sel = draft.candidate_selector
    for n in range(rows.numel()):
        c = cand[n].clone()
        if y[n] not in c:
            c[-1] = y[n]
        p = sel.predecessor_codebook.weight[prev.flatten()[n]] * (sel.hidden_projection.weight @ h[n])
        s = logits[n, c] + sel.successor_codebook.weight[c] @ p
        target = int((c == y[n]).int().argmax())
        losses.append(F.cross_entropy(s[None], torch.tensor([target])) * weights[1 + n % (B - 1)])
        correct.append(bool(c[int(s.argmax())] == y[n]) and bool(y[n] in cand[n]))
    return torch.stack(losses).view(nb, B - 1), torch.tensor(correct).view(nb, B - 1)


def _with_scalars(draft, scalars):
    """``draft`` itself, or a copy drafting with z-lab's output multiplier and final-logit softcap."""
    if scalars is None:
        return draft
    out = copy.deepcopy(draft)
    out.output_multiplier, out.logit_softcap = scalars
    return out


@pytest.mark.parametrize("scalars", [None, (2.5, 1.5)], ids=["plain", "multiplier-softcap"])
def test_selector_losses_and_gradients_match_the_full_logit_recipe(pair, scalars):
    target, draft = pair
    draft = _with_scalars(draft, scalars)
    W = target.lm_head.weight
    nb = 3
    g = torch.Generator().manual_seed(2)
    states = torch.randn(nb * B, 32, generator=g).requires_grad_(True)
    prev = torch.randint(0, 90, (nb, B - 1), generator=g)
    with torch.no_grad():
        labels = (states[(torch.arange(nb)[:, None] * B + torch.arange(1, B)).flatten()] @ W.T).argsort(-1, True)
    # labels: the best, the third, then tokens outside the top-K (injected)
    picks = torch.tensor([0, 2, 50]).repeat(nb)[: nb * (B - 1)]
    labels = labels.gather(1, picks[:, None]).view(nb, B - 1)
    w = loss_weights(B)
    got, got_correct = selector_block_losses(draft, W, states, prev, labels, w)
    params = [states] + list(draft.candidate_selector.parameters())
    grads = torch.autograd.grad(got.sum(), params)
    want, want_correct = _naive_selector(draft, W, states, prev, labels, w)
    want_grads = torch.autograd.grad(want.sum(), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_correct, want_correct) and not got_correct.view(-1)[2::3].any()
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert grads[0].abs().sum() > 0  # the block states learn from the selector too


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "naive"])
def test_token_loss_uses_the_drafters_own_logits(pair, fused):
    """With an output multiplier and a softcap the token loss is the cross-entropy of the logits the drafter
    drafts with, softcap(m * W S), not of W S."""
    target, draft = pair
    draft = _with_scalars(draft, (2.5, 1.5))
    W = target.lm_head.weight
    nb, C = 2, 6
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(nb * B, 32, generator=g)
    context = torch.randn(C, len(IDS) * 32, generator=g)
    anchors = torch.tensor([3, 6])
    labels = torch.randint(0, 90, (nb, B - 1), generator=g)
    w = loss_weights(B)
    got, states = drafter_block_losses(draft, W, embeds, context, anchors, labels, w, fused=fused)
    rows = (torch.arange(nb)[:, None] * B + torch.arange(1, B)).flatten()
    logits = _drafter_logits(states[rows], W, 2.5, 1.5)
    want = F.cross_entropy(logits, labels.flatten(), reduction="none") * w[1:].repeat(nb)
    torch.testing.assert_close(got.flatten(), want, rtol=1e-5, atol=1e-5)
    plain = F.cross_entropy(states[rows] @ W.T, labels.flatten(), reduction="none") * w[1:].repeat(nb)
    assert (got.flatten() - plain).abs().max() > 1e-2  # the scalars change the loss


def test_step_adds_the_weighted_selector_loss_and_trains_every_weight(pair, adapter):
    _, draft = pair
    seq = _seq(seed=4)
    anchors = torch.tensor([5, 11, 17])
    base = BlockTrainingConfig(B, logit_layer=LOGIT)
    out = sequence_block_losses(draft, adapter, seq, base, anchors=anchors)
    half = sequence_block_losses(draft, adapter, seq, BlockTrainingConfig(B, logit_layer=LOGIT,
                                                                          selector_loss_weight=0.5), anchors=anchors)
    token = out["losses"] - out["selector_losses"]
    torch.testing.assert_close(half["losses"], token + 0.5 * out["selector_losses"])
    assert (out["selector_losses"][:, 0] > 0).all()
    draft.zero_grad(set_to_none=True)
    step = step_loss(draft, adapter, [_seq(seed=1), _seq(seed=2)], BlockTrainingConfig(B, blocks_per_seq=3,
                                                                                       logit_layer=LOGIT),
                     torch.Generator().manual_seed(0))
    step.loss.backward()
    missing = [n for n, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing
    assert 0 < step.selector_loss_sum < step.loss_sum
    draft.zero_grad(set_to_none=True)


def test_a_few_steps_reduce_token_and_selector_losses(pair):
    target, _ = pair
    draft = dflash2_draft(target, seed=3, sharp_selector=False)  # the published initialisation
    ad = TargetAdapter(target, IDS + [LOGIT])
    seqs = [_seq(T=20, seed=s) for s in range(2)]
    cfg = BlockTrainingConfig(B, blocks_per_seq=6, logit_layer=LOGIT)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    history = []
    for _ in range(25):
        out = step_loss(draft, ad, seqs, cfg, torch.Generator().manual_seed(0))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append((out.loss_sum - out.selector_loss_sum, out.selector_loss_sum, out.block_tau))
    ad.close()
    (tok0, sel0, _), (tok1, sel1, tau1) = history[0], history[-1]
    assert tok1 < 0.5 * tok0 and sel1 < 0.5 * sel0, history
    assert tau1 > 3, history


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


def test_cli_arch_dflash2_saves_the_zlab_format_and_resumes(byte_target_dir, tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    data = write_jsonl([{"input_ids": torch.randint(0, 256, (40,), generator=g).tolist(),
                         "loss_mask": [0] * 8 + [1] * 32} for _ in range(4)], tmp_path / "d.jsonl")
    out = tmp_path / "drafter2"
    common = ["--target", str(byte_target_dir), "--data", str(data), "--out", str(out), "--layers", "1",
              "--block-size", "4", "--batch-size", "2", "--blocks-per-seq", "2", "--quiet", "--seed", "3",
              "--no-tensorboard", "--arch", "dflash2", "--selector-rank", "8", "--selector-top-k", "5"]
    assert main(common + ["--steps", "2", "--log-every", "1"]) == 0
    draft = DFlashDraftModel.from_pretrained(str(out))
    assert type(draft) is DFlash2DraftModel and draft.candidate_selector.top_k == 5
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == dict(
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)
    names = load_file(str(out / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in names and "layers.0.mlp_conv.base_kernel" in names
    assert names["candidate_selector.successor_codebook"].dtype == torch.bfloat16
    log = json.loads((out / "train_log.json").read_text())
    assert log["drafter"]["arch"] == "dflash2" and log["drafter"]["selector_top_k"] == 5
    assert log["hyperparameters"]["selector_loss_weight"] == 1.0
    assert all(0 < h["selector_loss"] < h["loss"] for h in log["history"])
    assert main(common + ["--steps", "3", "--resume"]) == 0
    resumed = DFlashDraftModel.from_pretrained(str(out))
    assert type(resumed) is DFlash2DraftModel
    assert not torch.equal(resumed.candidate_selector.successor_codebook.weight,
                           draft.candidate_selector.successor_codebook.weight)
    assert main(common[:-6] + ["--selector-rank", "8", "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert "--selector-rank set the DFlash2 architecture: add --arch dflash2" in capsys.readouterr().err
