"""Whether the planner's ranking of layouts is the measured one (``benchmarks/planner.py``'s verdict, issue 24).

Tie rule: a layout's step time is measured over a few steps, and those steps spread; its **noise** is half
the range of its measured step times over their median (:func:`step_noise`). Two layouts whose measured step
times differ by no more than the larger of their two noises are **tied**: this run cannot tell which is
faster, so a predicted order between them is not a mismatch. Every other pair must be in the predicted order.

Rounds: on a shared VM the same work costs up to ~12% more CPU time in one run than in the next, more than
the steps of one run spread. The benchmark therefore measures the layouts in turns, several rounds (layout A,
B, ..., then A, B, ... again), and :func:`over_rounds` folds a layout's rounds into one figure (the median of
the rounds' medians) and one noise: the larger of its typical step-to-step noise (the median over rounds)
and the spread between rounds (half their range over their median), so a drift of the machine between
rounds counts as noise instead of as a difference between layouts.
Pure functions: the benchmark hands in the figures and prints the verdict's reason and ties.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def step_noise(times: Sequence[float]) -> float:
    """Half the range of ``times`` (one layout's measured steps) over their median; 0 for fewer than two."""
    if len(times) < 2:
        return 0.0
    return (max(times) - min(times)) / 2 / statistics.median(times)


@dataclass(frozen=True)
class Rounds:
    """One layout measured over several rounds (module docstring): ``medians`` the rounds' median steps,
    ``step_noise`` the median of the rounds' step-to-step noises."""

    medians: tuple[float, ...]
    step_noise: float

    @property
    def step_s(self) -> float:
        """The median of the rounds' medians."""
        return statistics.median(self.medians)

    @property
    def round_noise(self) -> float:
        """Half the range of the rounds' medians over their median: the machine's drift between rounds."""
        return step_noise(self.medians)

    @property
    def noise(self) -> float:
        """The larger of :attr:`step_noise` and :attr:`round_noise`."""
        return max(self.step_noise, self.round_noise)


def over_rounds(rounds: Sequence[Sequence[float]]) -> Rounds:
    """Fold one layout's rounds (each a list of its measured step times) into a :class:`Rounds`. Raises
    ``ValueError`` when no round has a step."""
    rounds = [r for r in rounds if r]
    if not rounds:
        raise ValueError("no measured steps in any round")
    return Rounds(tuple(statistics.median(r) for r in rounds), statistics.median(step_noise(r) for r in rounds))


@dataclass(frozen=True)
class Tie:
    """Two layouts measured within their noise: ``gap`` their relative difference (over the faster),
    ``tolerance`` the larger noise, ``swapped`` whether the prediction orders them the other way."""

    a: str
    b: str
    gap: float
    tolerance: float
    swapped: bool

    def describe(self) -> str:
        order = "predicted in the other order" if self.swapped else "predicted in this order"
        return (f"{self.a} ~ {self.b}: measured {self.gap:.1%} apart, within the larger step-to-step noise "
                f"{self.tolerance:.1%} ({order})")


@dataclass(frozen=True)
class RankingVerdict:
    """The predicted ranking against the measured one (module docstring): ``matches`` when no pair outside
    the ties is ordered otherwise; ``mismatches`` the pairs (faster measured first) that are; ``reason``."""

    predicted: tuple[str, ...]
    measured: tuple[str, ...]
    ties: tuple[Tie, ...]
    mismatches: tuple[tuple[str, str], ...]

    @property
    def matches(self) -> bool:
        return not self.mismatches

    @property
    def reason(self) -> str:
        excused = sum(t.swapped for t in self.ties)
        if self.predicted == self.measured:
            return "the same order"
        if self.matches:
            return f"the same order but for {excused} tied pair(s), measured within their noise"
        pairs = ", ".join(f"{a} < {b}" for a, b in self.mismatches)
        return f"measured {pairs} beyond their noise, predicted the other way"


def compare_rankings(predicted: Mapping[str, float], measured: Mapping[str, float],
                     noise: Mapping[str, float]) -> RankingVerdict:
    """The verdict on ``predicted`` and ``measured`` step times by layout, with each layout's ``noise``
    (:func:`step_noise`; a layout missing from it counts as 0: no tie on its account)."""
    names = sorted(measured, key=measured.__getitem__)
    ties, mismatches = [], []
    for a, b in itertools.combinations(names, 2):  # a measured no slower than b
        gap = (measured[b] - measured[a]) / measured[a] if measured[a] > 0 else float("inf")
        tolerance = max(noise.get(a, 0.0), noise.get(b, 0.0))
        swapped = predicted[a] > predicted[b]
        if gap <= tolerance:
            ties.append(Tie(a, b, gap, tolerance, swapped))
        elif swapped:
            mismatches.append((a, b))
    return RankingVerdict(tuple(sorted(predicted, key=predicted.__getitem__)), tuple(names), tuple(ties),
                          tuple(mismatches))
