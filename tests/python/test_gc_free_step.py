"""A training step leaves no reference cycles behind, and the hooks' log stays bounded.

OLMo-core's trainer turns Python's automatic cycle collector off for training
(GarbageCollectorCallback, a gen-1 collection every 1000 steps); with the collector on, a
full collection of a torch process stops the training thread for 100+ ms. Either way, a step
that makes cyclic garbage costs: it grows the process when the collector is off, and it
brings the collections sooner when it is on. So here, with the collector off, every step of
every optimizer (async and sync, with the staging ring and the hooks of ``attach``, through
refreshes, installs and SOAP's worker-side rotation) must leave nothing for ``gc.collect()``.
"""

import collections
import gc

import pytest

from asteria import SOAP, attach, detach, hooks
from models import loss_and_grad, make_model, optimizer_makers, require_c_extension

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

MAKERS = optimizer_makers(3)
RUNTIMES = {
    # the host tier explicitly: the residency and its staging ring are part of what is checked
    "async": {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 1,
              "placement": {"roots": "host", "eigenbases": "host"}},
    "sync": {"mode": "sync"},
}


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def cyclic_garbage() -> collections.Counter:
    """Collect, and count by type what only the cycle collector could free."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = collections.Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    return found


@pytest.mark.parametrize("mode", sorted(RUNTIMES))
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_steps_make_no_cyclic_garbage(name, mode):
    model = make_model("mlp")
    opt = MAKERS[name](model.parameters(), RUNTIMES[mode])
    handle = attach(model, opt)
    was = gc.isenabled()
    gc.disable()
    try:
        for t in range(1, 4):  # first eigendecompositions, lazy imports, caches
            loss_and_grad(model, "mlp", t)
            opt.step()
        gc.collect()
        for t in range(4, 14):  # three refreshes and their installs
            loss_and_grad(model, "mlp", t)
            opt.step()
        stats = opt.asteria_stats()
        found = cyclic_garbage()
    finally:
        if was:
            gc.enable()
        detach(handle)
        opt.close()
    assert stats["installs"] >= 3
    if mode == "async":
        assert stats["prefetches"] > 0  # the ring's views were made in these steps
    assert not found, f"{name} ({mode}): steps left cyclic garbage {dict(found)}"


def test_attach_log_keeps_the_last_events_only(monkeypatch):
    monkeypatch.setattr(hooks, "LOG_EVENTS", 8)
    model = make_model("mlp")
    opt = SOAP(model.parameters(), runtime=RUNTIMES["async"])
    h = attach(model, opt)
    try:
        for t in range(1, 5):
            loss_and_grad(model, "mlp", t)
            opt.step()
        assert len(h.log) == 8
        # the newest events: the last step's backward prefetches, last module first
        assert list(h.log)[-3:] == [("prefetch", "layers.2"), ("prefetch", "layers.1"),
                                    ("prefetch", "layers.0")]
    finally:
        detach(h)
        opt.close()
