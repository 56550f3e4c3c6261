"""Tiny random targets and drafters built in the tests (no downloads).

fp32 on CPU; eager or SDPA attention. The rigged drafters produce hidden
states whose lm_head argmax is a chosen token, so acceptance can be steered.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash import DFlashDraftModel, make_draft_config

VOCAB = 96


def tiny_target(family: str = "qwen3", *, layers: int = 6, hidden: int = 64, vocab: int = VOCAB, seed: int = 0,
                attn: str = "sdpa", sliding_window=None, dtype=torch.float32):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        attn_implementation=attn,
    )
    if family == "qwen3":
        extra = {}
        if sliding_window:
            extra = dict(use_sliding_window=True, sliding_window=sliding_window,
                         layer_types=["sliding_attention" if i % 2 else "full_attention" for i in range(layers)])
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common, **extra))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(family)
    # Sharpen the output distribution so greedy continuations are not flat noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    # No end-of-text token: transformers' generate() must not stop early in the references.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


def tiny_draft(target, *, block_size: int = 8, layers: int = 2, seed: int = 1, target_layer_ids=None,
               layer_types=None, sliding_window=None, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = target.config
    config = make_draft_config(
        hidden_size=cfg.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=2 * cfg.hidden_size, vocab_size=cfg.vocab_size, num_target_layers=cfg.num_hidden_layers,
        block_size=block_size, mask_token_id=cfg.vocab_size - 1, target_layer_ids=target_layer_ids,
        layer_types=layer_types, sliding_window=sliding_window, max_position_embeddings=512,
    )
    return DFlashDraftModel(config).to(dtype).eval()


def steer(W: torch.Tensor, ranked, top: float = 8.0, gap: float = 0.7) -> torch.Tensor:
    """A hidden state ``h`` whose logits ``W h`` give ``ranked[i]`` the logit ``top - i * gap``.

    Minimum-norm solution of those equations, so every other logit stays near 0:
    ``ranked[0]`` is the argmax and ``ranked[1]`` (if given) a close second.
    """
    A = W[torch.as_tensor(ranked)]
    y = top - gap * torch.arange(len(ranked), dtype=W.dtype)
    return A.T @ torch.linalg.solve(A @ A.T, y)


class RiggedDraft(DFlashDraftModel):
    """A drafter that proposes a known continuation, right with probability ``p_right``.

    ``reference``: the target's own greedy output ids (prompt + continuation).
    Block position j at absolute position q proposes ``reference[q]``, or with
    probability ``1 - p_right`` another token; ``second_right`` makes the wrong
    token rank first and the right one second (DDTree branches).
    """

    def __init__(self, base: DFlashDraftModel, lm_head_weight: torch.Tensor, reference: torch.Tensor,
                 p_right: float = 0.8, second_right: bool = False, seed: int = 0):
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.W = lm_head_weight.detach()
        self.reference = reference.flatten()
        self.p_right = p_right
        self.second_right = second_right
        self.rng = torch.Generator().manual_seed(seed)

    def forward(self, block_embeds, context_features, positions, cache=None, attn_mask=None):
        C = context_features.shape[0]
        if cache is not None:
            cache.advance(C)
        block_pos = positions[C:].cpu()
        ref = self.reference[block_pos.clamp(max=self.reference.numel() - 1)]
        wrong = (ref + 1 + torch.randint(0, self.W.shape[0] - 2, ref.shape, generator=self.rng)) % self.W.shape[0]
        right = torch.rand(ref.shape, generator=self.rng) < self.p_right
        W = self.W.float()
        if self.second_right:
            h = torch.stack([steer(W, [r] if ok else [w, r]) for r, w, ok in zip(ref, wrong, right)])
        else:
            h = torch.stack([steer(W, [r] if ok else [w]) for r, w, ok in zip(ref, wrong, right)])
        return h.to(block_embeds.dtype).to(block_embeds.device)
