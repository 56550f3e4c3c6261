"""What one generation is asked to do (:class:`LoopOptions`), the one table of defaults, and the input checks.

:data:`DEFAULTS` holds every generation option's default; :func:`dflash.generate`, :func:`dflash.apply`,
:func:`dflash.stream`, :func:`dflash.warmup`, the CLI and :class:`LoopOptions` read it, and none restates a
value of its own. Every loop takes its settings as one :class:`LoopOptions`;
:meth:`LoopOptions.resolve` checks them against the target and drafter once,
before anything runs, with errors that name the setting and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..drafter.config import DraftConfigError, validate_target_layer_ids
from .generation_config import SamplingSettings

__all__ = ["ACCEPTANCE_RULES", "AUTO_BUDGETS", "DEFAULTS", "GenerationDefaults", "LoopOptions", "METHODS", "RoundShape", "check_acceptance",
           "check_draft_window", "check_pair", "check_tree_budget", "default_tree_budget", "prepare_prompts"]

METHODS = ("ar", "dflash", "ddtree")

#: How a sampled round accepts drafts: ``"rejection"`` (drafts sampled from the drafter's processed distribution
#: q, kept with probability min(1, p / q), the first rejection resampled from max(p - q, 0)) or ``"match"``
#: (drafts at the drafter's argmax, kept while they equal the target's own sample). Both are lossless.
ACCEPTANCE_RULES = ("rejection", "match")

#: the budget buckets ``tree_budget="auto"`` chooses among each round (those a tree of the drafter's depth can fill)
AUTO_BUDGETS = (4, 8, 16, 32, 64)


@dataclass(frozen=True)
class GenerationDefaults:
    """The default of every generation option, the same for every entry point (:data:`DEFAULTS`).

    * ``method="dflash"``: one chain of ``B - 1`` drafts per round, the rounds every DFlash drafter is
      trained for. Its cost per round is the same on every device, nothing is measured before the first
      round, and a seeded sampled run draws the same tokens on any machine. ``"ddtree"`` (a tree of drafts
      per round) is the faster choice on GPUs where a wider verify is almost free, and is opt-in; ``"ar"``
      is the baseline. With no drafter, ``generate`` / ``stream`` refuse the default method (it needs one)
      and ``apply`` serves only ``assistant_model=`` calls.
    * ``tree_budget=None``: ``2 * (B - 1)`` draft nodes per DDTree round (:func:`default_tree_budget`), a
      fixed tree, so the tokens of a seeded run never depend on timings; ``"auto"`` chooses the budget each
      round from this device's measured costs (:mod:`dflash.decoding.budget_policy`), at a set-up cost.
    * ``block_size=None``, ``mask_token_id=None``: the drafter's own.
    * ``stage_timing=True``: per-stage times in the result. It costs no speed: a stage mark reads the wall
      clock on the CPU and records a CUDA event on CUDA (nothing waits); the one synchronize comes after the
      last round (:class:`dflash.decoding.output.StageClock`).
    * ``acceptance=None``: ``"rejection"`` for a sampled DFlash chain, ``"match"`` otherwise
      (:func:`check_acceptance`).
    * ``draft_window=None``: the drafter attends to every committed context row.
    * ``compile=False``: eager rounds (no set-up); ``True`` compiles them (CUDA graphs on CUDA).
    * ``max_cache_len="auto"``: what a new compiled round reserves: on CUDA the target's
      ``max_position_embeddings`` (capped by a quarter of the free memory), so a growing sequence of calls
      compiles once; nothing beyond the call's own rows on the CPU. Eager rounds ignore it.
    """

    method: str = "dflash"
    tree_budget: object = None
    block_size: Optional[int] = None
    mask_token_id: Optional[int] = None
    stage_timing: bool = True
    acceptance: Optional[str] = None
    draft_window: Optional[int] = None
    compile: object = False
    max_cache_len: object = "auto"


#: every generation option's default (:class:`GenerationDefaults`)
DEFAULTS = GenerationDefaults()


def default_tree_budget(block_size: int) -> int:
    """The DDTree budget of ``tree_budget=None``: ``2 * (B - 1)`` draft nodes, twice a chain's ``B - 1``."""
    return 2 * (int(block_size) - 1)


@dataclass
class LoopOptions:
    """The settings of one generation (``sampling`` wins over ``temperature`` when given).

    ``stopping_criteria(input_ids [1, n], None)`` is asked after every
    committed token; ``streamer`` gets ``put(prompt [1, T])`` first, then each
    round's committed tokens, then ``end()``. Defaults are :data:`DEFAULTS`'s:
    ``block_size`` / ``mask_token_id`` the drafter's, ``tree_budget`` ``2 * (B - 1)`` (``"auto"`` or a
    sequence of ints: the budget is chosen each round among those buckets,
    :mod:`dflash.decoding.budget_policy`);
    ``return_trees`` keeps each DDTree round's tree in ``result.trees``;
    ``stage_timing`` records per-stage times. ``acceptance``: the rule of a
    sampled DFlash chain (:data:`ACCEPTANCE_RULES`; None: ``"rejection"``);
    DDTree always walks its tree (``"match"``), greedy rounds match the argmax
    whatever the rule. ``attention_mask``: a left-padded batch's mask ``[b, T]``
    (each row's prompt is its tokens); ``pad_token_id`` pads a batch's rows
    that ended early, in ``result.output_ids``. ``prefill_chunk_size``: rows per prefill pass (None: the whole
    prompt in one pass, as transformers' ``generate()``). ``draft_window``: None (off) or an int ``W >= 1``: the
    drafter attends only to the last ``W`` context rows before its block
    (:func:`check_draft_window`); the output is the target's whatever ``W``, only acceptance changes.
    """

    max_new_tokens: int
    temperature: float = 0.0
    sampling: Optional[SamplingSettings] = None
    stop_token_ids: Optional[Sequence[int]] = None
    stopping_criteria: Optional[Callable] = None
    streamer: object = None
    seed: Optional[int] = None
    block_size: Optional[int] = DEFAULTS.block_size
    tree_budget: object = DEFAULTS.tree_budget
    mask_token_id: Optional[int] = DEFAULTS.mask_token_id
    return_trees: bool = False
    stage_timing: bool = DEFAULTS.stage_timing
    acceptance: Optional[str] = DEFAULTS.acceptance
    attention_mask: object = None
    pad_token_id: Optional[int] = None
    #: rows per prefill pass (``generation_config.prefill_chunk_size``, as transformers chunks its prefill); None:
    #: the whole prompt in one pass
    prefill_chunk_size: Optional[int] = None
    draft_window: Optional[int] = DEFAULTS.draft_window
    #: the resolved stop ids (set by :meth:`resolve`)
    stop_ids: set = field(default_factory=set, repr=False)

    def resolve(self, method: str, draft, vocab_size: int) -> "RoundShape":
        """Check every setting; fill ``sampling`` and ``stop_ids``; return the round's shape."""
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {n!r}")
        if self.sampling is None:
            t = self.temperature
            if t is None or isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
                raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
            self.sampling = SamplingSettings(float(t))
        elif not isinstance(self.sampling, SamplingSettings):
            raise TypeError(f"sampling must be a SamplingSettings, got {type(self.sampling).__name__}")
        self.temperature = self.sampling.temperature
        self.stop_ids = {int(t) for t in (self.stop_token_ids or ())}
        if self.return_trees and method != "ddtree":
            raise ValueError(f"return_trees applies to method 'ddtree' only, not {method!r}")
        acceptance = check_acceptance(self.acceptance, method)
        draft_window = check_draft_window(self.draft_window, method)
        if self.sampling.greedy:
            acceptance = "match"  # the argmax draft is accepted iff it is the target's argmax, under either rule
        if method == "ar":
            return RoundShape(method, 1, 0, 0)
        if draft is None:
            raise ValueError(f"method {method!r} needs a drafter (draft=DFlashDraftModel)")
        B = int(self.block_size if self.block_size is not None else draft.block_size)
        if B < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {B}")
        taps = getattr(draft, "conv_kernel_size", None)
        if taps is not None and B < taps:
            raise ValueError(f"block_size must be >= {taps} for this DFlash2 drafter (its convolutions span "
                             f"conv_kernel_size={taps} block positions), got {B}")
        mask_id = draft.mask_token_id if self.mask_token_id is None else int(self.mask_token_id)
        if not 0 <= mask_id < vocab_size:
            raise ValueError(f"mask_token_id {mask_id} is outside the vocabulary [0, {vocab_size})")
        budget, buckets = 0, ()
        if method == "ddtree":
            budget = check_tree_budget(default_tree_budget(B) if self.tree_budget is None else self.tree_budget)
            if not isinstance(budget, int):
                buckets = budget
                budget = buckets[-1]
        return RoundShape(method, B, budget, mask_id, acceptance, buckets, draft_window)


@dataclass(frozen=True)
class RoundShape:
    """The fixed shape of a generation's rounds: method, block size ``B`` (1 for AR), tree budget (0 unless
    DDTree), the block's mask id, the acceptance rule (``"rejection"`` only for sampled DFlash chains),
    for a budget chosen per round, its buckets (increasing; ``tree_budget`` is the largest; ``()``: fixed),
    and the drafter window (None: off; a static int, so compiled rounds trace it as a constant and a round of
    another window is another pool entry)."""

    method: str
    block_size: int
    tree_budget: int
    mask_token_id: int
    acceptance: str = "match"
    budget_buckets: tuple = ()
    draft_window: Optional[int] = None


def check_acceptance(acceptance, method: str) -> str:
    """The acceptance rule ``method`` runs with ``acceptance`` (None: the method's default), or a ValueError.

    DFlash chains: ``"rejection"`` (default) or ``"match"``. DDTree: ``"match"``
    only: its tree holds the drafter's top-N nodes, selected deterministically
    rather than sampled, and recursive rejection sampling over the siblings of
    such a tree (each sibling a point-mass draft) reduces to the walk, which
    accepts a child exactly when it is the target's own sample. AR has no drafts.
    """
    if acceptance is not None and acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {', '.join(map(repr, ACCEPTANCE_RULES))} (or None for the "
                         f"method's default), got {acceptance!r}")
    if method == "dflash":
        return acceptance or "rejection"
    if acceptance == "rejection":
        if method == "ddtree":
            raise ValueError("acceptance='rejection' applies to DFlash chains, not to method 'ddtree': a DDTree "
                             "round's tree holds the drafter's top-N nodes, selected deterministically rather than "
                             "sampled, and recursive rejection sampling over the siblings of such a tree reduces "
                             "to the walk (accept a child iff it is the target's sample), which DDTree already "
                             "runs; use acceptance='match' or leave it unset")
        raise ValueError(f"acceptance='rejection' applies to DFlash chains; method {method!r} drafts nothing")
    return "match"


def check_draft_window(draft_window, method: str = "dflash") -> Optional[int]:
    """The checked ``draft_window``: None (off: the drafter attends to every committed context row) or an int
    ``W >= 1`` (it attends only to the last ``W`` context rows before its block, i.e. the target's features of
    the ``W`` committed positions before the block's anchor, plus the block; each drafter layer's own sliding
    window still applies: :meth:`dflash.drafter.model.DraftLayer.round_window`). A ValueError saying what is
    allowed otherwise, or when ``method`` drafts nothing (``"ar"``)."""
    if draft_window is None:
        return None
    if isinstance(draft_window, bool) or not isinstance(draft_window, int) or draft_window < 1:
        raise ValueError(f"draft_window must be an int >= 1 (the drafter attends only to the last draft_window "
                         f"context rows before its block) or None (off: every context row), got {draft_window!r}")
    if method not in ("dflash", "ddtree"):
        raise ValueError(f"draft_window applies to the drafter (methods 'dflash' and 'ddtree'); method {method!r} "
                         f"drafts nothing: leave draft_window unset")
    return int(draft_window)


def check_tree_budget(tree_budget):
    """The checked ``tree_budget``: an int >= 1 (draft nodes per DDTree round), or the buckets of a budget chosen
    per round, an increasing tuple of ints >= 1 (``"auto"``: :data:`AUTO_BUDGETS`; a list or tuple of ints:
    those, sorted, repeats dropped); else a ValueError saying what is allowed."""
    allowed = ("tree_budget must be an int >= 1 (number of draft nodes per round), 'auto' (chosen each round "
               f"among {', '.join(map(str, AUTO_BUDGETS))}) or a list of such ints to choose among")
    if isinstance(tree_budget, str):
        if tree_budget == "auto":
            return AUTO_BUDGETS
        raise ValueError(f"{allowed}, got {tree_budget!r}")
    if isinstance(tree_budget, (list, tuple)):
        if not tree_budget or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in tree_budget):
            raise ValueError(f"{allowed}, got {tree_budget!r}")
        return tuple(sorted(set(tree_budget)))
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or tree_budget < 1:
        raise ValueError(f"{allowed}, got {tree_budget!r}")
    return tree_budget


def prepare_prompts(input_ids, vocab_size: int, device, attention_mask=None) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """``(prompts, padded)``: each row's prompt (``[T_r]`` int64 on ``device``, its left padding removed: the
    tokens where ``attention_mask`` is 1, every token without one) and the input as given (``[b, T]`` int64 on
    ``device``). ``input_ids``: ``[T]``, ``[1, T]`` or a left-padded batch ``[b, T]`` (a checked ``attention_mask
    [b, T]``, :func:`~dflash.decoding.generation_config.resolve_generation`); ints in the vocabulary."""
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [T] or [b, T], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError("the prompt is empty: generation needs at least one input token")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if attention_mask is not None:  # padding ids may lie anywhere; only the tokens must be in the vocabulary
        mask = torch.as_tensor(attention_mask).to(input_ids.device).bool()
        real = input_ids[mask]
        lo, hi = int(real.min()), int(real.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"input_ids hold ids outside the target vocabulary [0, {vocab_size}): min {lo}, max {hi}")
    padded = input_ids.to(device=device, dtype=torch.long)
    if attention_mask is None:
        return [row for row in padded], padded
    starts = (torch.as_tensor(attention_mask) == 0).sum(1).tolist()  # left padding: the zeros come first
    return [padded[r, start:] for r, start in enumerate(starts)], padded


def check_pair(adapter, draft) -> None:
    """The drafter fits the target: layer ids, hidden size, fc width, vocabulary, mask token.

    A drafter whose checkpoint format does not carry ``num_target_layers`` /
    ``vocab_size`` (None: transformers' native assistant, speculators' layer
    count) is checked here, against the target it is paired with.
    """
    cfg = draft.config
    if cfg.num_target_layers is not None and int(cfg.num_target_layers) != adapter.num_layers:
        raise DraftConfigError(
            f"drafter was built for a {cfg.num_target_layers}-layer target, this target has {adapter.num_layers} layers"
        )
    validate_target_layer_ids(draft.target_layer_ids, adapter.num_layers, warn_repeats=False)
    if cfg.hidden_size != adapter.hidden_size:
        raise DraftConfigError(f"drafter hidden_size {cfg.hidden_size} != target hidden size {adapter.hidden_size}")
    if cfg.vocab_size is not None and cfg.vocab_size != adapter.vocab_size:
        raise DraftConfigError(f"drafter vocab_size {cfg.vocab_size} != target vocabulary {adapter.vocab_size}")
    if not 0 <= draft.mask_token_id < adapter.vocab_size:
        raise DraftConfigError(f"drafter mask_token_id {draft.mask_token_id} is outside the target's vocabulary "
                               f"(size {adapter.vocab_size})")
    want = len(draft.target_layer_ids) * adapter.hidden_size
    if draft.fc.in_features != want:
        raise DraftConfigError(
            f"drafter fc takes {draft.fc.in_features} features but {len(draft.target_layer_ids)} target layers of "
            f"width {adapter.hidden_size} give {want}"
        )
