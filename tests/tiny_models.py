"""Tiny random targets and drafters built in the tests (no downloads).

fp32 on CPU; eager or SDPA attention. The rigged drafters produce hidden
states whose lm_head argmax is a chosen token, so acceptance can be steered:
:class:`RiggedDraft` draws right or wrong per round on the host (eager loops
only); :class:`TableDraft` and :class:`TableDraft2` (DFlash2) read a fixed
table by position, traceable by compiled rounds.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash import DFlash2DraftModel, DFlashDraftModel, make_draft_config

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


#: the DFlash2 keys of :func:`tiny_dflash2_draft`
DFLASH2_KEYS = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)


def tiny_dflash2_draft(target, *, block_size: int = 8, layers: int = 2, seed: int = 1, target_layer_ids=None,
                       dtype=torch.float32, selector_scale: float = 1.0, **extra):
    """A random DFlash2 drafter for ``target``: convolutions off the identity (random taps and dynamic
    kernels) and selector codebooks of std ``selector_scale`` (large enough that re-scoring changes the
    chain). ``extra``: more config keys (z-lab's ``output_multiplier`` ...)."""
    from dflash import DFlash2DraftModel

    cfg = target.config
    config = make_draft_config(
        hidden_size=cfg.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=2 * cfg.hidden_size, vocab_size=cfg.vocab_size, num_target_layers=cfg.num_hidden_layers,
        block_size=block_size, mask_token_id=cfg.vocab_size - 1, target_layer_ids=target_layer_ids,
        max_position_embeddings=512, **DFLASH2_KEYS, **extra)
    torch.manual_seed(seed)
    model = DFlash2DraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.add_(0.3 * torch.randn_like(p))
            elif "kernel_projection" in name:
                p.normal_(0.0, 0.1)
            elif "codebook" in name or "hidden_projection" in name:
                p.normal_(0.0, selector_scale)
    return model.to(dtype).eval()


def steer(W: torch.Tensor, ranked, top: float = 8.0, gap: float = 0.7) -> torch.Tensor:
    """A hidden state ``h`` whose logits ``W h`` give ``ranked[i]`` the logit ``top - i * gap``.

    Minimum-norm solution of those equations, so every other logit stays near 0:
    ``ranked[0]`` is the argmax and ``ranked[1]`` (if given) a close second.
    """
    A = W[torch.as_tensor(ranked)]
    y = top - gap * torch.arange(len(ranked), dtype=W.dtype)
    return A.T @ torch.linalg.solve(A @ A.T, y)


def wrong_tokens(ref: torch.Tensor, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """A token other than ``ref``'s at each position, drawn from ``generator``."""
    return (ref + 1 + torch.randint(0, vocab - 2, ref.shape, generator=generator)) % vocab


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

    def draft_block(self, block_embeds, context_features, context_count, cache, block_size=None):
        """The round's drafter pass, ``block_embeds [b, B, H]``: sequence ``r``'s block ``j`` sits at ``length[r] +
        count[r] + j`` (read on the host: a test drafter runs eagerly only); every sequence steered to the
        one reference text."""
        if block_embeds.dim() == 2:
            return self.draft_block(block_embeds[None], context_features[None], context_count, cache)[0]
        B = block_embeds.shape[1]
        starts = (cache.length_t + context_count).tolist()
        cache.advance(context_count)
        return torch.stack([self.steered(start + torch.arange(B), block_embeds) for start in starts])

    def steered(self, block_pos, block_embeds):
        ref = self.reference[block_pos.clamp(max=self.reference.numel() - 1)]
        wrong = wrong_tokens(ref, self.W.shape[0], self.rng)
        right = torch.rand(ref.shape, generator=self.rng) < self.p_right
        W = self.W.float()
        if self.second_right:
            h = torch.stack([steer(W, [r] if ok else [w, r]) for r, w, ok in zip(ref, wrong, right)])
        else:
            h = torch.stack([steer(W, [r] if ok else [w]) for r, w, ok in zip(ref, wrong, right)])
        return h.to(block_embeds.dtype).to(block_embeds.device)


def steered_table(lm_head_weight: torch.Tensor, reference: torch.Tensor, p_right: float = 0.7,
                  second_right: bool = False, seed: int = 0) -> torch.Tensor:
    """``[len(reference) + 64, H]`` drafter states, row ``q`` steered to ``reference[q]`` where ``right[q]`` (a
    fixed random pattern of ``p_right``), else to another token (ranked first, the right one second when
    ``second_right``); past the reference, to token 0."""
    ref = reference.flatten()
    V = lm_head_weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    n = ref.numel() + 64
    ref = torch.cat([ref, torch.zeros(n - ref.numel(), dtype=torch.long)])
    wrong = wrong_tokens(ref, V, g)
    right = torch.rand(n, generator=g) < p_right
    W = lm_head_weight.detach().float()
    rows = [steer(W, [r] if ok else ([w, r] if second_right else [w])) for r, w, ok in zip(ref, wrong, right)]
    return torch.stack(rows).to(lm_head_weight.dtype)


class _TableRows:
    """A traceable rigged drafter's pass: the block row at absolute position ``q`` is the table's row ``q``
    (device ops only, so a compiled round traces it; the same proposals eager and compiled)."""

    def _rows(self, positions):
        return self.table.index_select(0, positions.clamp(max=self.table.shape[0] - 1))

    def draft_block(self, block_embeds, context_features, context_count, cache, block_size=None):
        """``[b, B, H]``: sequence ``r``'s block rows at ``length[r] + count[r] + j``."""
        B = block_embeds.shape[1]
        positions = (cache.length_t + context_count)[:, None] + cache.rows[:B]
        cache.advance(context_count)
        return self._rows(positions.reshape(-1)).view(*positions.shape, -1).to(block_embeds.dtype)

    def ingest_context(self, context_features, cache):
        cache.commit(context_features.shape[0])


class TableDraft(_TableRows, DFlashDraftModel):
    """A traceable rigged drafter (:func:`steered_table`): acceptance varies round by round, and an eager and a
    compiled run see the same rounds."""

    def __init__(self, base: DFlashDraftModel, lm_head_weight: torch.Tensor, reference: torch.Tensor,
                 p_right: float = 0.7, second_right: bool = False, seed: int = 0):
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.register_buffer("table", steered_table(lm_head_weight, reference, p_right, second_right, seed),
                             persistent=False)


class TableDraft2(_TableRows, DFlash2DraftModel):
    """:class:`TableDraft` over a DFlash2 drafter: the right token ranks first where ``right[q]``, else second
    behind another token; the drafter's own candidate selector re-scores those candidates."""

    def __init__(self, base: DFlash2DraftModel, lm_head_weight: torch.Tensor, reference: torch.Tensor,
                 p_right: float = 0.7, seed: int = 0):
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.register_buffer("table", steered_table(lm_head_weight, reference, p_right, True, seed),
                             persistent=False)


# ------------------------------------------------------------------ every family (tests/families/test_families.py)
#: The families :func:`tiny_family_target` builds, by transformers class.
FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe", "gpt_oss")

#: Small enough to matter at these weight scales: scores and logits of a few units get bent by tanh.
ATTN_SOFTCAP = 1.5
FINAL_SOFTCAP = 3.0


def _family_config(family, *, layers, hidden, vocab, heads, kv_heads, head_dim, window):
    """``(config class name, model class name, config kwargs)`` of a tiny ``family`` target."""
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    # Gemma3's 5:1 local/global pattern, cut to the layer count (the last layer global)
    gemma3_types = ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
                    for i in range(layers)]
    if family == "llama":
        return "LlamaConfig", "LlamaForCausalLM", dict(common, head_dim=head_dim)
    if family == "qwen2":
        return "Qwen2Config", "Qwen2ForCausalLM", dict(common, use_sliding_window=True, sliding_window=window,
                                                       max_window_layers=0, layer_types=alternating)
    if family == "qwen3":
        return "Qwen3Config", "Qwen3ForCausalLM", dict(common, head_dim=head_dim, use_sliding_window=True,
                                                       sliding_window=window, layer_types=alternating)
    if family == "mistral":
        return "MistralConfig", "MistralForCausalLM", dict(common, head_dim=head_dim, sliding_window=window)
    if family == "phi3":
        return "Phi3Config", "Phi3ForCausalLM", dict(common, sliding_window=window,
                                                     original_max_position_embeddings=256)
    if family == "gemma2":
        return "Gemma2Config", "Gemma2ForCausalLM", dict(
            common, head_dim=head_dim, sliding_window=window, layer_types=alternating,
            query_pre_attn_scalar=3 * head_dim, attn_logit_softcapping=ATTN_SOFTCAP,
            final_logit_softcapping=FINAL_SOFTCAP)
    if family == "gemma3":
        return "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
            common, head_dim=head_dim, sliding_window=window, layer_types=gemma3_types,
            query_pre_attn_scalar=3 * head_dim, final_logit_softcapping=FINAL_SOFTCAP)
    if family == "qwen3_moe":
        return "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
            common, head_dim=head_dim, use_sliding_window=True, sliding_window=window, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=hidden, norm_topk_prob=True)
    if family == "gpt_oss":
        return "GptOssConfig", "GptOssForCausalLM", dict(
            common, head_dim=head_dim, sliding_window=window, layer_types=alternating, num_local_experts=4,
            num_experts_per_tok=2, intermediate_size=hidden,
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=64,
                                 beta_fast=32.0, beta_slow=1.0, truncate=False))
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILY_NAMES)}")


def tiny_family_target(family: str, *, layers: int = 2, hidden: int = 32, vocab: int = 64, heads: int = 4,
                       kv_heads: int = 2, head_dim=None, window: int = 5, seed: int = 0, dtype=torch.float32,
                       attn=None, experts=None, **overrides):
    """A tiny random target of ``family``'s own transformers class (fp32, no eos).

    Windows of ``window`` positions (every layer for Mistral / Phi-3 / Qwen3-MoE,
    alternating for Qwen2/3, Gemma2, gpt-oss, 5:1 for Gemma3), Gemma softcaps of
    :data:`ATTN_SOFTCAP` / :data:`FINAL_SOFTCAP`, a query scale that is not
    ``head_dim ** -0.5`` for Gemma, gpt-oss sinks of a few units. ``attn``: the
    attn_implementation (None: transformers' default for the class; eager for
    Gemma2, whose SDPA path in transformers 5.17 ignores the attention softcap);
    ``experts``: the MoE experts_implementation; ``overrides`` go to the config.
    """
    import transformers

    head_dim = head_dim or hidden // heads
    config_name, model_name, kwargs = _family_config(family, layers=layers, hidden=hidden, vocab=vocab, heads=heads,
                                                     kv_heads=kv_heads, head_dim=head_dim, window=window)
    kwargs.update(overrides)
    if attn is None and family == "gemma2":
        attn = "eager"  # transformers 5.17 would load SDPA, which drops the attention softcap (5.24 refuses it)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    if experts is not None:
        kwargs["experts_implementation"] = experts
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**kwargs)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and family in ("gemma2", "gemma3"):
                p.normal_(0.0, 0.1)  # (1 + w) norms: zeros would be the identity scale
            elif name.endswith("sinks"):
                p.normal_(1.0, 1.0)  # sink logits of the order of the scores: they take real mass
            elif name.endswith("router.weight") or name.endswith("gate.weight") or "experts" in name:
                p.normal_(0.0, 0.3)  # routes and experts that differ
            elif any(k in name for k in ("q_proj", "k_proj", "qkv_proj")):
                p.normal_(0.0, 0.5)  # scores of several units: the softcap bends them, windows matter
            elif p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.normal_(0.0, 0.3 / p.shape[1] ** 0.25)
        # logits of several units (Gemma: well past the final softcap, which then bends them)
        model.lm_head.weight.mul_(4.0 if family not in ("gemma2", "gemma3") else 12.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


# ------------------------------------------------------------------ hybrid targets (tests/families/test_hybrid.py)
#: The hybrid families :func:`tiny_hybrid_target` builds (transformers' own classes).
HYBRID_NAMES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


def tiny_hybrid_target(family: str = "qwen3_5", *, layers: int = 4, hidden: int = 32, vocab: int = 64,
                       layer_types=None, linear_k_heads: int = 2, linear_v_heads: int = 4, linear_k_dim: int = 8,
                       linear_v_dim: int = 8, conv_kernel: int = 4, heads: int = 4, kv_heads: int = 2,
                       head_dim: int = 16, seed: int = 0, dtype=torch.float32, experts=None, **overrides):
    """A tiny random hybrid target of transformers' own class (fp32, no eos).

    ``family``: ``"qwen3_5"`` (Qwen3_5ForCausalLM), ``"qwen3_next"``
    (Qwen3NextForCausalLM: MoE with a shared expert on every second layer,
    dense MLPs between) or ``"qwen3_5_moe"`` (Qwen3_5MoeForCausalLM). Layers
    alternate Gated-DeltaNet and full attention (``layer_types`` overrides),
    linear heads ``linear_k_heads`` / ``linear_v_heads`` (GQA 2 by default),
    conv kernel ``conv_kernel``; partial rotary (0.25) as the real models.
    Weights are redrawn so the linear layers matter: q/k/v projections of
    unit scale, decays ``exp(-A softplus(a + dt))`` spread over (0, 1), and a
    sharpened lm_head. ``experts``: the MoE experts_implementation.
    """
    import transformers

    if layer_types is None:
        layer_types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None, layer_types=list(layer_types), linear_conv_kernel_dim=conv_kernel,
                  linear_key_head_dim=linear_k_dim, linear_value_head_dim=linear_v_dim,
                  linear_num_key_heads=linear_k_heads, linear_num_value_heads=linear_v_heads)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
               shared_expert_intermediate_size=hidden)
    if family == "qwen3_5":
        config_name, model_name, kwargs = "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", common
    elif family == "qwen3_next":
        config_name, model_name = "Qwen3NextConfig", "Qwen3NextForCausalLM"
        kwargs = dict(common, **moe, decoder_sparse_step=2, norm_topk_prob=True)
    elif family == "qwen3_5_moe":
        config_name, model_name, kwargs = "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(common, **moe)
    else:
        raise ValueError(f"unknown hybrid family {family!r}; known: {', '.join(HYBRID_NAMES)}")
    kwargs = dict(kwargs, **overrides)
    if experts is not None:
        kwargs["experts_implementation"] = experts
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**kwargs)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 2.0).log())  # decays from ~0.97 down to ~0.25
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.6)
            elif name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.1)  # the gated norm scales by w
            elif "norm" in name and name.endswith("weight") and p.dim() == 1:
                p.normal_(0.0, 0.1)  # (1 + w) norms: not all the identity
            elif name.endswith("gate.weight") or "experts" in name:
                p.normal_(0.0, 0.3)
            elif p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.normal_(0.0, 0.6 / p.shape[1] ** 0.5 * 2)
        model.lm_head.weight.mul_(4.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


class ScheduledDraft(RiggedDraft):
    """A drafter whose round ``r`` proposes the reference's next ``schedule[r % len(schedule)]`` tokens, then
    wrong ones: a chain round then accepts exactly that many drafts (``B - 1``: the whole block), so a
    schedule ``0 .. B-1`` rejects at every block position once and accepts a whole block once."""

    def __init__(self, base: DFlashDraftModel, lm_head_weight: torch.Tensor, reference: torch.Tensor, schedule,
                 seed: int = 0):
        super().__init__(base, lm_head_weight, reference, p_right=1.0, seed=seed)
        self.schedule = [int(s) for s in schedule]
        self.rounds = 0

    def steered(self, block_pos, block_embeds):
        good = self.schedule[self.rounds % len(self.schedule)]
        self.rounds += 1
        ref = self.reference[block_pos.clamp(max=self.reference.numel() - 1)]
        wrong = wrong_tokens(ref, self.W.shape[0], self.rng)
        W = self.W.float()
        h = torch.stack([steer(W, [r] if j <= good else [w]) for j, (r, w) in enumerate(zip(ref, wrong))])
        return h.to(block_embeds.dtype).to(block_embeds.device)
