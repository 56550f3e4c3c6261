"""What a generation returns: the output ids and its statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

__all__ = ["GenerationResult", "position_acceptance"]


def position_acceptance(accepted: Sequence[int], block_size: int) -> List[float]:
    """Per draft position, the fraction of rounds whose accepted draft count reached it.

    ``accepted [R]``: drafts accepted in each of R rounds (each in
    ``[0, B - 1]``); ``block_size`` B: the anchor plus ``B - 1`` draft
    positions. Returns ``[a_1, ..., a_{B-1}]`` with

        a_k = #{r : accepted[r] >= k} / R,

    so ``1 >= a_1 >= a_2 >= ... >= 0`` and ``sum_k a_k`` is the mean accepted
    drafts per round (tau - 1 when no round was cut short). ``B = 1`` (no
    drafts, as for ``ar``) gives ``[]``; ``R = 0`` gives B - 1 zeros (no round
    reached any position), so lists of one block size always line up.
    Pooling several generations of one block size is this function on their
    concatenated rounds.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1 (the anchor plus the draft positions), got {block_size!r}")
    positions = block_size - 1
    reached = [0] * positions  # reached[k - 1]: rounds with at least k accepted drafts
    for n in accepted:
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= positions:
            raise ValueError(f"accepted draft counts must be ints in [0, {positions}] for block_size {block_size}, "
                             f"got {n!r}")
        for k in range(n):
            reached[k] += 1
    rounds = len(accepted)
    return [r / rounds if rounds else 0.0 for r in reached]


@dataclass
class GenerationResult:
    """Output ids and statistics of one generation.

    ``output_ids [1, prompt + new]``; ``acceptance_lengths``: tokens committed
    per round (bonus included; all 1 for ``ar``); times in seconds.
    ``block_size``: the B the rounds ran with (1 for ``ar``; None only on a
    result built by hand without it). ``accepted_depths``: drafts accepted per
    round as the verify found them, before the stop rules (``max_new_tokens``,
    a stop id, ``stopping_criteria``) cut the final round's commit short: a
    DFlash chain's accepted prefix, the depth of DDTree's accepted path; empty
    for ``ar``. So the final round's ``acceptance_lengths`` entry can be below
    its ``accepted_depths`` entry + 1; every earlier round's equals it.

    A batch (or a left-padded prompt): ``output_ids [b, T + n]`` is the input
    as given then each row's new tokens, padded to the longest with the pad id;
    ``rows`` holds each row's own result (its unpadded ``output_ids``, its
    rounds, its tau, its ``position_acceptance``); this result's round lists
    pool every row's rounds (so :attr:`tau` and :attr:`position_acceptance`
    are the batch's), and :attr:`num_new_tokens` counts every row's new
    tokens (what :attr:`tokens_per_second` divides).
    """

    output_ids: torch.Tensor
    num_prompt_tokens: int
    method: str
    acceptance_lengths: List[int] = field(default_factory=list)
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    commit_time: float = 0.0
    #: seconds spent compiling / capturing the steps before this generation (not in total_time); 0 when eager
    compile_time: float = 0.0
    tree_sizes: List[int] = field(default_factory=list)
    accepted_depths: List[int] = field(default_factory=list)
    trees: List[dict] = field(default_factory=list)
    #: the block size B of the rounds (anchor + B - 1 draft positions; 1 for ``ar``)
    block_size: Optional[int] = None
    #: a batch's per-row results (empty for one unpadded prompt)
    rows: List["GenerationResult"] = field(default_factory=list)
    #: how the target's lm_head ran: ``"fused"`` (the fused norm + lm_head ops read its plain weight) or
    #: ``"module"`` (its own forward at the needed rows: an adapter on it, a quantized weight;
    #: :mod:`dflash.target.head`); None on a result built by hand
    head_path: Optional[str] = None

    @property
    def sequences(self) -> torch.Tensor:
        """``output_ids`` under transformers' name (``GenerateDecoderOnlyOutput.sequences``)."""
        return self.output_ids

    @property
    def generated_ids(self) -> torch.Tensor:
        """The new tokens only, ``[1, new]``."""
        return self.output_ids[:, self.num_prompt_tokens :]

    @property
    def num_new_tokens(self) -> int:
        """New tokens generated (a batch: summed over its rows)."""
        if self.rows:
            return sum(row.num_new_tokens for row in self.rows)
        return self.output_ids.shape[1] - self.num_prompt_tokens

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (bonus included)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def accepted_drafts(self) -> List[int]:
        """Drafts accepted per round: ``accepted_depths`` when it holds one per round, else (``ar``, or a result
        built without it) ``acceptance_lengths - 1``, which undercounts a final round the stop rules cut short."""
        if len(self.accepted_depths) == self.num_rounds:
            return list(self.accepted_depths)
        return [a - 1 for a in self.acceptance_lengths]

    @property
    def position_acceptance(self) -> List[float]:
        """For each draft position ``k = 1 .. B - 1``, the fraction of rounds whose accepted drafts reached k.

        See :func:`position_acceptance`; counted from :attr:`accepted_drafts`,
        so a final round cut short by ``max_new_tokens`` or a stop id counts the
        drafts its verify accepted, not only those it committed. ``[]`` for
        ``ar``; B - 1 zeros when there were no rounds (the prefill's token
        ended the generation).
        """
        if self.method == "ar":
            return []
        if self.block_size is None:
            raise ValueError(f"position_acceptance needs the block size: this {self.method!r} result has "
                             "block_size=None (the loops set it; pass block_size= when building one by hand)")
        return position_acceptance(self.accepted_drafts, self.block_size)

    @property
    def decode_time(self) -> float:
        return self.total_time - self.time_to_first_token

    @property
    def time_per_output_token(self) -> float:
        """Decode time after the first token, per further token."""
        return self.decode_time / max(1, self.num_new_tokens - 1)

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.total_time if self.total_time > 0 else float("nan")

    def summary(self) -> dict:
        return dict(
            method=self.method,
            new_tokens=self.num_new_tokens,
            rounds=self.num_rounds,
            tau=self.tau,
            tokens_per_second=self.tokens_per_second,
            time_to_first_token=self.time_to_first_token,
            time_per_output_token=self.time_per_output_token,
            total_time=self.total_time,
            draft_time=self.draft_time,
            verify_time=self.verify_time,
            commit_time=self.commit_time,
            compile_time=self.compile_time,
            position_acceptance=self.position_acceptance,
            **({"rows": [row.summary() for row in self.rows]} if self.rows else {}),
        )
