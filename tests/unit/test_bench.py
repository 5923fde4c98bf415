"""The benchmarks' own logic (bench/ is not a test tier; these keep its arithmetic
honest): the workload generator and the break-even interpolation."""

from __future__ import annotations

import pytest

from bench import workload as wl
from bench.breakeven import break_even


def test_workload_is_seeded_and_alternates_growth() -> None:
    w = wl.Workload(sessions=3, turns=5, first_words=100, growth=(10, 50), seed=1)
    assert wl.plan(w) == wl.plan(w)
    assert wl.user_words(w) == (100, 10, 50, 10, 50)
    assert [s.start for s in wl.plan(w)] == [0.0, 2.0, 4.0]


def test_workload_gaps_are_heavy_tailed_and_capped() -> None:
    w = wl.Workload(sessions=200, turns=6, gap_median=1.0, gap_sigma=1.0, gap_max=8.0, seed=3)
    gaps = sorted(g for s in wl.plan(w) for g in s.gaps)
    median = gaps[len(gaps) // 2]
    assert 0.8 < median < 1.25
    assert gaps[-1] == 8.0  # the cap is reached: the tail is long
    assert gaps[int(len(gaps) * 0.95)] > 4 * median


def test_workload_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="growth"):
        wl.Workload(growth=())
    with pytest.raises(ValueError, match="gaps"):
        wl.Workload(gap_median=5, gap_max=1)


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        # pull (first) loses at 64, wins from 128: crossing halfway between (diff -1 -> +1)
        ({64: (2.0, 1.0), 128: (2.0, 3.0), 256: (2.0, 5.0)}, 96.0),
        ({64: (1.0, 2.0), 128: (1.0, 3.0)}, 64.0),  # pull wins everywhere
        ({64: (2.0, 1.0), 128: (3.0, 2.0)}, None),  # never
        # a noisy win at 64 that does not last: the last lasting crossing counts
        ({64: (1.0, 1.5), 128: (2.0, 1.0), 256: (2.0, 4.0)}, 128 + 128 * 1.0 / 3.0),
    ],
)
def test_break_even_interpolates_the_lasting_crossing(points: dict, expected: float | None) -> None:
    got = break_even(points)
    assert got == pytest.approx(expected) if expected is not None else got is None


def direct_samples(noise: float = 0.0, seed: int = 1) -> list:
    """Legs of the bench's shape at 17 ms a pull, 0.5 ms a pulled token, 1.3 ms a
    computed one (the break-even: 21.25 tokens)."""
    import random

    from bench.breakeven import TAIL_TOKENS, Sample

    rnd = random.Random(seed)
    out = []
    for n in (8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048):
        for _ in range(8 if n <= 64 else 3):
            prompt = n + 1 + TAIL_TOKENS
            pull = 0.05 + 0.017 + 0.0005 * n + 0.0013 * (prompt - n)
            rec = 0.05 + 0.0013 * prompt
            jitter = (rnd.lognormvariate(0, noise) for _ in range(2))
            out.append(Sample(None, n, pull * next(jitter), rec * next(jitter), float(n), 0.0))
    return out


def test_the_bench_measures_the_break_even_as_the_tuner_fits_it() -> None:
    from bench.breakeven import bootstrap, fitted_break_even, loss_ms

    be, solved = fitted_break_even(direct_samples())
    assert be == pytest.approx(21.25, rel=1e-6)
    # A threshold of 8 pulls 8..21-token histories at a loss: at most 17 - 8 x 0.8 ms;
    # one of 30 misses the pulls of 22..29 tokens: at most 29 x 0.8 - 17 ms.
    assert loss_ms(solved, 8, 8, 2048) == pytest.approx(17 - 8 * 0.8, rel=1e-6)
    assert loss_ms(solved, 30, 8, 2048) == pytest.approx(29 * 0.8 - 17, rel=1e-6)
    assert loss_ms(solved, 22, 8, 2048) == 0.0
    lo, hi = bootstrap(direct_samples(noise=0.05), rounds=60)
    assert lo < 21.25 < hi
