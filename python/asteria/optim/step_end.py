"""A step end as the schedule asks the cadence about it (``StepEnd``): the record the schedule
(``optim/schedule.py``) makes at every step end and hands to ``Cadence.due`` (``optim/cadence.py``)
and, under ``refresh_policy="drift"``, to the per-factor policy (``optim/per_factor.py``).

Owns: nothing but the record's fields. May call: nothing. Single-threaded (the training thread).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional


@dataclasses.dataclass
class StepEnd:
    """A step end as the schedule asks the cadence about it (``Cadence.due``)."""

    t: int
    #: [(REFRESH, param, block j, dims)]: the factors whose step count made them due
    #: (``Cadence.comes_due``), in the order the schedule batches them
    due: list
    #: this step end's time at the bounded barrier so far
    stall_ns: int
    #: does an S = 0 round run during the next forward and backward (``Schedule.defers``)?
    defers: bool
    #: [(REFRESH, param, j, dims)] -> [JobSpec]: the round these would make, as submitted
    price: Callable[[list], list]
    #: refresh_policy="drift": () -> {(param, j, dim): (snapshot step, install step)} of the
    #: refreshes in flight after this step end's installs
    in_flight: Callable[[], dict] = dict
    #: refresh_policy="drift": [((param, j, dim), snapshot step)] of the results installed since
    #: the last step end (a failed job's factor is not among them: its basis stays)
    installed: list = dataclasses.field(default_factory=list)
    #: refresh_policy="drift": (param, j, dim) -> the factor its refresh would take now
    factor: Optional[Callable] = None
    #: precondition_frequency="auto": () -> None once the REFRESH op's calibration jobs are
    #: done and their times are with the capacity record (``Schedule.calibrated``)
    calibrate: Callable[[], None] = lambda: None
