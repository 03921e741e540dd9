"""PendingWrites (asteria.optim._writes): "job J writes state (p, K); a read of K waits for it",
on a stand-in engine: settle one key, settle all, due jobs started once (also when a signal lands
in the start), an interrupted wait that leaves the job registered, no reference to the owner."""

import dataclasses
import types
import gc
import weakref

import pytest

from asteria.optim._writes import PendingWrites, Write


class Engine:
    def __init__(self):
        self.waited = []
        self.interrupt = False
        self.next = 0

    def submit(self):
        self.next += 1
        return self.next

    def wait(self, ticket):
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        self.waited.append(ticket)
        return f"result {ticket}"


class Owner:
    """Stands for an optimizer: its run record (the engine) and its schedule's writes; ``log``
    stands for the method the jobs report to (it holds the writes weakly, as a method holds
    its schedule)."""

    def __init__(self):
        self.run = types.SimpleNamespace(engine=Engine())
        self.schedule = types.SimpleNamespace(writes=PendingWrites(self.run))
        self.log = types.SimpleNamespace(engine=self.run.engine, applied=[], started=0,
                                         writes=weakref.ref(self.schedule.writes))

    @property
    def applied(self):
        return self.log.applied

    @property
    def started(self):
        return self.log.started


@dataclasses.dataclass(eq=False)
class Job(Write):
    keys: list
    ticket: object = None
    fail_after_submit: bool = False
    log: object = None

    def start(self):
        self.log.started += 1
        self.ticket = self.log.engine.submit()
        self.log.writes().add(self)
        if self.fail_after_submit:
            self.fail_after_submit = False
            raise KeyboardInterrupt

    def apply(self, result):
        self.log.applied.append((self.keys, result))


def test_settle_waits_for_the_job_of_that_key_only():
    o = Owner()
    w = o.schedule.writes
    a = Job([("p", "b0.exp_avg"), ("q", "b0.exp_avg")], 1, log=o.log)
    b = Job([("p", "b0.GG0")], 2, log=o.log)
    w.add(a)
    w.add(b)
    assert w and len(w) == 3 and ("q", "b0.exp_avg") in w
    w.settle("p", "b0.Q0")  # nothing writes it
    assert o.applied == []
    w.settle("q", "b0.exp_avg")
    assert o.run.engine.waited == [1] and o.applied == [(a.keys, "result 1")]
    assert ("p", "b0.exp_avg") not in w and ("p", "b0.GG0") in w
    w.settle_all()
    assert o.run.engine.waited == [1, 2] and not w and len(w) == 0


def test_an_interrupted_wait_leaves_the_job_registered():
    o = Owner()
    w = o.schedule.writes
    w.add(Job([("p", "b0.exp_avg")], 7, log=o.log))
    o.run.engine.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        w.settle_all()
    assert ("p", "b0.exp_avg") in w and o.applied == []
    w.settle("p", "b0.exp_avg")
    assert o.run.engine.waited == [7] and len(o.applied) == 1 and not w


@pytest.mark.parametrize("lands", ["none", "after_submit"])
def test_due_jobs_start_once_in_order_before_any_settle(lands):
    o = Owner()
    w = o.schedule.writes
    first = Job([("p", "b0.GG0")], fail_after_submit=lands == "after_submit", log=o.log)
    second = Job([("q", "b0.GG0")], log=o.log)
    w.defer(first)
    w.defer(second)
    assert not w and w.due == [first, second]  # due jobs are not in flight yet
    if lands == "after_submit":
        with pytest.raises(KeyboardInterrupt):
            w.start_due()
        assert w.due == [first, second] and ("p", "b0.GG0") in w
    w.settle("q", "b0.GG0")  # starts what is due first, each once
    assert o.started == 2 and w.due == []
    assert [k for k, _ in o.applied] == [second.keys]
    w.settle_all()
    assert o.started == 2 and [k for k, _ in o.applied] == [second.keys, first.keys]


def test_holds_its_owner_weakly():
    o = Owner()
    o.schedule.writes.add(Job([("p", "b0.exp_avg")], 1, log=o.log))
    ref = weakref.ref(o)
    was = gc.isenabled()
    gc.disable()
    try:
        del o
        assert ref() is None  # no cycle: freed without the collector
    finally:
        if was:
            gc.enable()
