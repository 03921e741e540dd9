"""SOAP's factor EMAs on the C workers (SOAPMethod.factor_ema_job, run by
BackgroundJobs.offload).

L = b L + (1 - b) G G^T and R = b R + (1 - b) G^T G (DESIGN.md, b = shampoo_beta). In mode
"async" with runtime ``factor_emas="workers"`` (the default is "thread") on CPU parameters, a
step whose factors no REFRESH reads at its end hands this update
to a ``gram_ema`` job, which writes the state's own factor memory while the next forward and
backward run; a read of a factor (the next step, optimizer.state, state_dict) waits for it.
Checked here:
 - the update itself: a factor right after an offloaded step equals the plain-torch
   restatement from the factor before it and the step's gradient;
 - which steps offload: every step but the first (it initialises the factors) and those a
   REFRESH reads at their end (k % f == 0);
 - trajectories equal the on-thread path's to rounding (OpenBLAS's syrk vs torch's bmm);
 - state_dict() right after a step carries the updated factors, and resuming from it is
   bitwise the continuous run;
 - a job that fails on its worker (here: a non-finite G, AST_ENONFINITE) has written nothing,
   and the update is redone on the training thread, with a warning and a counter;
 - the executor's in-place contract (HostPoolEngine.submit("gram_ema")): outputs are L and R
   themselves, and what may not be updated in place is refused with a clear error.
"""


import dataclasses

import pytest
import torch

from asteria.optim import SOAP
from asteria.optim.background import BackgroundJobs
from asteria.refresh.engine import SubmitOptions
from models import assert_params_close, assert_resumes_bitwise, lockstep_tol, loss_and_grad, \
    make_model, on_thread_soap, params_of, require_c_extension, run
from tolerance import gram_tol

RT = {"mode": "async", "staleness": 1, "install": "deterministic", "workers": 2,
      "factor_emas": "workers"}
F = 4  # precondition_frequency


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


OnThreadSOAP = on_thread_soap()


def make(cls=SOAP, runtime=RT, **kw):
    return lambda p: cls(p, precondition_frequency=F, runtime=runtime, **kw)


def test_factor_after_an_offloaded_step_is_the_ema():
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=F, shampoo_beta=0.9, runtime=RT)
    w = model.layers[0].weight
    try:
        for t in range(1, F + 3):
            loss_and_grad(model, "mlp", t)
            if t == F + 2:  # step count F + 1 (the first step is the bases' init): offloaded
                before = [opt.state[w][f"b0.GG{i}"].clone() for i in (0, 1)]
                g = w.grad.clone()
            opt.step()
        assert (w, "b0.GG0") in opt.background and (w, "b0.GG1") in opt.background
        want = [0.9 * before[0] + 0.1 * g @ g.T, 0.9 * before[1] + 0.1 * g.T @ g]
        got = [opt.state[w]["b0.GG0"], opt.state[w]["b0.GG1"]]  # waits for the worker
        assert (w, "b0.GG0") not in opt.background
        for a, b, f in zip(got, want, before):
            tol = 2 * gram_tol(g, f, 0.9, 0.1)  # the worker's syrk and torch's products round
            torch.testing.assert_close(a, b, rtol=0, atol=tol)
            assert torch.equal(a, a.T)  # syrk's triangle, mirrored: exactly symmetric
    finally:
        opt.close()


class CountingSOAP(SOAP):
    """Logs every factor-EMA job its background-jobs part starts: (blocks, their step counts)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offloaded_at = []
        start = self.background.start

        def logged(job):
            if job.kind.op == "gram_ema":
                self.offloaded_at.append((len(job.members),
                                          [self.state[p]["step"] for p, _ in job.members]))
            start(job)

        self.background.start = logged


def test_offloaded_steps_are_those_no_refresh_reads():
    steps = 3 * F + 1
    make_opt = make(CountingSOAP)

    def opt_with_log(params):
        opt = make_opt(params)
        opt.offloaded_at = []
        return opt

    _, opt = run("mlp", opt_with_log, steps)
    st = opt.asteria_stats()
    # step counts 1 .. steps - 1 after the init step; k % F == 0 keeps the update here
    counts = [k for k in range(1, steps) if k % F]
    n2d = sum(1 for p in opt.run.params() if p.dim() == 2)  # one shape: one job per step
    assert opt.offloaded_at == [(n2d, [k] * n2d) for k in counts]
    assert st["factor_emas_submitted"] == len(counts)
    assert st["factor_ema_failures"] == 0
    assert not opt.background  # close() waited for the last ones


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_trajectory_equals_on_thread_update(kind):
    worker, opt_w = run(kind, make(), 14)
    thread, opt_t = run(kind, make(OnThreadSOAP), 14)
    for t, (a, b) in enumerate(zip(worker, thread), 1):
        # worker (OpenBLAS) against training thread (MKL): float64 rounding, models.lockstep_tol
        assert_params_close(a, b, rtol=lockstep_tol(t), atol=lockstep_tol(t), what=f"step {t}")
    assert opt_w.asteria_stats()["factor_emas_submitted"] > 0
    assert opt_t.asteria_stats()["factor_emas_submitted"] == 0


@pytest.mark.parametrize("runtime", [{"mode": "sync"}, dict(RT, factor_emas="thread"),
                                     {k: v for k, v in RT.items() if k != "factor_emas"}],
                         ids=["sync", "thread", "default"])
def test_factors_stay_on_the_training_thread_unless_asked(runtime):
    _, opt = run("mlp", make(runtime=runtime), 8)
    assert opt.asteria_stats()["factor_emas_submitted"] == 0


def test_checkpoint_after_an_offloaded_step_resumes_bitwise():
    # state_dict() waits for the factor EMAs in flight
    assert_resumes_bitwise("mlp", make(), 12, F + 2, in_flight=lambda opt: any(
        k[1].startswith("b0.GG") for k in opt.background))


def test_failed_job_is_redone_on_the_training_thread():
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=F, runtime=RT)
    ref_model = make_model("mlp")
    ref = OnThreadSOAP(ref_model.parameters(), precondition_frequency=F, runtime=RT)
    real = opt.run.engine.submit

    def poisoned(op, f, *a, **kw):  # the worker sees a non-finite G; the step kept its own
        if op == "gram_ema":
            f = f.clone()
            f.view(-1)[0] = float("nan")
            kw["opts"] = dataclasses.replace(kw["opts"], donate=())
        return real(op, f, *a, **kw)

    try:
        for t in range(1, F + 3):
            if t == F + 2:
                before = {p: opt.state[p]["b0.GG0"].clone() for p in opt.run.params()
                          if p.dim() == 2}
                submitted = opt.asteria_stats()["factor_emas_submitted"]
                opt.run.engine.submit = poisoned
            for m, o in ((model, opt), (ref_model, ref)):
                loss_and_grad(m, "mlp", t)
                o.step()
        jobs = opt.asteria_stats()["factor_emas_submitted"] - submitted
        assert jobs >= 1 and len(opt.background) >= 2 * jobs
        with pytest.warns(RuntimeWarning, match="done on the training thread"):
            opt.background.settle_all()
        assert opt.asteria_stats()["factor_ema_failures"] == jobs
        for (p, f0), q in zip(before.items(), [q for q in ref_model.parameters()
                                               if q.dim() == 2]):
            got = opt.state[p]["b0.GG0"]
            assert not torch.equal(got, f0)
            torch.testing.assert_close(got, ref.state[q]["b0.GG0"], rtol=1e-12, atol=1e-14)
    finally:
        opt.run.engine.submit = real
        opt.close()
        ref.close()


@pytest.mark.parametrize("lands", ["before", "after"])
def test_an_interrupt_at_the_start_starts_the_job_once(lands, monkeypatch):
    """A signal (Ctrl-C) landing in the start of a step's factor EMA jobs, before or after the
    job is handed over: the next step starts what was not, and nothing twice (an EMA applied
    twice would leave the trajectory), so the run goes on bitwise as an uninterrupted one."""
    steps, cut = 10, 7  # step 7 (count 6): factors offloaded, no refresh due or installed
    full, _ = run("mlp", make(), steps)
    model = make_model("mlp")
    opt = make()(model.parameters())
    real = BackgroundJobs.start

    def interrupted(self, job):
        if job.kind.op != "gram_ema":
            return real(self, job)
        if lands == "after":
            real(self, job)
        monkeypatch.setattr(BackgroundJobs, "start", real)  # once
        raise KeyboardInterrupt

    try:
        for t in range(1, steps + 1):
            loss_and_grad(model, "mlp", t)
            if t == cut:
                monkeypatch.setattr(BackgroundJobs, "start", interrupted)
                with pytest.raises(KeyboardInterrupt):
                    opt.step()
                assert opt.background.due  # left to start
            else:
                opt.step()
            assert all(torch.equal(a, b) for a, b in zip(params_of(model), full[t - 1])), t
        assert opt.asteria_stats()["factor_emas_submitted"] == len(
            [k for k in range(1, steps) if k % F])
    finally:
        opt.close()


# ---- the executor's in-place contract ---------------------------------------------------------

def _engine():
    from asteria.refresh.host_pool import HostPoolEngine
    return HostPoolEngine({"workers": 1})


@pytest.mark.parametrize("sides", ["both", "left", "right"])
def test_engine_updates_l_and_r_in_place(sides):
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64)
    a, c = (torch.randn(3, k, k, generator=gen, dtype=torch.float64) for k in (5, 7))
    l0, r0 = a @ a.transpose(1, 2), c @ c.transpose(1, 2)  # factors are symmetric
    l = l0.clone() if sides != "right" else None
    r = r0.clone() if sides != "left" else None
    eng = _engine()
    try:
        t = eng.submit("gram_ema", g, l, b=r, block=1, version=1, deadline=1, snapshot_step=0,
                       p=0.8, eps=0.2, opts=SubmitOptions(host_outputs=True))
        res = eng.wait(t)
        assert res.status == 0, res.error
        for out, mine, start, prod in ((res.outputs[0], l, l0, g @ g.transpose(1, 2)),
                                       (res.outputs[1], r, r0, g.transpose(1, 2) @ g)):
            if mine is None:
                assert out is None
                continue
            assert out is mine  # the caller's tensor, written in place
            tol = 2 * gram_tol(g, start, 0.8, 0.2)  # the worker's syrk and torch's products round
            torch.testing.assert_close(mine, 0.8 * start + 0.2 * prod, rtol=0, atol=tol)
    finally:
        eng.close()


def test_engine_refuses_what_it_cannot_update_in_place():
    g = torch.randn(2, 4, 6)
    eng = _engine()
    try:
        kw = dict(block=1, version=1, deadline=1, snapshot_step=0, p=0.9, eps=0.1)
        with pytest.raises(ValueError, match="in place.*contiguous"):
            eng.submit("gram_ema", g, torch.zeros(2, 4, 4).transpose(1, 2), **kw)
        with pytest.raises(ValueError, match="G's dtype"):
            eng.submit("gram_ema", g, torch.zeros(2, 4, 4, dtype=torch.float64), **kw)
        with pytest.raises(ValueError, match="float32 or float64"):
            eng.submit("gram_ema", g.bfloat16(), torch.zeros(2, 4, 4, dtype=torch.bfloat16),
                       **kw)
        with pytest.raises(ValueError, match="gram_ema"):
            eng.submit("gram_ema", g, None, b=None, **kw)  # neither side
    finally:
        eng.close()
