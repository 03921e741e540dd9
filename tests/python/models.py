"""Test support: small float64 models with deterministic data, a lockstep driver that trains a
model with an Asteria optimizer next to a copy trained by a reference, training over a range of
steps and resuming it from a state_dict, and the check that the C extension is there.

Numerics: a rank-deficient factor's null space gets a canonical basis (docs/departures.md), so
SOAP and KL-Shampoo agree across executors and process counts there too (tests/python/
test_soap_basis.py, test_rank_deficient.py). Eigenvectors of a repeated NONZERO eigenvalue are
still arbitrary, and different LAPACKs (torch's in ``mode="sync"``, OpenBLAS in the C pool) pick
different ones, so these models keep every factor full rank with distinct eigenvalues:
 - batches have more tokens (rows of the activations) than any layer is wide, and
 - every weight matrix is square.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from tolerance import rounding_tol

WIDTH = 8    # every weight matrix is WIDTH x WIDTH
TOKENS = 32  # rows per batch, > WIDTH

DTYPE = torch.float64
# The factors' conditioning on these models: ||F|| / eigenvalue gap at most 1.2e4 (measured over
# 30 steps of SOAP, Shampoo and KL-Shampoo on every kind of make_model).
COND = 2e4

# Tiny tensors: one intra-op thread is faster, and torch's OpenMP threads would fight the C
# pool's workers (and other jobs) for the two cores of a CI machine.
torch.set_num_threads(1)


def require_c_extension() -> None:
    """Fail (not skip) when asteria._C is missing: the project's test command always builds it."""
    try:
        import asteria._C  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"asteria._C is not built ({exc}); build it with: cmake -S . -B build-py "
                    "-DASTERIA_BUILD_PYTHON=ON && cmake --build build-py --target _C")


def run_on_private_mount(tmp_path, fstype: str, script: str, options: str = "",
                         then: str = "", **fields) -> None:
    """Run the Python ``script`` (a format string given ``tests`` (this folder), ``python``
    (the asteria package's root), ``dir`` (the mount point) and ``fields``) in a private mount
    namespace (``unshare -m``) where a fresh ``fstype`` (mount ``options``) is mounted at
    tmp_path / "mnt" and the shell commands ``then`` have run; it must exit 0 with OK last.
    Skipped without ``unshare -m`` or the right to mount."""
    import os
    import shutil
    import subprocess
    import sys

    import asteria

    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no private mount namespace here (unshare -m)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    here = os.path.dirname(os.path.abspath(__file__))
    python = os.path.dirname(os.path.dirname(asteria.__file__))  # the package under test
    path = tmp_path / "script.py"
    path.write_text(script.format(tests=here, python=python, dir=str(mnt), **fields))
    opts = f"-o {options} " if options else ""
    cmd = " && ".join(c for c in (f"mount -t {fstype} {opts}{fstype} {mnt}", then,
                                  f"{sys.executable} {path}") if c)
    res = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True,
                         timeout=120)
    if res.returncode != 0 and "mount:" in res.stderr and "permission" in res.stderr.lower():
        pytest.skip(f"{fstype} mount not permitted: {res.stderr.strip()}")
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


def on_thread_soap():
    """SOAP with every worker offload off (m's re-expression and the factor EMAs on the
    training thread: the sync path's code), whatever the runtime config asks."""
    from asteria.optim.soap import SOAP

    class OnThreadSOAP(SOAP):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # the one rule of the background jobs says no to every job a method declares
            self.background.on_worker = lambda *a, **kw: False

    return OnThreadSOAP


class MLP(nn.Module):
    """Linear layers between ``widths`` (default: three WIDTH x WIDTH) with tanh between
    them."""

    def __init__(self, widths=(WIDTH,) * 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention (2 heads) and a GELU MLP."""

    heads = 2

    def __init__(self, d: int = WIDTH):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):  # x: (batch, seq, d)
        b, s, d = x.shape
        h = self.ln1(x)

        def split(t):
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.o(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Tensor3(nn.Module):
    """One 3-D weight (a, b, c) used as y_n,a = tanh(sum_bc W_abc x_n,bc): for N-D factors."""

    def __init__(self, shape=(4, 3, 5)):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape) / math.sqrt(shape[1] * shape[2]))

    def forward(self, x):
        return torch.tanh(torch.einsum("abc,nbc->na", self.w, x))


# ---- the three optimizers, as the tests make them ------------------------------------------

F64 = dict(compute_dtype=torch.float64)  # KL-Shampoo computes in float64 on these models


def optimizer_pairs(frequency: int, refs: dict = None) -> dict:
    """{name: (make_opt, make_ref)} for "soap", "shampoo" and "kl_shampoo" at
    ``precondition_frequency=frequency`` (Shampoo and KL-Shampoo at lr 3e-3, the package's
    KL-Shampoo in float64): ``make_opt(params, **kw)`` the package's optimizer,
    ``make_ref(params, **kw)`` its plain-torch restatement, the class ``refs[name]`` (default
    reference.py's SOAPRef, ShampooRef, KLShampooRef)."""
    from asteria.optim import KLShampoo, SOAP, Shampoo
    import reference

    refs = refs or {"soap": reference.SOAPRef, "shampoo": reference.ShampooRef,
                    "kl_shampoo": reference.KLShampooRef}
    soap = dict(precondition_frequency=frequency)
    shampoo = dict(soap, lr=3e-3)

    def pair(cls, ref, hyper, own):
        return (lambda p, **kw: cls(p, **hyper, **own, **kw),
                lambda p, **kw: ref(p, **hyper, **kw))

    return {"soap": pair(SOAP, refs["soap"], soap, {}),
            "shampoo": pair(Shampoo, refs["shampoo"], shampoo, {}),
            "kl_shampoo": pair(KLShampoo, refs["kl_shampoo"], shampoo, F64)}


def optimizer_makers(frequency: int) -> dict:
    """{name: make(params, runtime)}: optimizer_pairs' package optimizers with the runtime
    config as the second argument."""
    return {name: (lambda p, rt, make=make: make(p, runtime=rt))
            for name, (make, _) in optimizer_pairs(frequency).items()}


def deterministic_runtime(**kw) -> dict:
    """The C pool with deterministic installs: async, staleness 2, 2 workers; ``kw`` added or
    replaced."""
    return {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 2, **kw}


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = {"mlp": MLP, "block": Block, "tensor3": Tensor3}[kind]()
    return model.to(DTYPE)


def batch(kind: str, step: int, model: nn.Module = None):
    """Deterministic (input, target) of a step: inputs from a generator seeded by the step,
    targets from a fixed random map of them."""
    gen = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        x = torch.randn(TOKENS, WIDTH, generator=gen, dtype=DTYPE)
    elif kind == "block":
        x = torch.randn(4, TOKENS // 4, WIDTH, generator=gen, dtype=DTYPE)  # 32 tokens
    else:
        x = torch.randn(TOKENS, 3, 5, generator=gen, dtype=DTYPE)
    fixed = torch.Generator().manual_seed(7)
    if kind == "tensor3":
        a = torch.randn(4, 3, 5, generator=fixed, dtype=DTYPE)
        y = torch.sin(torch.einsum("abc,nbc->na", a, x))
    else:
        a = torch.randn(WIDTH, WIDTH, generator=fixed, dtype=DTYPE)
        y = torch.sin(x @ a)
    return x, y


def loss_and_grad(model: nn.Module, kind: str, step: int) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    x, y = batch(kind, step)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    return loss.detach()


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train_steps(model: nn.Module, opt, steps, kind: str = "mlp",
                grad_of=loss_and_grad) -> list[list[torch.Tensor]]:
    """``opt.step()`` on the ``kind`` batches of each step in ``steps`` (``grad_of(model,
    kind, t)`` sets the gradients: another set of models' loss_and_grad, as lockstep takes
    it); the parameters after each step."""
    out = []
    for t in steps:
        grad_of(model, kind, t)
        opt.step()
        out.append(params_of(model))
    return out


def train_mlp(model: nn.Module, opt, steps) -> list[list[torch.Tensor]]:
    """``opt.step()`` on the "mlp" batches of each step in ``steps``; the parameters after
    each step."""
    return train_steps(model, opt, steps)


def resume(kind: str, make_opt, runtime, params, state_dict, steps,
           models=None) -> list[list[torch.Tensor]]:
    """A fresh ``kind`` model holding ``params`` and a fresh ``make_opt(parameters,
    runtime=runtime)`` loaded from a copy of ``state_dict``, trained (train_steps) over
    ``steps`` and closed: the parameters after each step. ``models`` as for lockstep."""
    make, grad_of = models or (make_model, loss_and_grad)
    model = make(kind)
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    opt = make_opt(model.parameters(), runtime=runtime)
    opt.load_state_dict(copy.deepcopy(state_dict))
    out = train_steps(model, opt, steps, kind, grad_of)
    opt.close()
    return out


def lockstep(kind: str, make_opt, make_ref, steps: int, ref_views=None, before_step=None,
             models=None):
    """Train ``kind`` with ``make_opt(params)`` and a copy with ``make_ref(tensors)``. Returns
    ([(step, package params, reference params)] after every step, the optimizer (closed)).
    ``ref_views(model)`` maps the reference's model to (the tensors the reference updates, a
    function returning their gradients); default: its parameters. ``before_step(t, opt, ref)``
    runs before step t (LR schedules). ``models``: (make_model, loss_and_grad) of another set
    of models (default: this file's)."""
    make, grad_of = models or (make_model, loss_and_grad)
    model = make(kind)
    twin = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    views = ref_views or (lambda m: ([p.data for p in m.parameters()],
                                     lambda: [p.grad for p in m.parameters()]))
    tensors, grads = views(twin)
    ref = make_ref(tensors)
    history = []
    try:
        for t in range(1, steps + 1):
            if before_step is not None:
                before_step(t, opt, ref)
            grad_of(model, kind, t)
            grad_of(twin, kind, t)
            opt.step()
            ref.step(grads())
            history.append((t, params_of(model), params_of(twin)))
    finally:
        opt.close()
    return history, opt



def grid_blocks(shape, size):
    """(row range, column range) of each block of a 2-D shape, row-major (make_layout's
    order), the last block of a dimension shorter where size does not divide it."""
    edges = [[(a, min(a + size, n)) for a in range(0, n, size)] for n in shape]
    return [(r, c) for r in edges[0] for c in edges[1]]


def blocks_view(size):
    """lockstep's ref_views for block_size ``size``: every block of every weight as its own
    tensor (each block an independent problem), 1-D parameters whole."""
    def views(model):
        tensors, sources = [], []
        for p in model.parameters():
            if p.dim() == 1:
                tensors.append(p.data)
                sources.append((p, None))
                continue
            for r, c in grid_blocks(p.shape, size):
                tensors.append(p.data[r[0]:r[1], c[0]:c[1]])
                sources.append((p, (r, c)))

        def grads():
            return [p.grad if rc is None else p.grad[rc[0][0]:rc[0][1], rc[1][0]:rc[1][1]]
                    for p, rc in sources]

        return tensors, grads

    return views

def lockstep_tol(steps: int, cond: float = COND) -> float:
    """Parameters of two float64 trainings that round differently (another order of the ops,
    OpenBLAS's LAPACK against MKL's) after ``steps`` steps: TOKENS-term reductions, compounding
    over the steps, times the factors' cond. The parameters are O(1): one number serves as rtol
    and as atol."""
    return rounding_tol(DTYPE, n=TOKENS, steps=steps, cond=cond)


def assert_lockstep(history, cond: float = COND):
    """Every step's parameters agree to rounding (``lockstep_tol``), and training moved them
    (the comparison is not vacuous)."""
    for t, got, want in history:
        tol = lockstep_tol(t, cond)
        assert_params_close(got, want, rtol=tol, atol=tol, what=f"step {t}")
    first, last = history[0][2], history[-1][2]
    assert max(float((a - b).abs().max()) for a, b in zip(first, last)) > 1e-3


def train_hooked(model: nn.Module, opt, steps: int, attached: bool = True, check=None):
    """``opt.step()`` on the "mlp" batches of steps 1..``steps``, through asteria.attach's
    hooks if ``attached`` (detached at the end), ``check(opt)`` after every step; ``opt`` closed
    at the end. Returns (params after every step, asteria_stats() before the close, the attach
    handle or None)."""
    from asteria import attach, detach

    handle = attach(model, opt) if attached else None
    traj = []
    try:
        for t in range(1, steps + 1):
            loss_and_grad(model, "mlp", t)
            opt.step()
            traj.append(params_of(model))
            if check is not None:
                check(opt)
        stats = opt.asteria_stats()
    finally:
        if handle is not None:
            detach(handle)
        opt.close()
    return traj, stats, handle


def run(kind: str, make_opt, steps: int, model: nn.Module = None):
    """Train and return (params after every step, the optimizer, closed)."""
    model = model or make_model(kind)
    opt = make_opt(model.parameters())
    traj = []
    try:
        for t in range(1, steps + 1):
            loss_and_grad(model, kind, t)
            opt.step()
            traj.append(params_of(model))
    finally:
        opt.close()
    return traj, opt


def assert_resumes_bitwise(kind: str, make_opt, steps: int, cut: int, in_flight=None):
    """Train ``cut`` steps, take ``state_dict()`` (``in_flight(opt)``, when given, must hold
    before it and not after: the worker jobs it waits for), load it into a fresh optimizer over
    a copy of the weights and go on: every later step's parameters equal those of the
    uninterrupted run bit for bit."""
    full, _ = run(kind, make_opt, steps)
    model = make_model(kind)
    opt = make_opt(model.parameters())
    try:
        for t in range(1, cut + 1):
            loss_and_grad(model, kind, t)
            opt.step()
        assert in_flight is None or in_flight(opt)
        sd = copy.deepcopy(opt.state_dict())
        assert in_flight is None or not in_flight(opt)
        saved = params_of(model)
    finally:
        opt.close()
    model2 = make_model(kind)
    with torch.no_grad():
        for p, v in zip(model2.parameters(), saved):
            p.copy_(v)
    opt2 = make_opt(model2.parameters())
    try:
        opt2.load_state_dict(sd)
        for t in range(cut + 1, steps + 1):
            loss_and_grad(model2, kind, t)
            opt2.step()
            assert all(torch.equal(a, b) for a, b in zip(params_of(model2), full[t - 1])), t
    finally:
        opt2.close()


def assert_params_close(got, want, rtol, atol, what=""):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"{what} param {i}: {m}")


def assert_same_state(sd_a, sd_b):
    """Two optimizer state dicts hold the same keys and bitwise-equal values of one dtype."""
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for i, st in sd_a["state"].items():
        assert st.keys() == sd_b["state"][i].keys(), i
        for k, v in st.items():
            w = sd_b["state"][i][k]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape, (i, k, v.dtype, w.dtype)
                assert torch.equal(v, w), (i, k)
            else:
                assert v == w, (i, k)
