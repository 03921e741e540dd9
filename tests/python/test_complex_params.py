"""Complex parameters, as torch.optim takes them: SOAP, Shampoo and KL-Shampoo optimise a
complex parameter as its real view (``torch.view_as_real``), exactly as if the caller had
passed a real parameter of shape ``p.shape + (2,)`` with gradient ``view_as_real(p.grad)``:
the same state (real tensors, same keys and shapes), the same blocks and preconditioners (the
trailing 2 gets a 2x2 factor), the same AdamW rule (a 0-D complex parameter's view is 1-D).
Checked bitwise against that explicit real-view run, in sync and async mode (S = 0, installs
deterministic; roots / eigenbases in optimizer.state or the host tier), through a save / load
mid-run and with a closure; async S = 0 follows sync to rounding, as for real parameters. Complex DTensors (FSDP2)
are refused with an error naming why and what is allowed.
"""

import pytest
import torch

from asteria.optim import KLShampoo, SOAP, Shampoo
from models import assert_same_state as same_state, require_c_extension

torch.set_num_threads(1)

CLASSES = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}
MODES = {
    "sync": {"mode": "sync"},
    "async": {"mode": "async", "staleness": 0, "install": "deterministic", "workers": 1},
    # the roots / eigenbases in the residency (host tier) instead of optimizer.state
    "async-host": {"mode": "async", "staleness": 0, "install": "deterministic", "workers": 1,
                   "placement": {"roots": "host", "eigenbases": "host"}},
}
#: 0-D (AdamW path: its view is 1-D), 1-D (its view is 2-D: preconditioned), 2-D, 3-D
SHAPES = [(), (5,), (4, 3), (2, 3, 2)]
STEPS = 5
FREQ = 2  # refreshes due at steps 2 and 4


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def pair(seed=0):
    """Complex parameters plus a real one, and their explicit real-view twins."""
    g = torch.Generator().manual_seed(seed)
    zs = [torch.nn.Parameter(torch.randn(s, dtype=torch.complex64, generator=g))
          for s in SHAPES]
    w = torch.nn.Parameter(torch.randn(3, 4, generator=g))
    cplx = zs + [w]
    twin = [torch.nn.Parameter(torch.view_as_real(z.detach()).clone()) for z in zs]
    twin.append(torch.nn.Parameter(w.detach().clone()))
    return cplx, twin


def real_grad(p, t, k):
    """A deterministic gradient of step t for the k-th parameter, in its real-view shape."""
    shape = tuple(p.shape) + ((2,) if p.is_complex() else ())
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * t + k))


def set_grads(params, t):
    for k, p in enumerate(params):
        g = real_grad(p, t, k)
        p.grad = torch.view_as_complex(g) if p.is_complex() else g


def train(opt, params, steps):
    for t in steps:
        set_grads(params, t)
        opt.step()


def as_real(ps):
    return [torch.view_as_real(p.detach()) if p.is_complex() else p.detach() for p in ps]


def assert_same_params(a, b):
    for x, y in zip(as_real(a), as_real(b)):
        assert x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


def assert_same_state(sd_a, sd_b):
    """models.assert_same_state, and the state holds real tensors only."""
    same_state(sd_a, sd_b)
    assert not any(isinstance(v, torch.Tensor) and v.is_complex()
                   for st in sd_a["state"].values() for v in st.values())


def _first_moment(name):
    return "b0.momentum" if name == "shampoo" else "b0.exp_avg"


def make(name, mode, params, **kw):
    return CLASSES[name](params, lr=1e-2, precondition_frequency=FREQ, runtime=MODES[mode],
                         **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLASSES)
def test_complex_params_follow_the_real_view_run_bitwise(name, mode):
    cplx, twin = pair()
    a, b = make(name, mode, cplx), make(name, mode, twin)
    try:
        train(a, cplx, range(1, STEPS + 1))
        train(b, twin, range(1, STEPS + 1))
        assert a.asteria_stats()["refreshes_submitted"] > 0
        assert_same_params(cplx, twin)
        assert_same_state(a.state_dict(), b.state_dict())
        # the live state is the real view's: 2-D and 3-D complex parameters are preconditioned
        # with a 2x2 factor for the trailing real / imaginary dimension
        st = a.state[cplx[2]]
        assert tuple(st[_first_moment(name)].shape) == (4, 3, 2)
        factor = {"soap": "b0.GG2", "shampoo": "b0.L2", "kl_shampoo": "b0.S2"}[name]
        assert tuple(st[factor].shape) == (2, 2)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("name", CLASSES)
def test_complex_params_async_s0_equal_sync(name):
    """Async with S = 0 and deterministic installs takes sync's trajectory, as for real
    parameters: to rounding (the pool's LAPACK is OpenBLAS's, sync's torch's; see
    test_staleness.py), float32 here."""
    runs = []
    for mode in ("sync", "async"):
        cplx, _ = pair()
        opt = make(name, mode, cplx)
        train(opt, cplx, range(1, STEPS + 1))
        runs.append(as_real(cplx))
        opt.close()
    for x, y in zip(*runs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CLASSES)
def test_complex_params_in_blocks_follow_the_real_view_run(name):
    """Layouts that cut the real view (block_size) and, for SOAP, merge its dimensions."""
    kw = {"block_size": 2}
    if name == "soap":
        kw["merge_dims"] = True
        kw["max_precond_dim"] = 6
    cplx, twin = pair(seed=1)
    a, b = make(name, "sync", cplx, **kw), make(name, "sync", twin, **kw)
    try:
        train(a, cplx, range(1, STEPS + 1))
        train(b, twin, range(1, STEPS + 1))
        assert_same_params(cplx, twin)
        assert_same_state(a.state_dict(), b.state_dict())
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLASSES)
def test_complex_save_load_mid_run_continues_bitwise(name, mode):
    cplx, twin = pair()
    a, b = make(name, mode, cplx), make(name, mode, twin)
    cut = 3
    try:
        train(a, cplx, range(1, cut + 1))
        train(b, twin, range(1, cut + 1))
        saved = a.state_dict()
        assert_same_state(saved, b.state_dict())  # the checkpoint is the real view's
        # resumed on fresh copies of the parameters, from its own checkpoint and from the
        # real-view run's (the same content)
        resumed = []
        for sd in (saved, b.state_dict()):
            ps = [torch.nn.Parameter(p.detach().clone()) for p in cplx]
            opt = make(name, mode, ps)
            opt.load_state_dict(sd)
            assert_same_state(saved, opt.state_dict())
            resumed.append((opt, ps))
        train(b, twin, range(cut + 1, STEPS + 2))
        for opt, ps in resumed:
            train(opt, ps, range(cut + 1, STEPS + 2))
            assert_same_params(ps, twin)
            assert_same_state(opt.state_dict(), b.state_dict())
            opt.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("name", CLASSES)
def test_complex_params_with_a_closure(name):
    cplx, twin = pair()
    target = torch.randn(4, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(7))
    a = make(name, "async", cplx)
    b = make(name, "async", twin)

    def closure_of(opt, z):
        def closure():
            opt.zero_grad()
            loss = (z() - target).abs().square().sum()
            loss.backward()
            return loss
        return closure

    try:
        for t in range(1, STEPS + 1):
            set_grads(cplx, t)
            set_grads(twin, t)
            la = a.step(closure_of(a, lambda: cplx[2]))
            lb = b.step(closure_of(b, lambda: torch.view_as_complex(twin[2])))
            assert torch.equal(la, lb)
        assert_same_params(cplx[2:3], twin[2:3])
        assert_same_state(a.state_dict(), b.state_dict())
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("name", CLASSES)
def test_complex_dtensor_is_refused_naming_why(gloo_group, name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    z = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4, dtype=torch.complex64), mesh,
                                             [Shard(0)]))
    w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 is a complex DTensor"
                                         r".*view_as_real.*real DTensors"):
        CLASSES[name]([w, z], runtime={"mode": "sync"})
    opt = CLASSES[name]([w], runtime={"mode": "sync"})  # a real DTensor is taken
    with pytest.raises(ValueError, match=r"parameter 0 of param group 1 is a complex DTensor"):
        opt.add_param_group({"params": [z]})
    assert len(opt.param_groups) == 1
    opt.close()
