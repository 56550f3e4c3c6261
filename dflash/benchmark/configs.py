"""The benchmark's configurations: which method runs at which temperature, budget and block size.

A configuration is one row of the result table. :func:`expand_configs` gives
them in table order: per temperature ``ar`` first (the speedup baseline, always
run), then ``dflash`` per block size, ``ddtree`` per block size x budget, and the
peers (``hf`` at T = 0 only, ``hf-sample`` at T > 0 only, ``prompt-lookup`` at
every temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

OUR_METHODS = ("ar", "dflash", "ddtree")
PEER_METHODS = ("hf", "hf-sample", "prompt-lookup")
ALL_METHODS = OUR_METHODS + PEER_METHODS
PROMPT_LOOKUP_TOKENS = 10


@dataclass(frozen=True)
class BenchConfig:
    """One measured configuration; ``budget`` is DDTree's node budget, ``block_size`` the drafter's block."""

    method: str
    temperature: float
    budget: Optional[int] = None
    block_size: Optional[int] = None

    @property
    def label(self) -> str:
        parts = [self.method]
        if self.budget is not None:
            parts.append(f"budget {self.budget}")
        if self.block_size is not None:
            parts.append(f"block {self.block_size}")
        parts.append(f"T={self.temperature:g}")
        return ", ".join(parts)


def expand_configs(methods: Sequence[str], budgets: Sequence[int], temperatures: Sequence[float],
                   block_sizes: Sequence[int]) -> List[BenchConfig]:
    """All configurations in table order; ``ar`` is added at every temperature (the baseline).

    ``hf`` runs only at T = 0 and ``hf-sample`` only at T > 0 (greedy and
    sampled decoding of transformers' own ``generate``).
    """
    configs: List[BenchConfig] = []
    for t in temperatures:
        configs.append(BenchConfig("ar", t))
        if "dflash" in methods:
            configs += [BenchConfig("dflash", t, block_size=b) for b in block_sizes]
        if "ddtree" in methods:
            configs += [BenchConfig("ddtree", t, budget=n, block_size=b) for b in block_sizes for n in budgets]
        if "hf" in methods and t == 0:
            configs.append(BenchConfig("hf", t))
        if "hf-sample" in methods and t > 0:
            configs.append(BenchConfig("hf-sample", t))
        if "prompt-lookup" in methods:
            configs.append(BenchConfig("prompt-lookup", t))
    return configs
