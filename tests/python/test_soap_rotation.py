"""SOAP's m re-expression at install on the C workers (SOAPMethod.rotation_job, run by
BackgroundJobs.offload).

At an install, m_new = Q_L,new^T (Q_L,old m Q_R,old^T) Q_R,new (DESIGN.md). In mode "async" on
CPU parameters the training thread only permutes v and installs Q; a ``soap_rotate`` job
computes m_new while the next forward and backward run, and the first read of m (the next
step, state_dict, optimizer.state) waits for it. Checked here:
 - the equation itself: the state right after an install step equals the restatement in plain
   torch from the state before it;
 - trajectories equal the on-thread path's (same optimizer with the offload switched off) to
   rounding (OpenBLAS vs torch's BLAS), for 2-D blocks, 1-D blocks (precondition_1d) and a
   3-D parameter (whose blocks stay on the training thread);
 - state_dict() taken at an install step carries the re-expressed m, and resuming from it is
   bitwise the continuous run;
 - a rotation job that fails on its worker (a non-finite m: AST_ENONFINITE) is redone on the
   training thread, with a warning and a counter;
 - sync mode never submits rotations;
 - with S = 0 the install deferred to the next step's start rotates m on a worker too, while
   that step does what does not read m; a parameter the step skips has its rotation taken
   before the step end.
"""


import pytest
import torch

from asteria.optim import SOAP
from models import assert_params_close, assert_resumes_bitwise, lockstep_tol, loss_and_grad, \
    make_model, on_thread_soap, params_of, require_c_extension, run

RT = {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 2}
F = 4  # precondition_frequency: installs at the ends of steps 2 (first eigh), 6, 10, ...


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


OnThreadSOAP = on_thread_soap()


def make(cls=SOAP, runtime=RT, precondition_frequency=F, **kw):
    return lambda p: cls(p, precondition_frequency=precondition_frequency, runtime=runtime, **kw)


@pytest.mark.parametrize("kind,kw", [("mlp", {}), ("block", {}),
                                     ("tensor3", {}), ("mlp", {"precondition_1d": True})],
                         ids=["mlp", "block", "tensor3", "precondition_1d"])
def test_trajectory_equals_on_thread_rotation(kind, kw):
    worker, opt_w = run(kind, make(**kw), 14)
    thread, opt_t = run(kind, make(OnThreadSOAP, **kw), 14)
    for t, (a, b) in enumerate(zip(worker, thread), 1):
        # worker (OpenBLAS) against training thread (MKL): float64 rounding, models.lockstep_tol
        assert_params_close(a, b, rtol=lockstep_tol(t), atol=lockstep_tol(t), what=f"step {t}")
    sw, st = opt_w.asteria_stats(), opt_t.asteria_stats()
    assert st["rotations_submitted"] == 0
    if kind == "tensor3":  # 3-D blocks are re-expressed on the training thread
        assert sw["rotations_submitted"] == 0
    else:
        assert sw["rotations_submitted"] > 0 and sw["rotation_failures"] == 0
        # m and the basis pairs go to the job without a snapshot
        assert sw["inputs_donated"] >= 2 * sw["rotations_submitted"]


def test_state_after_install_is_the_reexpressed_moment():
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=F, runtime=RT)
    w = model.layers[0].weight
    try:
        for t in range(1, 2 * F + 2 + 1):
            loss_and_grad(model, "mlp", t)
            if t == F + 2 + 1:  # the step whose end installs the refresh snapshotted at F + 1
                before = {k: opt.state[w][k].clone() for k in ("b0.Q0", "b0.Q1")}
                pending = opt.schedule.rounds[0].resolve(opt.run.engine)[w]
                m_after_update = {}

                real = opt.method.install_chunk

                def spy(members, has, outputs, _real=real):  # m as the install sees it
                    if any(p is w for p, _ in members):
                        m_after_update["m"] = opt.state[w]["b0.exp_avg"].clone()
                    return _real(members, has, outputs)

                opt.method.install_chunk = spy
            opt.step()
            if t == F + 2 + 1:
                del opt.method.install_chunk
                assert (w, "b0.exp_avg") in opt.background, "no rotation left in flight"
                q0n, q1n = pending[(0, 0)][0], pending[(0, 1)][0]
                m = m_after_update["m"]
                want = q0n.T @ (before["b0.Q0"] @ m @ before["b0.Q1"].T) @ q1n
                got = opt.state[w]["b0.exp_avg"]  # waits for the worker
                assert (w, "b0.exp_avg") not in opt.background
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
                assert torch.equal(opt.state[w]["b0.Q0"], q0n)
    finally:
        opt.close()


def test_checkpoint_at_an_install_step_resumes_bitwise():
    # state_dict() waits for the rotation in flight
    assert_resumes_bitwise("mlp", make(), 14, F + 2 + 1, in_flight=lambda opt: opt.background)


def test_sync_mode_rotates_on_the_training_thread():
    _, opt = run("mlp", make(runtime={"mode": "sync"}), 10)
    assert opt.asteria_stats()["rotations_submitted"] == 0


@pytest.mark.parametrize("placement", ["auto", "host"])
def test_failed_rotation_is_redone_on_the_training_thread(placement):
    # "auto" keeps the CPU bases in optimizer.state: one install's parameters share one
    # rotation job, the failing one; "host" (the residency) streams them one parameter a job,
    # so the failing job is one of several
    model = make_model("mlp")
    rt = RT if placement == "auto" else dict(RT, placement={"eigenbases": "host"})
    opt = SOAP(model.parameters(), precondition_frequency=F, runtime=rt)
    w = model.layers[0].weight
    try:
        for t in range(1, F + 2 + 2):
            loss_and_grad(model, "mlp", t)
            if t == F + 2 + 1:  # the install step: its m goes to the worker non-finite
                opt.state[w]["b0.exp_avg"][0, 0] = float("inf")
            opt.step()
        with pytest.warns(RuntimeWarning, match="done on the training thread"):
            m = opt.state[w]["b0.exp_avg"]
        st = opt.asteria_stats()
        if placement == "auto":
            assert st["rotation_failures"] == st["rotations_submitted"] == 1
        else:
            assert st["rotation_failures"] == 1 and st["rotations_submitted"] > 1
        assert not torch.isfinite(m).all()  # the same math, done with torch
    finally:
        opt.close()


# ---- S = 0: the install deferred to the next step, its m re-expressed during that step ----------

S0 = {"mode": "async", "staleness": 0, "install": "deterministic", "workers": 1}


def test_deferred_install_rotates_on_a_worker_during_the_step():
    """S = 0, a refresh every step: each install is deferred to the next step's start, and m's
    re-expression goes to a worker while that step updates the factors and projects the
    gradient; the trajectory is the on-thread path's to rounding (the pool's BLAS)."""
    worker, opt_w = run("mlp", make(runtime=S0, precondition_frequency=1), 12)
    thread, opt_t = run("mlp", make(OnThreadSOAP, runtime=S0, precondition_frequency=1), 12)
    for t, (a, b) in enumerate(zip(worker, thread), 1):
        assert_params_close(a, b, rtol=lockstep_tol(t), atol=lockstep_tol(t), what=f"step {t}")
    sw = opt_w.asteria_stats()
    # every install but the first step's (the eigh, installed at once) rotates m: one job per
    # install of this model's one stack of 2-D blocks
    assert sw["rotations_submitted"] >= 9 and sw["rotation_failures"] == 0
    assert opt_t.asteria_stats()["rotations_submitted"] == 0


def test_deferred_rotation_of_a_parameter_the_step_skips_is_taken_before_the_step_end():
    """A parameter without a gradient in the step that starts with the deferred install: the
    step never reads its m, so its rotation is taken before the step end (which installs the
    next refresh, reading m); the state equals the on-thread path's to rounding."""
    def train(cls):
        model = make_model("mlp")
        opt = cls(model.parameters(), precondition_frequency=1, runtime=S0)
        first = model.layers[0].weight
        try:
            for t in range(1, 8):
                loss_and_grad(model, "mlp", t)
                if t == 5:  # the install deferred from step 4 meets a step without this grad
                    first.grad = None
                opt.step()
                if t == 5:
                    assert not opt.background, "a rotation left in flight past the step"
            return params_of(model), {k: v.clone() for k, v in opt.state[first].items()
                                      if isinstance(v, torch.Tensor)}
        finally:
            opt.close()

    (pw, sw), (pt, st) = train(SOAP), train(OnThreadSOAP)
    assert_params_close(pw, pt, rtol=lockstep_tol(7), atol=lockstep_tol(7), what="step 7")
    for k in sw:
        torch.testing.assert_close(sw[k], st[k], rtol=lockstep_tol(7), atol=lockstep_tol(7),
                                   msg=lambda m, k=k: f"{k}: {m}")
