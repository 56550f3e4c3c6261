"""``tree_budget="auto"``: the DDTree budget chosen each round, on the host, from measured costs and acceptance.

A round with budget buckets ``n_1 < ... < n_V`` (:attr:`Round.bucket_nodes`)
drafts the tree of the largest and verifies the first ``n_v`` nodes of it,
which are the best-first tree of budget ``n_v`` (:mod:`dflash.decoding.round`).
Which ``v``: the one that maximises expected committed tokens per second,

    v* = argmax_v  E_v / c_v(L),        E_v = 1 + r_v * m_v

* ``c_v(L)``: seconds of a round of bucket ``v`` (draft + verify + the
  payload's read) with ``L`` tokens committed. Measured on this device when the
  first round of these settings is set up
  (:func:`~dflash.decoding.bucket_costs.measure_round_costs`, once per target,
  drafter, dtypes, device, sampling mode, what runs the steps and batch-size
  bucket: :func:`~dflash.decoding.bucket_costs.costs_key`; not per prompt length
  nor cache size, so a later generation at any prompt length measures nothing)
  at two cache lengths, the empty cache and the longest prefix that first
  round's caches allow (an eager verify attends over the committed rows, so
  its cost grows with ``L``, the more the more rows it verifies), and
  interpolated linearly in ``L`` (extrapolated past the longer); each length's
  costs made nondecreasing in the
  bucket (:func:`monotone`: a larger tree never costs less, so a dip is noise).
  What the measurement cannot see (the host's bookkeeping per round, the
  caches' state) is learned from the rounds' own seconds: a residual per bucket
  over the rounds that verified it, shrunk toward one residual shared by all
  buckets while a bucket has few rounds (weight ``n / (n + COST_PRIOR_ROUNDS)``),
  so a bucket seldom chosen is judged by the shared residual, not by a few
  noisy rounds. Each round's seconds are first clipped to within
  :data:`COST_CLIP` of the bucket's measured cost around its expected cost: a
  round the machine stalled (another process on the core, ten times a round's
  time) would otherwise raise its bucket's own residual so far that the bucket
  lost every choice until exploration came back to it, dozens of rounds later,
  and then won back its place one clipped step at a time; a lasting change of
  the machine's speed still comes through, a step per round;
* ``m_v``: the drafter's own expected accepted drafts in bucket ``v``'s tree
  (the payload's ``path_mass``: the sum of the tree's path probabilities),
  smoothed over recent rounds (weight :data:`MASS_RATE` on the newest): how sure
  the drafter is on the text at hand;
* ``r_v``: how far the drafter's probabilities are off for that bucket: the
  drafts bucket ``v``'s tree did accept over the mass it predicted, both summed
  over the rounds that show it (weight :data:`CALIBRATION_RATE` on the newest),
  with a prior of :data:`PRIOR` drafts at ratio 1. A round that verified bucket
  ``w`` shows every bucket ``u <= w`` exactly: the walk of the first ``n_u``
  nodes follows the verified path while its node ids are ``<= n_u``
  (:meth:`~dflash.decoding.payload.Payload.bucket_acceptance`). Larger buckets stay
  at their last estimate, the prior before any (the drafter taken at its word:
  an optimistic start, so a bucket worth trying is tried).

The set-up measurement is a few rounds per bucket, and on a noisy machine
its error can be as large as the differences it must decide (README, the
per-round budget's results); a bucket never chosen would never correct its
own. So every :data:`EXPLORE_EVERY`-th
choice verifies the runner-up instead of the best: its residual is then
learned from its own rounds too, and a bucket judged by a wrong measurement
wins back its place (one round in :data:`EXPLORE_EVERY` at the second-best
rate, the cheapest way to keep both estimates live). The schedule counts the
policy's choices, so a sampled generation's fresh policy makes the same
choices under the same seed.

The smoothing is slow on purpose: the choice is made before the round drafts
(reading its masses first would be a second host read), so it rests on what
the last rounds said, and one round's masses predict the next round's best
bucket poorly: a weight of :data:`MASS_RATE` on the newest round averages
over about ``1 / MASS_RATE`` rounds.

The choice changes only which prefix of the drafted tree is verified, so every
round is lossless whatever it picks. The chain is not among the choices: at
the same verify rows (``B``) the best-first tree of ``B - 1`` nodes holds at
least the chain's mass (it is the top ``B - 1`` nodes by path probability, and
the chain is one subtree of that size), so by the drafter's own estimate a
tree is never worse; a DFlash round saves only the tree build and the
compaction, which the measured costs already include.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

__all__ = ["BudgetPolicy", "CALIBRATION_RATE", "COST_CLIP", "COST_PRIOR_ROUNDS", "COST_RATE", "EXPLORE_EVERY",
           "MASS_RATE", "PRIOR", "monotone"]

#: weight of the newest round in the smoothed path masses
MASS_RATE = 0.1
#: weight of the newest round in the cost residuals
COST_RATE = 1.0 / 8
#: rounds of its own after which a bucket's cost residual weighs as much as the shared one
COST_PRIOR_ROUNDS = 4.0
#: weight of the newest showing round in a bucket's calibration sums (acceptance drifts slowly along a text)
CALIBRATION_RATE = 1.0 / 64
#: prior of the calibration, in drafts at ratio 1 (the drafter's probabilities taken as they are at first)
PRIOR = 2.0
#: every this many choices, the runner-up bucket is verified instead of the best (module docstring)
EXPLORE_EVERY = 64
#: a round's seconds count at most this share of its bucket's measured cost away from the expected ones
COST_CLIP = 0.25


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


def _ewma(old: Optional[float], new: float, rate: float) -> float:
    return new if old is None else (1 - rate) * old + rate * new


class BudgetPolicy:
    """The per-round budget choice of the generations of one target and settings (module docstring).

    ``costs [V]``: the measured seconds per round of each bucket with
    ``lengths[0]`` tokens committed; ``long_costs [V]``: the same with
    ``lengths[1]`` (None: costs that do not depend on the length).
    :meth:`start` begins a generation, :meth:`choose` gives the bucket of the
    next round, :meth:`observe` takes what the round's payload said. The
    calibration and the cost residuals carry over from one generation to the
    next (the drafter, the target and the device stay the same); generations
    run at once on one target share them, which can only blur the estimates
    (each update is one float per bucket), never a round's tokens.
    """

    def __init__(self, costs: Sequence[float], long_costs: Optional[Sequence[float]] = None,
                 lengths: Sequence[int] = (0, 1)):
        for name, values in (("costs", costs), ("long_costs", long_costs)):
            if values is not None and (not values or any(not c > 0 for c in values)):
                raise ValueError(f"{name} must be positive seconds per bucket, got {list(values)!r}")
        if long_costs is not None and len(long_costs) != len(costs):
            raise ValueError(f"costs and long_costs must have one value per bucket, got {len(costs)} and "
                             f"{len(long_costs)}")
        if long_costs is not None and not lengths[1] > lengths[0]:
            raise ValueError(f"lengths must be two increasing committed lengths, got {list(lengths)!r}")
        self.short = monotone(costs)
        self.long = monotone(long_costs) if long_costs is not None else list(self.short)
        self.lengths = (int(lengths[0]), int(lengths[1]))
        V = len(self.short)
        self.shared = None  # the residual of every round (smoothed), None before any timed round
        self.residual: List[Optional[float]] = [None] * V  # per bucket, over the rounds that verified it
        self.rounds = [0] * V
        self.mass: List[float] = []  # smoothed m_v
        self.accepted = [0.0] * V  # decayed sums of the drafts each bucket accepted, over the rounds showing it
        self.predicted = [0.0] * V  # and of the mass the drafter gave them
        self.choices: List[int] = []
        self.opening: Optional[int] = None  # the first round's bucket: the one the last generation chose most
        self.decisions = 0  # choices made from estimates, over every generation (the exploration's clock)

    def start(self) -> None:
        """A new generation: the smoothed masses start over (a new text), the calibration and costs carry on,
        and the first round (no masses yet) takes the bucket the previous generation chose most often."""
        if self.choices:
            self.opening = max(set(self.choices), key=lambda v: (self.choices.count(v), -v))
        self.mass = []
        self.choices = []

    def fresh(self) -> "BudgetPolicy":
        """A policy with this one's set-up measurement and nothing learned: what a sampled generation runs with.

        A sampled round draws its noise by verify row, so the tokens a seed gives depend on the trees verified;
        learned residuals (wall-clock seconds) and calibration carried over from other generations would make
        them differ from call to call. With the measured costs alone (kept per process) and what this
        generation's own rounds show (observed without seconds), the same seed chooses the same buckets and
        gives the same tokens in one process."""
        copy = BudgetPolicy(self.short, self.long, self.lengths)
        copy.start()
        return copy

    def measured(self, length: int) -> List[float]:
        """The set-up measurement's seconds per bucket at ``length`` committed tokens (linear in the length,
        extrapolated past the two measured lengths, never below the shorter length's)."""
        (l0, l1), out = self.lengths, []
        t = (length - l0) / (l1 - l0)
        for a, b in zip(self.short, self.long):
            out.append(max(a + t * (b - a), min(a, b)))
        return out

    def costs(self, length: int) -> List[float]:
        """``c_v(L)``: the expected seconds of a round of each bucket with ``length`` tokens committed."""
        out = []
        for v, c in enumerate(self.measured(length)):
            shared = self.shared or 0.0
            own = self.residual[v]
            w = self.rounds[v] / (self.rounds[v] + COST_PRIOR_ROUNDS)
            out.append(max(c + (shared if own is None else w * own + (1 - w) * shared), 1e-9))
        return out

    def ratios(self) -> List[float]:
        """``r_v`` per bucket."""
        return [(a + PRIOR) / (p + PRIOR) for a, p in zip(self.accepted, self.predicted)]

    def expected(self) -> List[float]:
        """``E_v``: expected committed tokens of a round of each bucket (1 per bucket before any round)."""
        if not self.mass:
            return [1.0] * len(self.short)
        return [1.0 + r * m for r, m in zip(self.ratios(), self.mass)]

    def choose(self, length: int = 0) -> int:
        """The bucket of the next round, with ``length`` tokens committed: the best expected tokens per second
        (before any round of this generation: the previous generation's most chosen bucket, the middle one at the
        very first; every :data:`EXPLORE_EVERY`-th choice the runner-up)."""
        if not self.mass:
            v = (len(self.short) - 1) // 2 if self.opening is None else self.opening
        else:
            rates = [e / c for e, c in zip(self.expected(), self.costs(length))]
            ranked = sorted(range(len(rates)), key=lambda u: (-rates[u], u))
            self.decisions += 1
            explore = len(ranked) > 1 and self.decisions % EXPLORE_EVERY == 0
            v = ranked[1] if explore else ranked[0]
        self.choices.append(v)
        return v

    def observe(self, bucket: int, accepted: Sequence[int], masses: Sequence[float], seconds: float = 0.0,
                length: int = 0) -> None:
        """A round verified ``bucket`` in ``seconds`` (0: not timed) with ``length`` tokens committed before it;
        ``accepted [V]``: the drafts each bucket would have accepted (exact up to ``bucket``); ``masses [V]``:
        each bucket's path mass (expected accepted drafts, by the drafter)."""
        if seconds > 0:
            measured = self.measured(length)[bucket]
            # winsorized: a round the machine stalled (or sped) past COST_CLIP of the bucket's cost moves the
            # residuals as one at the bound would; an outlier must not lock a bucket out (module docstring)
            expect = self.costs(length)[bucket]
            seconds = min(max(seconds, expect - COST_CLIP * measured), expect + COST_CLIP * measured)
            extra = seconds - measured
            self.shared = _ewma(self.shared, extra, COST_RATE)
            self.residual[bucket] = _ewma(self.residual[bucket], extra, COST_RATE)
            self.rounds[bucket] += 1
        totals = [float(m) for m in masses]
        if not self.mass:
            self.mass = totals
        else:
            self.mass = [(1 - MASS_RATE) * old + MASS_RATE * new for old, new in zip(self.mass, totals)]
        keep = 1.0 - CALIBRATION_RATE
        for u in range(bucket + 1):
            self.accepted[u] = keep * self.accepted[u] + float(accepted[u])
            self.predicted[u] = keep * self.predicted[u] + totals[u]
