"""``tree_budget="auto"``: the DDTree budget chosen each round, on the host, from measured costs and acceptance.

A round with budget buckets ``n_1 < ... < n_V`` (:attr:`Round.bucket_nodes`)
drafts the tree of the largest and verifies the first ``n_v`` nodes of it,
which are the best-first tree of budget ``n_v`` (:mod:`dflash.decoding.round`).
Which ``v``: the one that maximises expected committed tokens per second,

    v* = argmax_v  E_v / c_v,        E_v = 1 + r_v * m_v

* ``c_v``: seconds of a round of bucket ``v`` (draft + verify + the payload's
  read), measured on this device when the round is set up
  (:meth:`~dflash.decoding.compiled.RoundSteps.measure_costs`, on empty caches;
  kept per target and settings, so once per process), made nondecreasing in
  the bucket (:func:`monotone`: a larger tree never costs less, so a dip is
  noise), plus one offset for all buckets: the rounds' own seconds minus that
  estimate, over recent rounds (weight :data:`COST_RATE` on the newest), what
  the set-up measurement cannot see (the host's bookkeeping, the prefix the
  attention reads). One offset, not one per bucket: a bucket seldom chosen
  would otherwise be judged by a few noisy rounds;
* ``m_v``: the drafter's own expected accepted drafts in bucket ``v``'s tree
  (the payload's ``depth_mass``, summed over depths: the sum of the tree's path
  probabilities), smoothed over recent rounds (weight :data:`MASS_RATE` on the
  newest): how sure the drafter is on the text at hand;
* ``r_v``: how far the drafter's probabilities are off for that bucket: the
  drafts bucket ``v``'s tree did accept over the mass it predicted, both summed
  over the rounds that show it (weight :data:`CALIBRATION_RATE` on the newest),
  with a prior of :data:`PRIOR` drafts at ratio 1. A round that verified bucket
  ``w`` shows every bucket ``u <= w`` exactly: the walk of the first ``n_u``
  nodes follows the verified path while its node ids are ``<= n_u``
  (:meth:`~dflash.decoding.round.Round.bucket_acceptance`). Larger buckets stay
  at their last estimate, the prior before any (the drafter taken at its word:
  an optimistic start, so a bucket worth trying is tried).

The choice changes only which prefix of the drafted tree is verified, so every
round is lossless whatever it picks. The chain is not among the choices: at
the same verify rows (``B``) the best-first tree of ``B - 1`` nodes holds at
least the chain's mass (it is the top ``B - 1`` nodes by path probability, and
the chain is one subtree of that size), so by the drafter's own estimate a
tree is never worse; a DFlash round saves only the tree build and the
compaction, which the measured costs already include.
"""

from __future__ import annotations

from typing import List, Sequence

__all__ = ["BudgetPolicy", "CALIBRATION_RATE", "COST_RATE", "MASS_RATE", "PRIOR", "monotone"]

#: weight of the newest round in the smoothed depth masses (the next tree looks most like the last ones)
MASS_RATE = 0.5
#: weight of the newest round in the measured costs' correction
COST_RATE = 1.0 / 8
#: weight of the newest showing round in a bucket's calibration sums (acceptance drifts slowly along a text)
CALIBRATION_RATE = 1.0 / 16
#: prior of the calibration, in drafts at ratio 1 (the drafter's probabilities taken as they are at first)
PRIOR = 2.0


def monotone(values: Sequence[float]) -> List[float]:
    """The nondecreasing sequence closest to ``values`` in least squares (pool adjacent violators: each run that
    decreases is replaced by its mean)."""
    blocks: List[List[float]] = []  # [sum, count]
    for x in values:
        blocks.append([float(x), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out: List[float] = []
    for total, count in blocks:
        out += [total / count] * count
    return out


class BudgetPolicy:
    """The per-round budget choice of the generations of one target and settings (module docstring).

    ``costs [V]``: the measured seconds per round of each bucket.
    :meth:`start` begins a generation, :meth:`choose` gives the bucket of the
    next round, :meth:`observe` takes what the round's payload said. The
    calibration and the cost corrections carry over from one generation to the
    next (the drafter, the target and the device stay the same); generations
    run at once on one target share them, which can only blur the estimates
    (each update is one float per bucket), never a round's tokens.
    """

    def __init__(self, costs: Sequence[float]):
        if not costs or any(not c > 0 for c in costs):
            raise ValueError(f"costs must be positive seconds per bucket, got {list(costs)!r}")
        self.measured = monotone(costs)
        V = len(self.measured)
        self.offset = 0.0  # seconds the rounds took beyond the measured costs (smoothed)
        self._timed = False
        self.mass: List[float] = []  # smoothed m_v
        self.accepted = [0.0] * V  # decayed sums of the drafts each bucket accepted, over the rounds showing it
        self.predicted = [0.0] * V  # and of the mass the drafter gave them
        self.choices: List[int] = []

    def start(self) -> None:
        """A new generation: the smoothed masses start over (a new text), the calibration and costs carry on."""
        self.mass = []
        self.choices = []

    @property
    def costs(self) -> List[float]:
        """``c_v``: the expected seconds of a round of each bucket."""
        return [max(c + self.offset, 1e-9) for c in self.measured]

    def ratios(self) -> List[float]:
        """``r_v`` per bucket."""
        return [(a + PRIOR) / (p + PRIOR) for a, p in zip(self.accepted, self.predicted)]

    def expected(self) -> List[float]:
        """``E_v``: expected committed tokens of a round of each bucket (1 per bucket before any round)."""
        if not self.mass:
            return [1.0] * len(self.measured)
        return [1.0 + r * m for r, m in zip(self.ratios(), self.mass)]

    def choose(self) -> int:
        """The bucket of the next round: the best expected tokens per second (the middle bucket at first)."""
        if not self.mass:
            v = (len(self.measured) - 1) // 2
        else:
            rates = [e / c for e, c in zip(self.expected(), self.costs)]
            v = max(range(len(rates)), key=rates.__getitem__)
        self.choices.append(v)
        return v

    def observe(self, bucket: int, accepted: Sequence[int], masses: Sequence[Sequence[float]],
                seconds: float = 0.0) -> None:
        """A round verified ``bucket`` in ``seconds`` (0: not timed); ``accepted [V]``: the drafts each bucket would
        have accepted (exact up to ``bucket``); ``masses [V][D]``: its tree's depth masses."""
        if seconds > 0:
            extra = seconds - self.measured[bucket]
            self.offset = extra if not self._timed else (1 - COST_RATE) * self.offset + COST_RATE * extra
            self._timed = True
        totals = [float(sum(row)) for row in masses]
        if not self.mass:
            self.mass = totals
        else:
            self.mass = [(1 - MASS_RATE) * old + MASS_RATE * new for old, new in zip(self.mass, totals)]
        keep = 1.0 - CALIBRATION_RATE
        for u in range(bucket + 1):
            self.accepted[u] = keep * self.accepted[u] + float(accepted[u])
            self.predicted[u] = keep * self.predicted[u] + totals[u]
