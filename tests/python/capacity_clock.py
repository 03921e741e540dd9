"""A clock the test holds, for the capacity record's step timing (asteria.refresh.capacity).

``staleness="auto"`` and ``precondition_frequency="auto"`` choose from two kinds of seconds: a
REFRESH round's (the cost model's rates, measured by the executor's workers on their own clock)
and a training step's and its forward and backward's (measured by ``Capacity.step_start`` /
``step_end`` through the module's ``time.monotonic_ns``). On a loaded machine a step of a small
model takes whatever the scheduler gives it, so a test that wants a known choice holds the
second kind: ``hold_capacity_clock`` puts a ``StepClock`` where the capacity module reads
``time``, and the clock stands still until the test moves it (``advance``: the forward and
backward between one step's end and the next step's start). The rounds keep their real,
measured seconds; the test-only job delay (job_delay.py) bounds them from below, the clock's
seconds bound the steps from above and below.
"""

from __future__ import annotations

import time

from asteria.refresh import capacity


class StepClock:
    """``monotonic_ns()`` as the capacity module calls it: starts at the real monotonic time and
    moves only by ``advance``."""

    def __init__(self) -> None:
        self.ns = time.monotonic_ns()

    def monotonic_ns(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += int(round(seconds * 1e9))


def hold_capacity_clock(monkeypatch) -> StepClock:
    """A ``StepClock`` in place of ``asteria.refresh.capacity``'s ``time`` for this test (the
    module reads its clock as ``time.monotonic_ns()``; monkeypatch puts the module back)."""
    clock = StepClock()
    monkeypatch.setattr(capacity, "time", clock)
    return clock
