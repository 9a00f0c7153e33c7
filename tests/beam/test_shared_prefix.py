"""``shared_prefix``, which tells beam reselection how many of a row's slots already hold what
its source row holds, against a brute-force scan."""
from __future__ import annotations

import random

from staged_engine.beam.decoders import shared_prefix


def _brute(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_prefix_equals_a_scan():
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randrange(0, 40)
        a = tuple(rng.randrange(3) for _ in range(n))
        cut = rng.randrange(0, n + 1)
        b = a[:cut] + tuple(rng.randrange(3) for _ in range(rng.randrange(0, 40)))
        assert shared_prefix(a, b) == _brute(a, b), (a, b)
        assert shared_prefix(b, a) == _brute(a, b), (a, b)
    assert shared_prefix((), ()) == 0 and shared_prefix((1, 2), (1, 2)) == 2
