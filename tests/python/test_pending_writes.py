"""The background jobs (asteria.optim.background): "job J writes state (p, K); a read of K waits
for it", on a stand-in engine: settle one key, settle all, due jobs started once (also when a
signal lands in the start), an interrupted wait that leaves the job registered, outputs written
where the job declares, a failed job redone with the op's torch reference, the engine block keys
and counters a job kind declares, the rule of ``on_worker`` with a kind's typed runtime switch,
no reference to the owner."""

import gc
import types
import weakref

import pytest
import torch

from asteria.optim.background import FIRST_BLOCK, KINDS, BackgroundJobs, JobKind, WorkerJob
from asteria.optim.run import COUNTERS
from asteria.optim.soap import FACTOR_EMAS, ROTATION


class Engine:
    takes_parts = True

    def __init__(self):
        self.submitted = []
        self.batch = []
        self.waited = []
        self.interrupt = False
        self.fail = set()

    def submit(self, op, f, q, *, b, p, eps, block, version, deadline, snapshot_step, opts):
        self.submitted.append((op, block, version, deadline, snapshot_step, opts.donate))
        self.batch.append(f.shape[0])
        return len(self.submitted)

    def wait(self, ticket):
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        self.waited.append(ticket)
        if ticket in self.fail:
            return types.SimpleNamespace(status=-7, error="AST_ENONFINITE", outputs=None)
        return types.SimpleNamespace(status=0, error=None,
                                     outputs=(torch.full((self.batch[ticket - 1], 1, 2),
                                                         float(ticket)),))


class Placement:
    def __init__(self):
        self.nvme = False

    def on_nvme(self, members):
        return self.nvme

    def is_state(self, members, field, dim, x):
        return field == "GG"


class Owner:
    """Stands for an optimizer: its run record (the engine, the counters) and its background
    jobs, bound to its placement; ``job`` declares one whose output goes into a (2,) tensor
    per member, as a method's jobs write the state's entries."""

    def __init__(self, interrupting=False):
        self.run = types.SimpleNamespace(engine=Engine(), counters={k: 0 for k in COUNTERS},
                                         pindex={"p": 0, "q": 1}, t=5,
                                         cfg=types.SimpleNamespace(factor_emas="thread"))
        self.background = (Interrupting if interrupting else BackgroundJobs)(self.run)
        self.placement = Placement()
        self.background.bind(self.placement)

    def job(self, keys, kind=ROTATION):
        members = [(p, 0) for p in dict.fromkeys(p for p, _ in keys)]
        x = torch.full((len(members), 1, 2), -1.0)
        return WorkerJob(kind, members=members, keys=keys, inputs=(x, None, None),
                         into=([torch.zeros(2) for _ in members],))


def written(job):
    """What the job wrote into its members' entries: one value per member (0: nothing)."""
    return [float(t[0]) for t in job.into[0]]


class Interrupting(BackgroundJobs):
    """A signal (Ctrl-C) landing once the start of ``interrupt_after`` has submitted and
    registered it."""

    interrupt_after = None

    def start(self, job):
        super().start(job)
        if job is self.interrupt_after:
            self.interrupt_after = None
            raise KeyboardInterrupt


def test_settle_waits_for_the_job_of_that_key_only():
    o = Owner()
    w = o.background
    a = o.job([("p", "b0.exp_avg"), ("q", "b0.exp_avg")])
    b = o.job([("p", "b0.GG0")], FACTOR_EMAS)
    w.offload(a)
    w.offload(b)
    assert (a.ticket, b.ticket) == (1, 2)
    assert w and len(w) == 3 and ("q", "b0.exp_avg") in w
    w.settle("p", "b0.Q0")  # nothing writes it
    assert written(a) == [0, 0] and written(b) == [0]
    w.settle("q", "b0.exp_avg")
    assert o.run.engine.waited == [1] and written(a) == [1, 1] and written(b) == [0]
    assert ("p", "b0.exp_avg") not in w and ("p", "b0.GG0") in w
    w.settle_all()
    assert o.run.engine.waited == [1, 2] and not w and len(w) == 0 and written(b) == [2]


def test_an_interrupted_wait_leaves_the_job_registered():
    o = Owner()
    w = o.background
    job = o.job([("p", "b0.exp_avg")])
    w.offload(job)
    o.run.engine.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        w.settle_all()
    assert ("p", "b0.exp_avg") in w and written(job) == [0]
    w.settle("p", "b0.exp_avg")
    assert o.run.engine.waited == [1] and written(job) == [1] and not w


@pytest.mark.parametrize("lands", ["none", "after_submit"])
def test_due_jobs_start_once_in_order_before_any_settle(lands):
    o = Owner(interrupting=True)
    w = o.background
    first = o.job([("p", "b0.GG0")], FACTOR_EMAS)
    if lands == "after_submit":
        w.interrupt_after = first
    second = o.job([("q", "b0.GG0")], FACTOR_EMAS)
    w.offload(first, due=True)
    w.offload(second, due=True)
    assert not w and w.due == [first, second]  # due jobs are not in flight yet
    assert o.run.engine.submitted == []
    if lands == "after_submit":
        with pytest.raises(KeyboardInterrupt):
            w.start_due()
        assert w.due == [first, second] and ("p", "b0.GG0") in w
    w.settle("q", "b0.GG0")  # starts what is due first, each once
    assert len(o.run.engine.submitted) == 2 and w.due == []
    assert written(first) == [0] and written(second) == [2]
    w.settle_all()
    assert len(o.run.engine.submitted) == 2
    assert written(first) == [1] and written(second) == [2]
    assert o.run.counters["factor_emas_submitted"] == 2


def test_a_failed_job_is_redone_with_the_ops_reference_and_counted():
    o = Owner()
    w = o.background
    job = o.job([("p", "b0.exp_avg"), ("q", "b0.exp_avg")])
    w.offload(job)
    o.run.engine.fail.add(job.ticket)
    with pytest.warns(RuntimeWarning, match="re-expressing SOAP's first moment on a worker "
                                            "failed .AST_ENONFINITE.; done on the training"):
        w.settle("p", "b0.exp_avg")
    # soap_rotate's reference with no basis pair: the identity, x itself
    assert written(job) == [-1, -1] and not w
    assert o.run.counters["rotation_failures"] == 1 and o.run.counters["rotations_submitted"] == 1


def test_block_keys_are_the_jobs_own_stable_per_op_and_members():
    o = Owner()
    w = o.background
    for keys, kind in [([("p", "b0.exp_avg")], ROTATION), ([("p", "b0.exp_avg")], ROTATION),
                       ([("p", "b0.GG0")], FACTOR_EMAS), ([("q", "b0.exp_avg")], ROTATION)]:
        w.offload(o.job(keys, kind))
        w.settle_all()
    subs = o.run.engine.submitted
    assert [(op, block, version) for op, block, version, *_ in subs] == [
        ("soap_rotate", FIRST_BLOCK, 1), ("soap_rotate", FIRST_BLOCK, 2),
        ("gram_ema", FIRST_BLOCK + 1, 1), ("soap_rotate", FIRST_BLOCK + 2, 1)]
    # due by the next step, snapshotted now
    assert all(deadline == 6 and snap == 5 for _, _, _, deadline, snap, _ in subs)


def test_nvme_blocks_take_the_jobs_in_flight_first():
    o = Owner()
    w = o.background
    w.offload(o.job([("p", "b0.exp_avg")]))
    o.placement.nvme = True
    w.offload(o.job([("q", "b0.exp_avg")]))
    assert o.run.engine.waited == [1] and list(w) == [("q", "b0.exp_avg")]


def test_every_declared_kind_counts_from_zero_in_every_optimizer():
    from asteria import KLShampoo

    assert KINDS[:2] == [ROTATION, FACTOR_EMAS]
    o = Owner()
    for name in ("rotations_submitted", "rotation_failures", "factor_emas_submitted",
                 "factor_ema_failures"):
        assert o.run.counters[name] == 0
    opt = KLShampoo([torch.nn.Parameter(torch.zeros(3, 3))], runtime={"mode": "sync"})
    assert opt.asteria_stats()["rotations_submitted"] == 0


def test_outputs_go_where_the_job_declares():
    o = Owner()
    w = o.background
    stack, elsewhere = torch.zeros(2, 1, 2), torch.zeros(2, 1, 2)
    job = WorkerJob(ROTATION, members=[("p", 0), ("q", 0)], keys=[("p", "b0.exp_avg")],
                    inputs=(stack, None, None), into=(elsewhere,))
    w.offload(job)
    w.settle_all()
    assert torch.equal(elsewhere, torch.ones(2, 1, 2))  # a whole output: copied
    job = WorkerJob(ROTATION, members=[("p", 0)], keys=[("p", "b0.exp_avg")],
                    inputs=(stack, None, None), into=(None,))
    w.offload(job)
    w.settle_all()  # an output no state takes: nothing written
    assert torch.equal(stack, torch.zeros(2, 1, 2))


def test_a_kind_names_a_known_op_and_counters_of_its_own():
    n = len(KINDS)
    with pytest.raises(ValueError, match="unknown op 'no_such_op'"):
        JobKind("no_such_op", "a_submitted", "a_failed", "doing a")
    with pytest.raises(ValueError, match="'rotations_submitted' is taken"):
        JobKind("soap_rotate", "rotations_submitted", "a_failed", "doing a")
    with pytest.raises(ValueError, match="'installs' is taken"):
        JobKind("soap_rotate", "a_submitted", "installs", "doing a")
    assert len(KINDS) == n


def test_on_worker_follows_the_kinds_switch_and_the_rule():
    o = Owner()
    w = o.background
    members = [(torch.zeros(4, 4), 0)]
    f = torch.zeros(1, 4, 4)
    gg = (("GG", 0, f),)
    assert w.on_worker(ROTATION, members, 2)
    assert not w.on_worker(FACTOR_EMAS, members, 2, dtype=f.dtype, in_place=gg)  # "thread"
    o.run.cfg.factor_emas = "workers"
    assert w.on_worker(FACTOR_EMAS, members, 2, dtype=f.dtype, in_place=gg)
    assert not w.on_worker(FACTOR_EMAS, members, 3, dtype=f.dtype, in_place=gg)  # rectangular
    assert not w.on_worker(FACTOR_EMAS, members, 2, dtype=torch.float16,
                           in_place=(("GG", 0, f.half()),))
    assert not w.on_worker(FACTOR_EMAS, members, 2, dtype=f.dtype, in_place=(("Q", 0, f),))
    o.run.engine.takes_parts = False
    assert not w.on_worker(ROTATION, members, 2)


def test_holds_its_owner_weakly():
    o = Owner()
    o.background.offload(o.job([("p", "b0.exp_avg")]))
    ref = weakref.ref(o)
    was = gc.isenabled()
    gc.disable()
    try:
        del o
        assert ref() is None  # no cycle: freed without the collector
    finally:
        if was:
            gc.enable()
