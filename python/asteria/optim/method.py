"""A method's part of an Asteria optimizer: its math, and nothing of where state lives or when
jobs run.

Owns: the ``Method`` interface that SOAP, one-sided SOAP, Shampoo and KL-Shampoo fill (the
hyperparameter check, which dimensions of a block get a factor, the state of a preconditioned
parameter declared once as ``STATE`` (``Field``s), from which the base derives its spec for
the planner, its creation, its fixed keys, flags, REFRESH outputs and what a fake step leaves
zero; the first step of fresh blocks, the step on a stack of same-shape blocks, a REFRESH
job's input, the install of its results), the checks every method shares
(``check_common``), and the registry of the optimizers by method name (``METHODS``: the
OLMo-core configs and the capacity planner are made from it, so a new method is its own file
and an export).

A method is held by its optimizer (``opt.method``) and by the parts that call it; the
optimizer binds it (``bind``) to what it reaches, weakly (it is the leaf of the parts: no cycle),
by these names: ``state`` (``optimizer.state``), ``placement`` (its block accessors:
``stack`` / ``unstack`` / ``root_*``, so the kernels see the tensors of the all-device path
wherever a block lives), ``schedule`` (a group's f, device-side counts), ``background`` (its
jobs that write state in the background), ``config`` (the runtime config), ``group_of`` and
``count`` (the run's counters), all from the optimizer's ``Run`` record (``run.py``) but the
three parts. The step math itself is in
``functional``. Single-threaded (the training thread).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, ClassVar, Optional, Sequence

import torch

from asteria.optim import _layout as K
from asteria.optim import functional as F
from asteria.optim._blocking import Layout
from asteria.optim._state import real

INIT = "init"        # first-step eigendecomposition, installed in the step that submitted it
REFRESH = "refresh"  # periodic refresh, installed S steps later

#: optimizer class by method name ("soap", "shampoo", ...): filled by each optimizer class
METHODS: dict = {}


def require(key: str, ok: bool, value: Any, allowed: str) -> None:
    """Raise ValueError naming a bad hyperparameter and what it may be."""
    if not ok:
        raise ValueError(f"invalid {key}: {value!r}; allowed: {allowed}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_common(group: dict, beta_max: Sequence[bool] = (False, False)) -> None:
    """Checks every optimizer shares: lr, betas, weight decay, block size, experts (the
    frequency is the cadence's: ``cadence.check_frequency``). ``beta_max[i]`` allows
    betas[i] == 1."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")  # torch.optim's wording
    lr_value = float(lr) if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr
    require("lr", isinstance(lr_value, (int, float)) and lr_value >= 0.0, lr, "a float >= 0")
    betas = group["betas"]
    require("betas", isinstance(betas, (tuple, list)) and len(betas) == 2, betas,
            "a pair (beta1, beta2)")
    for i, b in enumerate(betas):
        hi = "1]" if beta_max[i] else "1)"
        ok = isinstance(b, (int, float)) and 0.0 <= b and (b <= 1.0 if beta_max[i] else b < 1.0)
        require(f"betas[{i}]", ok, b, f"a float in [0, {hi}")
    wd = group["weight_decay"]
    require("weight_decay", isinstance(wd, (int, float)) and wd >= 0.0, wd, "a float >= 0")
    bs = group["block_size"]
    require("block_size", bs is None or (is_int(bs) and bs >= 1), bs, "None or an integer >= 1")
    ne = group.get("num_experts")
    require("num_experts", ne is None or (is_int(ne) and ne >= 1), ne,
            "None or an integer >= 1 (the experts stacked in dim 0 of each parameter)")


def check_eigenbasis(group: dict) -> None:
    """``check_common`` and the keys the eigenbasis methods (SOAP, KL-Shampoo) share:
    shampoo_beta (the factors' EMA) and eps."""
    check_common(group)
    sb = group["shampoo_beta"]
    require("shampoo_beta", isinstance(sb, (int, float)) and (sb == -1 or 0.0 <= sb < 1.0),
            sb, "-1 (use betas[1]) or a float in [0, 1)")
    require("eps", isinstance(group["eps"], (int, float)) and group["eps"] >= 0.0,
            group["eps"], "a float >= 0")


def shampoo_beta(group: dict) -> float:
    """The factors' EMA coefficient of an eigenbasis method's group: shampoo_beta, or betas[1]
    where it is -1."""
    sb = group["shampoo_beta"]
    return sb if sb >= 0 else group["betas"][1]


@dataclasses.dataclass(frozen=True)
class Field:
    """One entry of a preconditioned block's state: ``b{j}.{name}``, or with ``per_dim`` one per
    dimension i that has a factor, ``b{j}.{name}{i}`` (d x d, or (d,) with ``vector``)."""

    name: str
    #: the planner's kind: "moments", "factors", "roots" or "eigenbases"
    kind: str
    per_dim: bool = False
    vector: bool = False
    #: made zero with the state (else the first step or an install sets it)
    zeros: bool = False
    #: zero after DCP's fake step, and only after an all-zero gradient history
    fake_zero: bool = False
    #: there from the state's creation on, zero with its flag ``b{j}.{name}{i}_set`` = 0 until
    #: the first install (a root in the fixed key set)
    flagged: bool = False


def eigh_input(f: torch.Tensor) -> torch.Tensor:
    """The references decompose F + 1e-30 I."""
    return f + 1e-30 * torch.eye(f.shape[0], dtype=f.dtype, device=f.device)


class Method:
    """The math of one second-order method. Subclasses set ``NAME`` and ``STATE`` and fill the
    hooks of their math; the state hooks (``state_spec``, ``create_state``, ``fixed_state``,
    ``flag_keys``, ``output_specs``, ``output_name``, ``fake_step_tensors``) follow from
    ``STATE``."""

    #: the method's name: its param groups' "algorithm", the OLMo-core config type
    #: ``asteria_<NAME>``, the planner's ``--optimizer``
    NAME: ClassVar[str]
    #: the REFRESH op (``asteria.refresh.ops``) and its root p, for the capacity planner
    REFRESH_OP: ClassVar[tuple] = ("soap_qr", 0.0)
    #: the first step computes the initial eigenbasis (no update); SOAP and KL-Shampoo
    init_step: ClassVar[bool] = True
    #: ``step_blocks`` takes whole parameters as the list of them (``w``), which it updates in
    #: place, instead of a stack that is copied back
    weights_in_place: ClassVar[bool] = False
    #: a preconditioned block's state, in its order: per block the fields without a dimension,
    #: then per dimension with a factor the per-dimension ones. One per-dimension d x d field
    #: is its factor (the first of kind "factors"), one its REFRESH output (kind "roots" or
    #: "eigenbases")
    STATE: ClassVar[tuple[Field, ...]]
    #: a REFRESH job's outputs after the first (d x d in the state's dtype): one (d,) vector
    #: per dtype here (SOAP's sort order)
    EXTRA_OUTPUTS: ClassVar[tuple[torch.dtype, ...]] = ()

    def __init__(self) -> None:
        """Detached: its rules of a param group alone are used (the OLMo-core configs, the
        capacity planner) until an optimizer binds it (``bind``)."""
        self._run = self._placement = self._schedule = self._background = lambda: None

    def bind(self, run, placement, schedule, background, cadence) -> None:
        """Work for the optimizer of ``run``, through its placement, schedule, background jobs
        and cadence, each held weakly (they hold this method, or what it makes)."""
        self._run = weakref.ref(run)
        self._placement = weakref.ref(placement)
        self._schedule = weakref.ref(schedule)
        self._background = weakref.ref(background)
        self._cadence = weakref.ref(cadence)

    @property
    def run(self):
        """The optimizer's ``Run`` record (``asteria.optim.run``)."""
        return self._run()

    @property
    def state(self):
        return self._run().state

    @property
    def placement(self):
        """The placement's block accessors (``asteria.optim.placement.Placement``)."""
        return self._placement()

    @property
    def schedule(self):
        """The schedule (``asteria.optim.schedule.Schedule``): device-side counts
        (``count_lazy``)."""
        return self._schedule()

    @property
    def cadence(self):
        """The cadence (``asteria.optim.cadence.Cadence``): the due rule (``comes_due``) and a
        group's f (``frequency``)."""
        return self._cadence()

    @property
    def background(self):
        """The background jobs (``asteria.optim.background.BackgroundJobs``): whether a declared
        job may run on a worker (``on_worker``), starting it (``offload``), the waits for what
        a job writes (``settle``)."""
        return self._background()

    @property
    def config(self):
        """The runtime config (``asteria.RuntimeConfig``) of the optimizer."""
        return self._run().cfg

    def group_of(self, p: torch.Tensor) -> dict:
        """The param group of p."""
        return self._run().group_of(p)

    def count(self, name: str, n: int = 1) -> None:
        """Add to one of the optimizer's counters (``asteria_stats()``)."""
        self._run().counters[name] += n

    # ---- hyperparameters ----------------------------------------------------------------------
    def check(self, group: dict) -> None:
        """Raise ValueError naming a bad hyperparameter of a param group."""
        raise NotImplementedError

    def normalize_group(self, group: dict) -> None:
        """Bring a param group's values into the form kept in it (KL-Shampoo: dtypes by name)."""

    def uses_adamw(self, p: torch.Tensor, group: dict) -> bool:
        """The method's own rule for the AdamW path (1-D / 0-D parameters, by the dimensions of
        ``real(p)``: a complex 1-D parameter's real view is 2-D)."""
        return real(p).dim() <= 1

    def adamw_hparams(self, group: dict) -> tuple[float, float, float]:
        """(beta1, beta2, eps) of the AdamW update of 1-D parameters."""
        return group["betas"][0], group["betas"][1], group["eps"]

    def max_dim(self, group: dict) -> int:
        return group["max_precond_dim"]

    def merge_dims(self, group: dict) -> bool:
        return False

    def has_factor(self, block_shape: Sequence[int], group: dict) -> list[bool]:
        """Which dimensions of a block get a factor (the others keep their coordinates)."""
        limit = self.max_dim(group)
        return [d <= limit for d in block_shape]

    # ---- state: all of it from ``STATE`` --------------------------------------------------------
    def state_dtype(self, p: torch.Tensor, group: dict) -> torch.dtype:
        """The dtype of a preconditioned parameter's state (and of its REFRESH outputs)."""
        return real(p).dtype

    @property
    def factor_field(self) -> str:
        """The factor a refresh decomposes (``b{j}.<field>{i}``)."""
        return next(f.name for f in self.STATE
                    if f.kind == "factors" and f.per_dim and not f.vector)

    @property
    def output_field(self) -> str:
        """Where a REFRESH job's output 0 is installed (``b{j}.<field>{i}``)."""
        return next(f.name for f in self.STATE if f.kind in ("roots", "eigenbases"))

    def entries(self, group: dict, layout: Layout):
        """(block j, dimension or None, Field, shape) of every entry of ``STATE``, in order."""
        for j, shape in enumerate(layout.block_shapes):
            for f in self.STATE:
                if not f.per_dim:
                    yield j, None, f, tuple(shape)
            for i, has in enumerate(self.has_factor(shape, group)):
                if has:
                    d = shape[i]
                    for f in self.STATE:
                        if f.per_dim:
                            yield j, i, f, ((d,) if f.vector else (d, d))

    def state_spec(self, p: torch.Tensor, group: dict, layout: Layout) -> list:
        """[(state name, kind, shape, dtype)] of a preconditioned parameter's state, for the
        planner and the checks of a load."""
        dt = self.state_dtype(p, group)
        return [(K.key(j, f.name, i), f.kind, shape, dt)
                for j, i, f, shape in self.entries(group, layout)]

    def create_state(self, p: torch.Tensor, group: dict, layout: Layout) -> None:
        """A fresh state: the step count and the fields made zero."""
        st = self.state[p]
        st["step"] = 0
        dt, device = self.state_dtype(p, group), real(p).device
        for j, i, f, shape in self.entries(group, layout):
            if f.zeros:
                st[K.key(j, f.name, i)] = torch.zeros(shape, dtype=dt, device=device)

    def fixed_state(self, p: torch.Tensor, group: dict, layout: Layout) -> None:
        """Add the method's keys of the fixed key set that p's state lacks (at creation, after
        a load): a flagged field and its flag, zero and 0 until the first install."""
        st = self.state[p]
        for j, i, f, shape in self.entries(group, layout):
            flag = K.set_flag(j, f.name, i) if f.flagged else None
            if flag is not None and flag not in st:
                name = K.key(j, f.name, i)
                st[flag] = int(self.placement.root_has(p, name))
                if not st[flag]:
                    self.placement.root_set(p, name, torch.zeros(
                        shape, dtype=self.state_dtype(p, group), device=real(p).device))

    def flag_keys(self, p: torch.Tensor, group: dict, layout: Layout) -> list:
        """Names of the number-valued state keys of a preconditioned parameter besides the
        step and the refresh-in-flight keys (the flags of the flagged fields)."""
        return [K.set_flag(j, f.name, i) for j, i, f, _ in self.entries(group, layout)
                if f.flagged]

    def output_specs(self, p: torch.Tensor, group: dict, d: int) -> list:
        """[(shape, dtype)] of the outputs of a REFRESH job of a factor of size d."""
        dt = self.state_dtype(p, group)
        return [((d, d), dt)] + [((d,), x) for x in self.EXTRA_OUTPUTS]

    def output_name(self, p: torch.Tensor, j: int, dim: int) -> str:
        """The state name a REFRESH output 0 of (block j, dim) is installed into."""
        return K.key(j, self.output_field, dim)

    def fake_step_tensors(self, p: torch.Tensor) -> list:
        """The state tensors of a preconditioned parameter that DCP's fake step (zero gradients)
        leaves at zero, and that only an all-zero gradient history leaves at zero (a job in
        flight that writes one is waited for first)."""
        st = self.state[p]
        zero = [f for f in self.STATE if f.fake_zero]
        keys = [k for k in dict.keys(st)
                if any((K.is_factor if f.per_dim else K.is_moment)(k, f.name) for f in zero)]
        for k in keys:
            self.background.settle(p, k)
        return [dict.__getitem__(st, k) for k in keys]

    def batch_tag(self, p: torch.Tensor, j: int) -> Any:
        """Extra key that separates blocks of one shape into different stacks."""
        return None

    # ---- the step -----------------------------------------------------------------------------
    def init_blocks(self, group: dict, members: list, g: torch.Tensor) -> list:
        """First step of fresh blocks; returns [(p, j, dims)] needing an eigendecomposition."""
        raise NotImplementedError

    def step_blocks(self, group: dict, members: list, w, g: torch.Tensor,
                    steps: list[int]) -> None:
        """One step of a stack of same-shape blocks: ``w`` their weights (a stack, or with
        ``weights_in_place`` the list of whole parameters), ``g`` their gradients, ``steps``
        each member's step count."""
        raise NotImplementedError

    # ---- the refresh --------------------------------------------------------------------------
    def refresh_input(self, kind: str, p: torch.Tensor, j: int, dim: int):
        """(op, F, Q or None, p, eps) of one factor's job."""
        raise NotImplementedError

    def install(self, kind: str, outputs: dict) -> None:
        raise NotImplementedError

    # ---- shared by the eigenbasis methods -----------------------------------------------------
    def init_bases(self, members: list, factors: list) -> list:
        """Store first-step factors (``b{j}.{factor_field}{i}``) with the identity as their basis;
        return [(p, j, dims)] of the factors that are not c*I and so need a real
        eigendecomposition."""
        state, placement = self.state, self.placement
        need: dict = {}
        for i, f in enumerate(factors):
            if f is None:
                continue
            eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
            for (p, j), fi, trivial in zip(members, f.unbind(0), F.is_scaled_identity(f)):
                state[p][K.key(j, self.factor_field, i)] = fi.clone()
                placement.root_set(p, K.key(j, self.output_field, i), eye)
                if not trivial:
                    need.setdefault((p, j), []).append(i)
        return [(p, j, dims) for (p, j), dims in need.items()]

    def eigenbasis_refresh_input(self, kind: str, p: torch.Tensor, j: int, dim: int):
        """An eigenbasis method's job for one factor: the first step's eigendecomposition of
        F, then its ``REFRESH_OP`` (one QR sweep of F against the current basis Q)."""
        f = self.state[p][K.key(j, self.factor_field, dim)]
        if kind == INIT:
            return "eigh", eigh_input(f), None, 0.0, 0.0
        q = self.placement.root_for_job(p, K.key(j, self.output_field, dim))
        return self.REFRESH_OP[0], f, q, 0.0, 0.0

    def install_bases(self, outputs: dict) -> None:
        """Install eigenbases (first-step eigh, KL-Shampoo's QR): Q_i = output 0; failures keep
        Q."""
        placement = self.placement
        for p, outs in outputs.items():
            for (j, dim), out in outs.items():
                if out is not None:
                    placement.root_set(p, K.key(j, self.output_field, dim), out[0])



def register(cls: type) -> type:
    """Class decorator of an optimizer: its method's name finds it (``METHODS``)."""
    name = cls.METHOD.NAME
    if METHODS.get(name, cls) is not cls:
        raise ValueError(f"two optimizers for the method name {name!r}")
    METHODS[name] = cls
    return cls


def method_defaults(cls: type) -> dict:
    """An optimizer class's keyword defaults (its signature's), ``params`` and ``runtime``
    left out: a param group as the class builds it by default."""
    import inspect

    out = {}
    for name, prm in inspect.signature(cls).parameters.items():
        if name in ("params", "runtime") or prm.default is inspect.Parameter.empty:
            continue
        out[name] = prm.default
    return out


def method_of(name: Optional[str]) -> type:
    """The optimizer class of a method name; ValueError naming the names allowed."""
    cls = METHODS.get(name)
    if cls is None:
        raise ValueError(f"unknown method {name!r}; allowed: {sorted(METHODS)}")
    return cls
