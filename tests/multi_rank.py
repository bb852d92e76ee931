"""What the model-parallel test modules share: their prompts (inside one block, a few blocks, and longer
than every tiny sliding window) and the `engines` fixture (engines made in a test, one thread a rank,
their ranks stopped after it)."""

from __future__ import annotations

import pytest
from engine_helpers import make_engine

GREEDY = dict(temperature=0.0, ignore_eos=True)
N = 8


def prompts() -> list[list[int]]:
    # 5, 40 and 90 tokens: inside one block, a few blocks, and longer than every tiny sliding window.
    return [[(7 * j + 31 * i) % 390 + 3 for j in range(n)] for i, n in enumerate((5, 40, 90))]


@pytest.fixture
def engines():
    """Engines made in a test, their ranks stopped after it."""
    made = []

    def make(model_dir, **kw):
        kw.setdefault("threads", 1)
        e = make_engine(model_dir, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
