"""What a generation returns: the output ids and its statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch


@dataclass
class GenerationResult:
    """Output ids and statistics of one generation.

    ``output_ids [1, prompt + new]``; ``acceptance_lengths``: tokens committed
    per round (bonus included; all 1 for ``ar``); times in seconds.
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
        return self.output_ids.shape[1] - self.num_prompt_tokens

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (bonus included)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

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
        )
