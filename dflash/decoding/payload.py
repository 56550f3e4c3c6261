"""The payload: what a round's verify hands the host, and the one place that knows its layout.

A verify returns one flat int64 tensor, a row per sequence (``b`` rows of
:attr:`Payload.size`), read on the host once per round. ``B`` is the block
size (``D = B - 1`` drafts), ``V`` the budget buckets of a tree round whose
budget is chosen per round (0 otherwise). One row:

==========  ==================  ===========================================================
method      offsets             fields
==========  ==================  ===========================================================
``ar``      ``[0]``             the target's choice
``dflash``  ``[0, B)``          ``choices``: the target's token after each block row
            ``B``               ``accepted`` ``a``: drafts accepted; ``choices[:a + 1]`` commit
``ddtree``  ``[0, B)``          ``committed``: the walked path's tokens, then the bonus (padded)
            ``B``               ``path_len``: path rows (root included) = tokens committed
            ``[B + 1, 2B + 1)`` per round only: ``path``, the path's node ids (padded)
            ``[2B + 1, +V)``    per round only: ``path_mass``, per bucket, times :data:`MASS_SCALE`
==========  ==================  ===========================================================

:meth:`Payload.pack` writes a row from the fields' device tensors (``[b, ...]``,
inside the traced verify); the other methods decode one host row (a list of
ints) into named fields.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

__all__ = ["MASS_SCALE", "Payload"]

#: the payload is int64: a path mass ``m`` in [0, D] travels as ``floor(m * MASS_SCALE)``
MASS_SCALE = 1 << 24


class Payload:
    """The row layout of one round's payload (module docstring): ``method``, block size ``B``, and ``buckets``,
    the node counts of the budget buckets when a tree round's budget is chosen per round (empty otherwise)."""

    def __init__(self, method: str, block_size: int, buckets: Sequence[int] = ()):
        if method not in ("ar", "dflash", "ddtree"):
            raise ValueError(f"no payload layout for method {method!r}")
        self.method, self.B = method, int(block_size)
        self.buckets = [int(n) for n in buckets] if method == "ddtree" else []
        #: where the count (``a`` / ``path_len``) sits, and where the per-round extras start
        self.count_at = 0 if method == "ar" else self.B
        self.path_at = self.B + 1
        self.mass_at = 2 * self.B + 1
        #: elements of one sequence's row
        self.size = {"ar": 1, "dflash": self.B + 1,
                     "ddtree": self.B + 1 + (self.B + len(self.buckets) if self.buckets else 0)}[method]

    # ------------------------------------------------------------ device side
    def pack(self, tokens: torch.Tensor, count: Optional[torch.Tensor] = None, path: Optional[torch.Tensor] = None,
             mass: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The flat payload of a batch: ``tokens`` ``[b]`` (AR: returned as it is) or ``[b, B]``, ``count [b]``,
        and for a per-round budget ``path [b, B]`` and ``mass [b, V]`` (int64, already in fixed point)."""
        if self.method == "ar":
            return tokens
        parts = [tokens, count[:, None]]
        if self.buckets:
            parts += [path, mass]
        return torch.cat(parts, 1).reshape(-1)

    # ------------------------------------------------------------ host side
    def rows(self, host: List[int]) -> List[List[int]]:
        """A payload read on the host, one list per sequence."""
        n = self.size
        return [host[r * n : (r + 1) * n] for r in range(len(host) // n)]

    def committed(self, row: List[int]) -> List[int]:
        """The tokens the round committed for one sequence."""
        if self.method == "ar":
            return row
        if self.method == "dflash":
            return row[: row[self.count_at] + 1]
        return row[: row[self.count_at]]

    def path(self, row: List[int]) -> List[int]:
        """A per-round-budget tree row's path: its node ids, the root (0) first."""
        return row[self.path_at : self.path_at + row[self.count_at]]

    def path_masses(self, row: List[int]) -> List[float]:
        """A per-round-budget tree row's ``path_mass`` per bucket, out of the fixed point."""
        return [x / MASS_SCALE for x in row[self.mass_at : self.mass_at + len(self.buckets)]]

    def bucket_acceptance(self, row: List[int]) -> List[int]:
        """Per budget bucket, the drafts its tree would have accepted in this round for one sequence: exact for
        the buckets up to the verified one, a lower bound above.

        The walk of a prefix tree (the first ``n`` nodes) follows the verified walk's path while its nodes are
        in the prefix: each node's target choice depends on its ancestors only, and a path's node ids
        increase. So bucket ``u`` accepts the path's nodes with ids ``<= n_u``."""
        path = self.path(row)
        return [sum(1 for node in path[1:] if node <= n) for n in self.buckets]
