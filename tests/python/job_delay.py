"""The test-only job delay: every job submitted to a runtime afterwards sleeps that long on its
worker before computing (a slow rank, a job kept in flight across a fork or a signal).

libasteria's ``ast__runtime_set_job_delay`` (src/testing.h) is bound in ``asteria._C_testing``,
a module whose init function lives in asteria._C's own shared object and which the package
never imports. It is loaded here from that file, so the tests drive the one libasteria of the
package under test (the installed wheel, or the source tree's build).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from typing import Any, Optional, Sequence

from asteria import _C

MODULE = "asteria._C_testing"


def testing_module():
    """asteria._C_testing, loaded once per process from asteria._C's file."""
    mod = sys.modules.get(MODULE)
    if mod is None:
        loader = importlib.machinery.ExtensionFileLoader(MODULE, _C.__file__)
        spec = importlib.util.spec_from_file_location(MODULE, _C.__file__, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        sys.modules[MODULE] = mod
    return mod


def set_job_delay(runtime: Any, delay_ms: int) -> None:
    """Every job submitted to ``runtime`` (an ``asteria._C.Runtime``) afterwards sleeps
    ``delay_ms`` (0..600000) first; ValueError outside that range, TypeError for another
    object."""
    testing_module().set_job_delay(runtime, delay_ms)


def runtimes_of(obj: Any) -> list:
    """Every ``asteria._C.Runtime`` reachable from ``obj`` (an optimizer, an engine) through the
    attributes of asteria's objects and the containers they hold: the optimizer's engine may be
    wrapped (split, replicated), and the walk does not depend on how."""
    found, seen, todo = [], set(), [obj]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, _C.Runtime):
            found.append(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo.extend(x)
        elif type(x).__module__.startswith("asteria.") and hasattr(x, "__dict__"):
            todo.extend(vars(x).values())
    return found


def delay_jobs(obj: Any, delay_ms: int) -> int:
    """Applies the job delay to every runtime of ``obj`` (an optimizer right after its
    construction, an engine); returns how many. ValueError when it has none (a sync-mode
    optimizer runs no job on a runtime)."""
    runtimes = runtimes_of(obj)
    if not runtimes:
        raise ValueError(f"no asteria._C.Runtime reachable from {type(obj).__name__}: only "
                         "mode='async' runs jobs on libasteria's runtime")
    for rt in runtimes:
        set_job_delay(rt, delay_ms)
    return len(runtimes)


def set_job_stretch(runtime: Any, factor: float, ops: Optional[Sequence[str]] = None) -> None:
    """A host 1/``factor`` as fast on this one: every job of an op named in ``ops`` (None: every
    op) submitted to ``runtime`` (an ``asteria._C.Runtime``) afterwards holds its worker
    ``factor`` times as long as it computed (``ast__runtime_set_job_stretch``, src/testing.h:
    the worker sleeps (factor - 1) x its compute before the job is done, burning no CPU).
    ``factor`` 1..1000 (1: no stretch); ValueError outside that range or for a name that is no
    op, TypeError for another object."""
    testing_module().set_job_stretch(runtime, factor, ops)


def job_stretch_totals(runtime: Any) -> tuple[int, int]:
    """(compute_ns, slept_ns) of ``runtime``'s stretched jobs so far: their computes' wall time
    and the sleeps that stretched them (each at least (factor - 1) x its compute)."""
    return testing_module().job_stretch_totals(runtime)


def stretch_jobs(obj: Any, factor: float, ops: Optional[Sequence[str]] = None) -> int:
    """Applies the job stretch to every runtime of ``obj`` (an optimizer right after its
    construction, an engine); returns how many (0: a sync-mode optimizer, which runs no job on
    a runtime)."""
    runtimes = runtimes_of(obj)
    for rt in runtimes:
        set_job_stretch(rt, factor, ops)
    return len(runtimes)
