"""Multi-turn sessions for the TTFT benchmark: sessions x turns, the growth of each
turn, heavy-tailed gaps between turns, several sessions at once. Pure and seeded:
the same arguments give the same sessions, so every mode replays the same ones.

A session's turn 1 is a user message of ``first_words`` words; turn k > 1 adds the
previous answer and a user message of ``growth[(k - 2) % len(growth)]`` words (an
agent loop: long tool outputs and short follow-ups alternate). A word of the filler
text is about one token of the tiny model's tokenizer.

Gaps are log-normal (median ``gap_median`` s, shape ``gap_sigma``), capped at
``gap_max``: most turns follow quickly, a few after a long think. Sessions start
``stagger`` seconds apart.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    sessions: int = 4
    turns: int = 8
    first_words: int = 1000
    growth: tuple[int, ...] = (60, 400)
    gap_median: float = 1.5
    gap_sigma: float = 1.0
    gap_max: float = 20.0
    stagger: float = 2.0
    seed: int = 13

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise ValueError("sessions and turns must be at least 1")
        if not self.growth or any(g < 1 for g in self.growth):
            raise ValueError("growth needs at least one positive word count")
        if self.gap_median <= 0 or self.gap_sigma < 0 or self.gap_max < self.gap_median:
            raise ValueError("gaps: median > 0, sigma >= 0, max >= median")


@dataclass(frozen=True)
class SessionPlan:
    index: int
    start: float  # seconds after the run starts
    user_words: tuple[int, ...]  # per turn
    gaps: tuple[float, ...]  # before turns 2..n (seconds after the previous answer)
    seed: str  # of the filler text

    @property
    def name(self) -> str:
        return f"s{self.index}"


def user_words(w: Workload) -> tuple[int, ...]:
    return (w.first_words, *tuple(w.growth[(k - 2) % len(w.growth)] for k in range(2, w.turns + 1)))


def plan(w: Workload) -> list[SessionPlan]:
    rng = random.Random(w.seed)
    words = user_words(w)
    out = []
    for i in range(w.sessions):
        gaps = tuple(
            min(w.gap_max, w.gap_median * math.exp(rng.gauss(0.0, w.gap_sigma)))
            for _ in range(w.turns - 1)
        )
        out.append(SessionPlan(i, i * w.stagger, words, gaps, f"bench-{w.seed}-{i}"))
    return out


def history_tokens(w: Workload, answer_tokens: int) -> list[int]:
    """Approximate prompt tokens per turn (words ~ tokens, plus the answers)."""
    words = user_words(w)
    out, total = [], 0
    for k, n in enumerate(words):
        total += n + (answer_tokens if k else 0)
        out.append(total)
    return out
