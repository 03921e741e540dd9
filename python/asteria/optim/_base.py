"""The staleness scheduler and the torch.optim plumbing shared by SOAP, Shampoo and KL-Shampoo.

Owns: the REFRESH engine of one optimizer, the rounds of REFRESH jobs in flight, the global step
counter, the block layouts, and the counters behind ``asteria_stats()``. It calls the engine
(``asteria.engine``), the functional kernels only through its subclasses, and torch.

Schedule (DESIGN.md, "Staleness"). Steps are counted per ``step()`` call (t = 1, 2, ...).
 - At the end of step t, first every round whose time has come is installed: its install step
   t_snapshot + S has come (``install="deterministic"``: exactly then, waiting at the bounded
   barrier if need be), or (``install="eager"``) all its jobs are ready. Then the factors that
   came due in step t (k % f == 0 for their parameter) are snapshotted and submitted: one
   batched job per (op, factor size, dtype, device), grouped over all same-shape blocks of all
   parameters. A round whose install step is t (``mode="sync"``, or S = 0) is installed at once.
   So a refresh always starts from the newest installed basis, and with 0 <= S <= f a parameter
   never has two refreshes in flight. Each job carries a block key that is stable for its set of
   (parameter, block, dimension) targets, so the C pool's failure counting sees one block.
 - The first-step eigendecomposition of SOAP and KL-Shampoo goes through the engine too, but is
   waited for at once whatever S is: before it no basis exists to precondition with. A factor
   that is c*I (the all-zero "fake step" of torch.distributed.checkpoint) gets the identity as
   its basis without any job.
 - A parameter with a non-finite gradient is skipped entirely (parameter, state, step count and
   refresh schedule untouched) and counted. A job that fails keeps the previous preconditioner.
 - ``state_dict()`` waits for the rounds in flight and stores their results, not installed,
   with the number of steps until their install, in the parameters' state; ``load_state_dict``
   turns them back into rounds, so the run resumes on the same trajectory.

Checkpoints through torch.distributed.checkpoint (DCP).
 - Fixed key set. A flattened load (``StateDictOptions(flatten_optimizer_state_dict=True)``)
   keeps only the keys the live ``optimizer.state`` of the loading optimizer has, and that one
   is fresh: DCP's fake step made its state. So a preconditioned parameter's state has one key
   set from its creation on, the same live and in ``state_dict()``: with S > 0 the keys of a
   refresh in flight always exist (``pending.install_in`` = -1 (``NO_ROUND``) and
   ``pending.age`` = 0 without one; ``b{j}.pending{dim}.{i}`` zero placeholders of the outputs'
   shapes and dtypes, with ``b{j}.pending{dim}_ok`` = 0), and so do Shampoo's roots (zeros with
   ``b{j}.Linv{i}_set`` = 0 before the first install). Live, a placeholder is a stride-0 view of
   one shared zero (no memory); ``state_dict()`` hands out real zeros or the results. With
   S = 0 (``mode="sync"``) nothing is ever in flight at a step end and the pending keys do not
   exist.
 - The fake step. DCP materialises the state of an optimizer without one by ``step()`` with
   zero gradients and lr 0. It launches no engine job (zero factors get the identity basis;
   a refresh due then is not submitted), and the next real step of a parameter whose state is
   exactly what it leaves (SOAP / KL-Shampoo: step 0 with zero factors, hence identity bases;
   Shampoo: step 1 with zero factors, momentum and grafting state; AdamW path: step 1 with
   zero moments) starts that parameter afresh, so the trajectory is that of a run without the
   fake step. (An all-zero first gradient leaves the same state and is treated the same way.)
 - FSDP2 across several ranks: the state of a sharded DTensor parameter is its local shard's,
   a plain tensor per rank; DCP keeps one copy of a plain value that several ranks save under
   one name. So its keys carry the shard's tag (``b0.exp_avg@shard1of2``, ``step@shard1of2``;
   ``shard_tag``), live and in ``state_dict()``, and every rank's copy is kept (uneven shards,
   a different key set per rank included). Resuming needs the same mesh and sharding.

Placement (``asteria.placement``, ``asteria.tiered``): at construction the planner assigns a
tier to every piece of state. Factors and moments always live in ``self.state`` on the
parameter's device. In ``mode="async"`` roots / eigenbases normally live in a ``Residency``
(host, pinned, UVM or NVMe blocks) instead of ``self.state``; every access goes through
``_stack`` / ``_unstack`` / ``_root_*`` so the kernels see exactly the tensors they would see
with everything on the device (the same values, stacked the same way: results are bitwise
those of the all-device path). A step with a residency runs in two phases: ``prepare`` (NVMe
reads and writes, ring prefetches) before anything is mutated, so an I/O failure raises with
the parameters, the state and the step counter untouched; then the usual step, streaming
preconditioned stacks through the staging ring in chunks that fit it.

Distributed runs (``asteria.distributed``, docs/distributed.md): FSDP2 parameters are DTensors and
the optimizer works on their local shards (``local``), blocked as usual. When some parameters are
replicated across ranks (DDP, HSDP), the engine is a ``DistributedEngine`` around the usual one:
jobs are batched per replica set and carry it (``replicas=``), each block is computed by its
owner only, and ``step_end`` hands finished results to the synchronisation every step.

Single-threaded: everything runs on the caller's thread; the engine's workers never see this
module's objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
import sys
import warnings
import weakref
from collections import defaultdict
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from asteria import engine as _engine_mod
from asteria.config import RuntimeConfig
from asteria.optim._blocking import Layout, make_layout
from asteria.optim import functional as F
from asteria import placement as _placement
from asteria import distributed as _dist

#: the keys of asteria_stats() every mode reports (the benchmark's contract)
STATS_KEYS = ("bytes_device", "bytes_host", "bytes_host_pinned", "bytes_uvm", "bytes_nvme",
              "jobs_queued", "jobs_running", "jobs_done", "barrier_waits", "barrier_wait_ns",
              "bytes_h2d", "bytes_d2h", "bytes_nvme_read", "bytes_nvme_written",
              "nvme_read_MBps", "nvme_write_MBps")


def local(t):
    """The local shard of a DTensor (FSDP2's parameters and gradients: a view sharing its
    storage), else t itself. No DTensor exists unless torch.distributed.tensor was imported."""
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is not None and isinstance(t, mod.DTensor):
        return t.to_local()
    return t


_TAG_SEP = "@"
_TAG_RE = re.compile(r"@shard\d+of\d+(?:_\d+of\d+)*")


def shard_tag(p) -> Optional[str]:
    """The tag of a DTensor parameter sharded over more than one rank: ``shard{i}of{n}`` per
    mesh dimension that shards it (``shard0of2``, ``shard1of2_0of4``), else None. Replicas of
    one shard (HSDP) share it."""
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is None or not isinstance(p, mod.DTensor):
        return None
    mesh = p.device_mesh
    coord = mesh.get_coordinate() or []
    parts = [f"{coord[d]}of{mesh.size(d)}" for d, pl in enumerate(p.placements)
             if isinstance(pl, mod.Shard) and mesh.size(d) > 1 and d < len(coord)]
    return "shard" + "_".join(parts) if parts else None


class _ParamState(dict):
    """One parameter's state when some of it lives in a Residency, or when the parameter is a
    DTensor sharded over several ranks: a plain dict for the device tensors plus "virtual"
    entries for the tiered roots / eigenbases. Reading a virtual entry returns a fresh copy on
    the parameter's device (never a live view), assigning one writes the block, popping one
    frees it. The optimizer itself never goes through the virtual entries (it stages blocks
    through the ring); they exist so state inspection and torch.optim's plumbing see the same
    keys as with everything on the device.

    A sharded parameter's state is per shard: its keys, as iteration (and so DCP) sees them,
    carry the shard's tag (``b0.exp_avg@shard1of2``), so that a checkpoint keeps every rank's
    copy instead of one for all; lookups take either name, the optimizer uses the plain one."""

    __slots__ = ("_owner", "_p", "_tag")

    def __init__(self, opt, p, items=()):
        super().__init__(items)
        # the state must not own its optimizer: with a strong reference the pair is a cycle,
        # and with the cycle collector off (OLMo-core's training policy) ``del opt`` would free
        # neither the optimizer nor its workers and buffers
        self._owner = weakref.ref(opt)
        self._p = p
        self._tag = opt._tags.get(p)

    @property
    def _opt(self):
        opt = self._owner()
        if opt is None:
            raise RuntimeError("the Asteria optimizer this state belonged to is gone")
        return opt

    def _int(self, k):
        """The optimizer's name of a key (the tag stripped)."""
        if self._tag is not None and isinstance(k, str):
            suffix = _TAG_SEP + self._tag
            if k.endswith(suffix):
                return k[:-len(suffix)]
        return k

    def _ext(self, k):
        return k if self._tag is None else f"{k}{_TAG_SEP}{self._tag}"

    def _vkey(self, k):
        opt = self._opt
        if opt._tiered is None or not isinstance(k, str) or dict.__contains__(self, k):
            return None
        key = (opt._pindex[self._p], k)
        return key if opt._tiered.has(key) else None

    def _virtual(self) -> list:
        opt = self._opt
        if opt._tiered is None:
            return []
        pidx = opt._pindex[self._p]
        return [k[1] for k in opt._tkeys.get(pidx, ()) if opt._tiered.has(k)]

    def __getitem__(self, k):
        k = self._int(k)
        if self._opt._rotations:
            self._opt._settle_rotation(self._p, k)
        key = self._vkey(k)
        if key is None:
            return dict.__getitem__(self, k)
        return self._opt._tiered.materialize([key])[key]

    def get(self, k, default=None):
        return self[k] if k in self else default

    def __contains__(self, k):
        k = self._int(k)
        return dict.__contains__(self, k) or self._vkey(k) is not None

    def __iter__(self):
        for k in dict.__iter__(self):
            yield self._ext(k)
        for k in self._virtual():
            yield self._ext(k)

    def __len__(self):
        return dict.__len__(self) + len(self._virtual())

    def keys(self):
        return list(iter(self))

    def items(self):
        return [(k, self[k]) for k in self]

    def values(self):
        return [self[k] for k in self]

    def __setitem__(self, k, v):
        opt = self._opt
        k = self._int(k)
        if opt._rotations:
            opt._settle_rotation(self._p, k)
        if isinstance(v, torch.Tensor) and opt._owned(self._p, k):
            opt._tiered.write((opt._pindex[self._p], k), v)
        else:
            dict.__setitem__(self, k, v)

    def pop(self, k, *default):
        k = self._int(k)
        if self._opt._rotations:
            self._opt._settle_rotation(self._p, k)
        key = self._vkey(k)
        if key is None:
            return dict.pop(self, k, *default)
        v = self[k]
        self._opt._tiered.drop(key)
        return v

    def __delitem__(self, k):
        k = self._int(k)
        if self._opt._rotations:
            self._opt._settle_rotation(self._p, k)
        key = self._vkey(k)
        if key is None:
            dict.__delitem__(self, k)
        else:
            self._opt._tiered.drop(key)

    def raw(self) -> dict:
        """The device entries only, under the optimizer's names."""
        return dict(dict.items(self))

    def __reduce__(self):
        return (dict, (dict(self.items()),))

    def __repr__(self):
        return repr(dict(self.items()))


class _States(defaultdict):
    """``optimizer.state`` with a Residency: creates _ParamState entries for parameters. Other
    keys (torch.optim allows entries that are not a parameter's state, which state-dict hooks
    use) are kept as they are. Holds its optimizer weakly (see _ParamState)."""

    def __init__(self, opt, items=()):
        super().__init__(dict)
        self._owner = weakref.ref(opt)
        for p, st in dict(items).items():
            if isinstance(p, torch.Tensor) and not isinstance(st, _ParamState):
                st = _ParamState(opt, p, st)
            self[p] = st

    def __missing__(self, p):
        if not isinstance(p, torch.Tensor):  # torch.optim's defaultdict(dict) does the same
            st = self[p] = {}
            return st
        opt = self._owner()
        if opt is None:
            raise RuntimeError("the Asteria optimizer this state belonged to is gone")
        st = self[p] = _ParamState(opt, p)
        return st

    def __reduce__(self):
        return (dict, (dict(self.items()),))


@contextlib.contextmanager
def _hooks_off(opt, attr: str):
    """torch.optim runs the hooks in ``opt.<attr>`` itself; with them set aside the caller
    runs them where they belong (on the state dict it returns, on the state it loaded)."""
    hooks = getattr(opt, attr)
    setattr(opt, attr, type(hooks)())
    try:
        yield hooks
    finally:
        setattr(opt, attr, hooks)


def _close_all(engine, tiered) -> None:
    """Finalizer of an optimizer (also at interpreter exit): the engine first (it writes the
    trace file and stops the workers), then the residency."""
    try:
        if engine is not None:
            engine.close()
    finally:
        if tiered is not None:
            tiered.close()

INIT = "init"        # first-step eigendecomposition, installed in the step that submitted it
REFRESH = "refresh"  # periodic refresh, installed S steps later

# The fixed state keys of a REFRESH in flight (present from a preconditioned parameter's state
# creation on whenever S > 0; see "Checkpoints" in AsteriaOptimizer's docstring):
_PENDING_IN = "pending.install_in"  # steps until the install; NO_ROUND: nothing in flight
_PENDING_AGE = "pending.age"        # steps since the snapshot
_PENDING = ".pending"               # b{j}.pending{dim}.{i}: output i of (block j, dim)
_PENDING_OK = "_ok"                 # b{j}.pending{dim}_ok: 1 if those outputs are a result
NO_ROUND = -1
_PENDING_OUT_RE = re.compile(r"b(\d+)\.pending(\d+)\.(\d+)")
_PENDING_OK_RE = re.compile(r"b(\d+)\.pending(\d+)_ok")
ADAMW = "adamw"  # a param group's "algorithm" that sends all its parameters to AdamW
AST_EFAILED = -18  # include/asteria/errors.h


def _count(v: Any) -> int:
    """A step count stored as an int (or a loaded 0-d tensor)."""
    return int(v.item()) if isinstance(v, torch.Tensor) else int(v)


def require(key: str, ok: bool, value: Any, allowed: str) -> None:
    """Raise ValueError naming a bad hyperparameter and what it may be."""
    if not ok:
        raise ValueError(f"invalid {key}: {value!r}; allowed: {allowed}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_common(group: dict, beta_max: Sequence[bool] = (False, False)) -> None:
    """Checks every optimizer shares: lr, betas, weight decay, frequency, block size.
    ``beta_max[i]`` allows betas[i] == 1."""
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
    f = group["precondition_frequency"]
    require("precondition_frequency", is_int(f) and f >= 1, f, "an integer >= 1")
    bs = group["block_size"]
    require("block_size", bs is None or (is_int(bs) and bs >= 1), bs, "None or an integer >= 1")


@dataclasses.dataclass
class _Rotation:
    """One soap_rotate job: the members whose m it re-expresses, its inputs (kept for a
    fallback on failure) and the block shape of m."""

    ticket: int
    members: list
    inputs: tuple
    shape: tuple


@dataclasses.dataclass
class _Job:
    ticket: int
    targets: list  # [(param, block index j, block dimension)], one per batch entry


class _Round:
    """The REFRESH jobs snapshotted at one step end; installed together, at one step end."""

    def __init__(self, kind: str, snapshot_step: int, install_step: int, jobs: list[_Job],
                 outputs: Optional[dict] = None):
        self.kind = kind
        self.snapshot_step = snapshot_step
        self.install_step = install_step
        self.jobs = jobs
        self.failed = 0
        # param -> {(j, dim): output tuple, or None where the job failed}; None until resolved
        self.outputs = outputs
        # [(targets, error)] of the jobs that failed, once resolved
        self.failures: list = []
        # ticket -> Result of the jobs already waited for: a wait interrupted by a signal
        # (Ctrl-C) loses nothing, and the next resolve waits for the others only
        self._results: dict = {}

    def ready(self, engine) -> bool:
        return self.outputs is not None or all(
            j.ticket in self._results or engine.ready(j.ticket) for j in self.jobs)

    def resolve(self, engine) -> dict:
        """Wait (the bounded barrier) for every job and keep the results."""
        if self.outputs is None:
            for job in self.jobs:
                if job.ticket not in self._results:
                    self._results[job.ticket] = engine.wait(job.ticket)
            out: dict = {}
            for job in self.jobs:
                res = self._results[job.ticket]
                if res.status:
                    self.failed += 1
                    self.failures.append((job.targets, res.error or f"status {res.status}"))
                for b, (p, j, dim) in enumerate(job.targets):
                    per_param = out.setdefault(p, {})
                    per_param[(j, dim)] = (None if res.status
                                           else tuple(o[b] for o in res.outputs))
            self.outputs = out
            self._results = {}
        return self.outputs

    def drop(self, engine) -> None:
        if self.outputs is None:
            for job in self.jobs:
                if job.ticket in self._results:
                    continue
                engine.cancel(job.ticket)  # a job already running just finishes
                engine.wait(job.ticket)
        self.outputs = {}
        self._results = {}


def eigh_input(f: torch.Tensor) -> torch.Tensor:
    """The references decompose F + 1e-30 I."""
    return f + 1e-30 * torch.eye(f.shape[0], dtype=f.dtype, device=f.device)


def init_bases(opt, members: list, factors: list, name: str) -> list:
    """Store first-step factors with the identity as their basis; return [(p, j, dims)] of the
    factors that are not c*I and so need a real eigendecomposition."""
    state = opt.state
    need: dict = {}
    for i, f in enumerate(factors):
        if f is None:
            continue
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        for (p, j), fi, trivial in zip(members, f.unbind(0), F.is_scaled_identity(f)):
            state[p][f"b{j}.{name}{i}"] = fi.clone()
            opt._root_set(p, f"b{j}.Q{i}", eye)
            if not trivial:
                need.setdefault((p, j), []).append(i)
    return [(p, j, dims) for (p, j), dims in need.items()]


def install_bases(opt, outputs: dict) -> None:
    """Install eigenbases (first-step eigh, KL-Shampoo's QR): Q_i = output 0; failures keep Q."""
    for p, outs in outputs.items():
        for (j, dim), out in outs.items():
            if out is not None:
                opt._root_set(p, f"b{j}.Q{dim}", out[0])


class AsteriaOptimizer(torch.optim.Optimizer):
    """Base of the Asteria optimizers. Subclasses supply the math through the hooks below."""

    #: SOAP and KL-Shampoo spend their first step on the initial eigenbasis (no update).
    _init_step = True
    #: SOAP re-expresses its first moment m at each install (the workers can do it).
    _rotates_m = False

    def __init__(self, params: Iterable, defaults: dict, runtime: Any) -> None:
        self._closed = False
        self._engine = None
        self._tiered = None
        self._rotations: dict = {}  # (param, "b{j}.exp_avg") -> its _Rotation in flight
        self._planning = False
        self._check_hyperparameters(defaults)
        self._cfg = RuntimeConfig.from_user(runtime)
        self._async = self._cfg.mode == "async"
        self._pindex: dict[torch.Tensor, int] = {}  # stable ids for the engine's block keys
        self._gindex: dict[torch.Tensor, int] = {}  # param -> index of its group
        self._layouts: dict[torch.Tensor, Layout] = {}
        self._zeros: dict = {}  # (dtype, device) -> the zero behind the placeholders
        self._tags: dict[torch.Tensor, str] = {}  # sharded DTensor param -> its shard's tag
        super().__init__(params, defaults)
        self._delay = self._cfg.staleness if self._async else 0
        self._eager = self._async and self._cfg.install == "eager"
        self._t = 0
        self._rounds: list[_Round] = []
        self._block_keys: dict[tuple, int] = {}
        self._versions: dict[int, int] = {}
        self._unfinished_end: Optional[list] = None  # see _step_end
        self._fail_streak: dict = {}  # (param index, block, dim) -> consecutive failures
        self._lazy_counts: dict = {}  # name -> device tensor (see _count_lazy)
        self._failed: list = []       # failures to raise at the end of this step
        self._counters = {"nonfinite_skipped": 0, "refreshes_submitted": 0,
                          "refresh_failures": 0, "installs": 0, "max_install_lag": 0,
                          "rotations_submitted": 0, "rotation_failures": 0}
        self._pnames: dict[int, str] = {}  # param index -> name (asteria.attach fills it)
        self._plan: Optional[_placement.Plan] = None
        self._tkeys: dict[int, list] = {}  # param index -> its tiered state keys
        self._finalizer = None
        try:
            self._replan()
        except BaseException:
            if self._engine is not None:
                self._engine.close()
            raise
        self._finalizer = weakref.finalize(self, _close_all, self._engine, self._tiered)

    # ---- hooks for subclasses -----------------------------------------------------------------
    def _check_hyperparameters(self, group: dict) -> None:
        raise NotImplementedError

    def _uses_adamw(self, p: torch.Tensor, group: dict) -> bool:
        """The method's own rule (1-D / 0-D parameters); see ``_is_adamw``."""
        raise NotImplementedError

    def _is_adamw(self, p: torch.Tensor, group: dict) -> bool:
        """Does p take the AdamW path? A group with ``"algorithm": "adamw"`` (OLMo-core's
        convention) sends every parameter of it there, 2-D ones too (embeddings, output heads);
        otherwise the method's rule decides."""
        return group.get("algorithm") == ADAMW or self._uses_adamw(p, group)

    def _fake_step_tensors(self, p: torch.Tensor) -> list:
        """The state tensors of a preconditioned parameter that DCP's fake step (zero gradients)
        leaves at zero, and that only an all-zero gradient history leaves at zero ([] if none
        such exists: the state is then never taken for a fake step's)."""
        raise NotImplementedError

    def _output_specs(self, p: torch.Tensor, group: dict, d: int) -> list:
        """[(shape, dtype)] of the outputs of a REFRESH job of a factor of size d (the
        ``b{j}.pending{dim}.{i}`` placeholders)."""
        return [((d, d), p.dtype)]

    def _fixed_state(self, p: torch.Tensor, group: dict, layout: Layout) -> None:
        """Add the keys of the fixed key set that p's state lacks (at creation, after a load):
        with S > 0 the placeholders of a REFRESH in flight. Subclasses add theirs (Shampoo's
        roots before their first install) and call this."""
        if self._delay <= 0:
            return
        st = self.state[p]
        if _PENDING_IN not in st:
            st[_PENDING_IN], st[_PENDING_AGE] = NO_ROUND, 0
        for j, shape in enumerate(layout.block_shapes):
            for dim, has in enumerate(self._has_factor(shape, group)):
                if not has:
                    continue
                ok = f"b{j}{_PENDING}{dim}{_PENDING_OK}"
                if ok not in st:
                    st[ok] = 0
                for i, (oshape, dtype) in enumerate(self._output_specs(p, group, shape[dim])):
                    key = f"b{j}{_PENDING}{dim}.{i}"
                    if key not in st:
                        st[key] = self._placeholder(oshape, dtype, local(p).device)

    def _placeholder(self, shape, dtype, device) -> torch.Tensor:
        """A zero tensor of this shape that costs one element: a stride-0 view of a shared
        zero. ``state_dict()`` hands out real zeros in its place."""
        key = (dtype, device)
        zero = self._zeros.get(key)
        if zero is None:
            zero = self._zeros[key] = torch.zeros((), dtype=dtype, device=device)
        return zero.expand(shape)

    def _flag_keys(self, p: torch.Tensor, group: dict, layout: Layout) -> list:
        """Names of the number-valued state keys of a preconditioned parameter besides the
        step and the refresh-in-flight keys (Shampoo's ``b{j}.Linv{i}_set``)."""
        return []

    def _adamw_hparams(self, group: dict) -> tuple[float, float, float]:
        """(beta1, beta2, eps) of the AdamW update of 1-D parameters."""
        raise NotImplementedError

    def _max_dim(self, group: dict) -> int:
        raise NotImplementedError

    def _merge_dims(self, group: dict) -> bool:
        return False

    def _create_state(self, p: torch.Tensor, group: dict, layout: Layout) -> None:
        raise NotImplementedError

    def _batch_tag(self, p: torch.Tensor, j: int) -> Any:
        """Extra key that separates blocks of one shape into different stacks."""
        return None

    def _init_blocks(self, group: dict, members: list, g: torch.Tensor) -> list:
        """First step of fresh blocks; returns [(p, j, dims)] needing an eigendecomposition."""
        raise NotImplementedError

    def _step_blocks(self, group: dict, members: list, w: torch.Tensor, g: torch.Tensor,
                     steps: list[int]) -> None:
        raise NotImplementedError

    def _refresh_input(self, kind: str, p: torch.Tensor, j: int, dim: int):
        """(op, F, Q or None, p, eps) of one factor's REFRESH job."""
        raise NotImplementedError

    def _install(self, kind: str, outputs: dict) -> None:
        raise NotImplementedError

    def _state_spec(self, p: torch.Tensor, group: dict, layout: Layout) -> list:
        """[(state name, kind, shape, dtype)] of a preconditioned parameter's state, for the
        planner; kind is one of "factors", "moments", "roots", "eigenbases"."""
        raise NotImplementedError

    # ---- placement ----------------------------------------------------------------------------
    def _entries(self) -> list:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                lp = local(p)
                pidx = self._pindex[p]
                itemsize = lp.element_size()
                if lp.numel() == 0 or self._is_adamw(p, group):
                    spec = [(n, "moments", tuple(lp.shape), lp.dtype)
                            for n in ("exp_avg", "exp_avg_sq")]
                else:
                    spec = self._state_spec(p, group, self._layout(p, group))
                for name, kind, shape, dtype in spec:
                    itemsize = torch.empty((), dtype=dtype).element_size()
                    out.append(_placement.StateEntry(pidx, name, kind,
                                                     int(torch.Size(shape).numel()) * itemsize,
                                                     lp.device))
        return out

    def _replan(self) -> None:
        """Plan (or re-plan after add_param_group) the placement of every state tensor, and move
        existing tensors where the plan wants them."""
        from asteria import tiered as _tiered_mod

        entries = self._entries()
        self._kinds = {e.key: e.kind for e in entries}
        plan = _placement.make_plan(self._cfg, entries)
        plan.log()
        if self._engine is None:
            if self._async:
                from asteria.engine_c import CEngine

                self._engine = CEngine(self._cfg, shadow="cuda" if plan.cuda else "host",
                                       snapshot_ring_bytes=plan.snapshot_ring_bytes)
            else:
                self._engine = _engine_mod.make_engine(self._cfg)
            # a multi-rank job with replicated (DDP / HSDP) parameters: one owner per block
            self._engine = _dist.wrap_engine(self._engine, self._all_params())
        self._plan = plan
        self._tkeys = defaultdict(list)
        for key, tier in plan.block_tier.items():
            if tier != "device":
                self._tkeys[key[0]].append(key)
        if plan.tiered and self._tiered is None:
            # no strong reference back to self: the finalizer holds the residency
            me = weakref.ref(self)

            def describe(key, _me=me):
                opt = _me()
                return opt._describe_key(key) if opt is not None else f"block {key!r}"

            self._tiered = _tiered_mod.Residency(
                plan, self._cfg, tracer=getattr(self._engine, "trace", None), describe=describe)
            self.state = _States(self, self.state)
            if self._finalizer is not None:  # the finalizer must close the new residency too
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _close_all, self._engine,
                                                   self._tiered)
        elif self._tiered is not None:
            self._tiered.plan = plan
        if (self._tags or self._offloads_rotation()) and not isinstance(self.state, _States):
            # per-shard key names; reads that must wait for a rotation in flight
            self.state = _States(self, self.state)
        self._migrate()

    def _migrate(self) -> None:
        """Put every existing root / eigenbasis where the plan says: self.state or residency."""
        self._settle_rotations()
        if self._tiered is None:
            return
        params = {i: p for p, i in self._pindex.items()}
        for p, st in list(self._param_states()):
            pidx = self._pindex.get(p)
            for name in [n for n in dict.keys(st) if isinstance(dict.__getitem__(st, n),
                                                                 torch.Tensor)]:
                if self._tiered.owns((pidx, name)):
                    self._tiered.write((pidx, name), dict.pop(st, name))
        for key in self._tiered.keys():
            if not self._tiered.owns(key):
                p = params[key[0]]
                value = self._tiered.materialize([key])[key]
                self._tiered.drop(key)
                dict.__setitem__(self.state[p], key[1], value)
        self._tiered.end_step()

    def _describe_key(self, key) -> str:
        pidx, name = key
        kind = {"roots": "root", "eigenbases": "eigenbasis"}.get(self._kinds.get(key), "state")
        return f"{kind} block {name!r} of {self._describe_param(pidx)}"

    def _trace_event(self, kind: str, lane: Any, name: Optional[str] = None, **args) -> None:
        tr = getattr(self._engine, "trace", None)
        if tr is not None:
            tr(kind, lane, name, **args)

    # ---- asteria.attach hooks ------------------------------------------------------------------
    def _asteria_name_params(self, names: dict) -> None:
        """Parameter names (from the model) for messages."""
        for p, name in names.items():
            if p in self._pindex:
                self._pnames[self._pindex[p]] = name

    def _asteria_drain(self) -> int:
        """Collect finished REFRESH jobs (never blocks). Returns how many were collected."""
        if self._closed:
            return 0
        drain = getattr(self._engine, "drain", None)
        return drain() if drain is not None else 0

    def _asteria_keys(self, params: Iterable) -> list:
        if self._tiered is None:
            return []
        return [k for p in params if p in self._pindex
                for k in self._tkeys.get(self._pindex[p], ()) if self._tiered.has(k)]

    def _asteria_prefetch(self, params: Iterable, reason: str = "") -> int:
        """Stage the roots / eigenbases of params into the ring (as far as it has room)."""
        if self._closed or self._tiered is None:
            return 0
        return self._tiered.prefetch(self._asteria_keys(params), reason=reason)

    def _asteria_fetch_early(self, params: Iterable) -> None:
        """Read params' NVMe-resident blocks back into host memory (never raises)."""
        if not self._closed and self._tiered is not None:
            self._tiered.fetch_early(self._asteria_keys(params))

    def asteria_plan(self) -> list[str]:
        """The planner's decisions, in plain words."""
        return list(self._plan.decisions) if self._plan is not None else []

    def _key(self, p: torch.Tensor, name: str) -> tuple:
        return (self._pindex[p], name)

    def _owned(self, p: torch.Tensor, name: str) -> bool:
        return self._tiered is not None and self._tiered.owns((self._pindex[p], name))

    def _root_has(self, p: torch.Tensor, name: str) -> bool:
        if self._owned(p, name):
            return self._tiered.has(self._key(p, name))
        return name in self.state[p]

    def _root_set(self, p: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Set a root / eigenbasis (creating it on first set)."""
        if self._owned(p, name):
            self._tiered.write(self._key(p, name), value)
            return
        st = self.state[p]
        if name in st:
            st[name].copy_(value)
        else:
            st[name] = value.to(device=local(p).device, copy=True)

    def _root_for_job(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """A root / eigenbasis as a REFRESH job input (the engine copies it at submit)."""
        if self._owned(p, name):
            return self._tiered.read_host(self._key(p, name))
        return self.state[p][name]

    def _member_keys(self, p: torch.Tensor, j: int) -> list:
        prefix = f"b{j}."
        return [k for k in self._tkeys.get(self._pindex[p], ()) if k[1].startswith(prefix)]

    def _chunks(self, members: list) -> list:
        """Split a stack's members so that each chunk's staged blocks fit the ring."""
        if self._tiered is None or not members:
            return [members]
        cap = self._plan.ring_bytes
        if cap >= 2 * self._plan.ring_min:
            cap //= 2  # two chunks fit: the next one is copied in while this one is used
        chunks, cur, used = [], [], 0
        for m in members:
            cost = self._tiered.chunk_cost(self._member_keys(*m))
            if cur and used + cost > cap:
                chunks.append(cur)
                cur, used = [], 0
            cur.append(m)
            used += cost
        chunks.append(cur)
        return chunks

    # ---- torch.optim plumbing -----------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch rejects sets itself
            params = list(params)
        param_group = dict(param_group, params=params)
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor) and p.is_complex():
                raise ValueError(
                    f"parameter {i} of param group {len(self.param_groups)} is complex "
                    f"({p.dtype}, shape {tuple(p.shape)}): Asteria optimizers take real "
                    f"parameters only. Optimise its real view instead: keep "
                    f"torch.view_as_real(p) as the parameter (a real tensor with a last "
                    f"dimension of 2) and build the complex value from it in forward with "
                    f"torch.view_as_complex")
        merged = dict(self.defaults)
        merged.update({k: v for k, v in param_group.items() if k != "params"})
        self._check_hyperparameters(merged)
        if self._async:
            self._cfg.check_frequency(merged["precondition_frequency"])
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._pindex.setdefault(p, len(self._pindex))
            self._gindex[p] = len(self.param_groups) - 1
            tag = shard_tag(p)
            if tag is not None:
                self._tags[p] = tag
        if getattr(self, "_plan", None) is not None:  # a group added after construction
            self._replan()
            if isinstance(self._engine, _dist.DistributedEngine):
                _dist.wrap_engine(self._engine, self.param_groups[-1]["params"])

    def _param_states(self):
        """(parameter, its state) of ``self.state``, leaving out entries that are not a
        parameter's state (torch.optim allows them; state-dict hooks store such values)."""
        return [(p, st) for p, st in self.state.items() if isinstance(p, torch.Tensor)]

    def _all_params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    def _replicas(self, p: torch.Tensor) -> Optional[tuple]:
        """The ranks holding a replica of p's blocks when the engine synchronises them."""
        if not isinstance(self._engine, _dist.DistributedEngine):
            return None
        cache = self.__dict__.setdefault("_replica_cache", {})
        pidx = self._pindex[p]
        if pidx not in cache:
            cache[pidx] = _dist.replicas(p)
        return cache[pidx]

    def _group_of(self, p: torch.Tensor) -> dict:
        return self.param_groups[self._gindex[p]]

    def _has_factor(self, block_shape: Sequence[int], group: dict) -> list[bool]:
        """Which dimensions of a block get a factor (the others are identity)."""
        limit = self._max_dim(group)
        return [d <= limit for d in block_shape]

    def _layout(self, p: torch.Tensor, group: dict) -> Layout:
        lay = self._layouts.get(p)
        if lay is None:
            lay = make_layout(local(p).shape, group["block_size"], self._merge_dims(group),
                              self._max_dim(group))
            self._layouts[p] = lay
        return lay

    def _stack(self, members: list, name: str, out: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """The members' ``b{j}.{name}`` stacked (a copy), into ``out`` when given."""
        if self._tiered is not None:
            keys = [(self._pindex[p], f"b{j}.{name}") for p, j in members]
            owned = [self._tiered.owns(k) for k in keys]
            if any(owned):
                mine = [k for k, o in zip(keys, owned) if o]
                staged = iter(self._tiered.borrow(mine))
                try:
                    return torch.stack([next(staged) if o else self.state[p][f"b{j}.{name}"]
                                        for (p, j), o in zip(members, owned)], out=out)
                finally:
                    self._tiered.give_back(mine)
        return torch.stack([self.state[p][f"b{j}.{name}"] for p, j in members], out=out)

    def _stack_dims(self, members: list, name: str, has: Sequence[bool]) -> list:
        return [self._stack(members, f"{name}{i}") if h else None for i, h in enumerate(has)]

    def _unstack(self, members: list, name: str, x: torch.Tensor) -> None:
        for (p, j), xi in zip(members, x.unbind(0)):
            if self._owned(p, f"b{j}.{name}"):
                self._tiered.write(self._key(p, f"b{j}.{name}"), xi)
            else:
                self.state[p][f"b{j}.{name}"].copy_(xi)

    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise RuntimeError("step() on a closed Asteria optimizer")
        self._settle_step_end()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work, skipped = [], 0
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            finite = self._finite(params)
            skipped += len(params) - sum(finite)
            work.append((group, [p for p, ok in zip(params, finite) if ok]))
        if self._tiered is not None:
            self._prepare(work)  # may raise: nothing has been changed yet
        try:
            self._t += 1
            for _ in range(skipped):
                self._counters["nonfinite_skipped"] += 1
                self._engine.note_nonfinite()
            due: list = []
            for group, params in work:
                adam = [p.numel() == 0 or self._is_adamw(p, group) for p in params]
                self._adamw(group, [p for p, a in zip(params, adam) if a])
                pre = [p for p, a in zip(params, adam) if not a]
                if pre:
                    due.extend(self._precond_step(group, pre))
            self._step_end(due)
        finally:
            if self._tiered is not None:
                self._tiered.end_step()
        return loss

    def _prepare(self, work: list) -> None:
        """Phase A of a step with a residency: NVMe blocks read back (verified) and written out
        again, host blocks prefetched into the ring in the order the step uses them."""
        order: list = []
        seen: set = set()
        for group, params in work:
            for p in params:
                if self.state[p]:
                    pidx = self._pindex[p]
                    if pidx not in seen:
                        seen.add(pidx)
                        order.append(pidx)
        nstep = len(order)
        for rnd in self._rounds:
            ps = [t[0] for job in rnd.jobs for t in job.targets] + list(rnd.outputs or ())
            for p in ps:
                pidx = self._pindex[p]
                if pidx not in seen:
                    seen.add(pidx)
                    order.append(pidx)
        keys = [k for pidx in order for k in self._tkeys.get(pidx, ())]
        self._tiered.prepare(keys)
        # the step consumes the last parameters first (see _precond_step)
        self._tiered.prefetch([k for pidx in reversed(order[:nstep])
                               for k in self._tkeys.get(pidx, ())], reason="step")

    def _finite(self, params: list) -> list:
        by_device: dict = defaultdict(list)
        for i, p in enumerate(params):
            if p.grad.is_sparse:
                raise RuntimeError("Asteria optimizers do not support sparse gradients")
            by_device[local(p.grad).device].append(i)
        finite = [True] * len(params)
        for idx in by_device.values():
            flags = torch.stack([torch.isfinite(local(params[i].grad)).all()
                                 for i in idx]).tolist()
            for i, ok in zip(idx, flags):
                finite[i] = ok
        return finite

    def _adamw(self, group: dict, params: list) -> None:
        if not params:
            return
        fake = self._all_zero({p: [self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]]
                               for p in params if self.state[p]
                               and _count(self.state[p]["step"]) == 1})
        for p in params:
            st = self.state[p]
            if p in fake:  # what DCP's fake step left (step 1, zero moments): start afresh
                st["step"] = 0
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(local(p), memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(local(p),
                                                    memory_format=torch.preserve_format)
            st["step"] += 1
        beta1, beta2, eps = self._adamw_hparams(group)
        data = [local(p) for p in params]
        F.adamw_step(data, [local(p.grad).to(p.dtype) for p in params],
                     [self.state[p]["exp_avg"] for p in params],
                     [self.state[p]["exp_avg_sq"] for p in params],
                     [self.state[p]["step"] for p in params],
                     lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=group["weight_decay"])

    def _precond_step(self, group: dict, params: list) -> list:
        """Run the kernels over stacks of same-shape blocks; return the factors now due."""
        stacks: dict = defaultdict(list)
        fake = self._fake_states([p for p in params if self.state[p]])
        # last parameters first: backward produced their gradients (and the backward-pre hooks
        # staged their roots) first, so the step consumes the ring in the order it was filled
        for p in reversed(params):
            st = self.state[p]
            lay = self._layout(p, group)
            phase = "step"
            if not st:
                self._create_state(p, group, lay)
                self._fixed_state(p, group, lay)
                if self._init_step:
                    phase = INIT
            elif p in fake:  # what DCP's fake step left: this step is the first one again
                st["step"] = 0
                if self._init_step:
                    phase = INIT
            if phase == "step":
                st["step"] += 1
            for j, bshape in enumerate(lay.block_shapes):
                key = (phase, bshape, p.dtype, local(p).device, self._batch_tag(p, j))
                stacks[key].append((p, j))
        due: list = []
        freq = group["precondition_frequency"]
        grads = {p: self._layouts[p].blocks(local(p.grad)) for p in params}
        weights = {p: self._layouts[p].blocks(local(p)) for p in params}
        work = []
        for (phase, bshape, dtype, _, _), all_members in stacks.items():
            if phase == INIT:
                members = all_members
                g = torch.stack([grads[p][j] for p, j in members]).to(dtype)
                fresh = self._init_blocks(group, members, g)
                due.extend((INIT, p, j, dims) for p, j, dims in fresh)
                continue
            # one chunk without a residency
            work.extend((bshape, dtype, m) for m in self._chunks(all_members))
        for i, (bshape, dtype, members) in enumerate(work):
            if self._tiered is not None and i + 1 < len(work):
                # this chunk, then the next one, so its copy overlaps this one's compute (as
                # far as the ring has room)
                self._tiered.prefetch([k for c in (members, work[i + 1][2]) for m in c
                                       for k in self._member_keys(*m)], reason="step")
            g = torch.stack([grads[p][j] for p, j in members]).to(dtype)
            w = torch.stack([weights[p][j] for p, j in members])
            steps = [self.state[p]["step"] for p, _ in members]
            self._step_blocks(group, members, w, g, steps)
            for (p, j), wi in zip(members, w.unbind(0)):
                self._layouts[p].write(local(p), j, wi)
            dims = [i for i, h in enumerate(self._has_factor(bshape, group)) if h]
            if dims:
                due.extend((REFRESH, p, j, dims) for (p, j), k in zip(members, steps)
                           if k % freq == 0)
        # jobs are batched in parameter order, whatever order the step ran in
        due.sort(key=lambda d: (self._pindex[d[1]], d[2]))
        # a step that leaves what DCP's fake step leaves submits nothing (Shampoo, f = 1): the
        # next step starts that parameter afresh anyway
        idle = self._fake_states(list({d[1]: None for d in due if d[0] == REFRESH}))
        return [d for d in due if d[1] not in idle] if idle else due

    def _fake_states(self, params: list) -> set:
        """The parameters among params whose state is exactly what DCP's fake step leaves:
        the step count of one step (SOAP / KL-Shampoo: 0, their first step initialises the
        bases; Shampoo: 1) with the ``_fake_step_tensors`` all zero. One device sync."""
        count = 0 if self._init_step else 1
        cand = {}
        for p in params:
            st = self.state[p]
            if "step" in st and _count(st["step"]) == count:
                ts = self._fake_step_tensors(p)
                if ts:
                    cand[p] = ts
        return self._all_zero(cand)

    @staticmethod
    def _all_zero(cand: dict) -> set:
        """{p: [tensors]} -> the set of p whose tensors are all zero (one sync per device)."""
        by_device: dict = defaultdict(list)
        for p, ts in cand.items():
            nonzero = torch.stack([t.ne(0).any() for t in ts]).any()
            by_device[nonzero.device].append((p, nonzero))
        out = set()
        for items in by_device.values():
            flags = torch.stack([f for _, f in items]).tolist()
            out.update(p for (p, _), nz in zip(items, flags) if not nz)
        return out

    # ---- the scheduler ------------------------------------------------------------------------
    def _step_end(self, due: list) -> None:
        step_end = getattr(self._engine, "step_end", None)
        if step_end is not None:  # DistributedEngine: hand finished owner results to the sync
            step_end(self._t)
        # what is left of this step end, should a wait in it be interrupted (Ctrl-C at the
        # bounded barrier): the next step(), state_dict() or close() finishes it first, so a
        # caught KeyboardInterrupt leaves the run on the trajectory of an uninterrupted one
        self._unfinished_end = list(due)
        self._finish_step_end()

    def _finish_step_end(self) -> None:
        t = self._t
        for rnd in list(self._rounds):
            if rnd.install_step <= t or (self._eager and rnd.ready(self._engine)):
                self._install_round(rnd)
        for kind in (INIT, REFRESH):
            items = [d for d in self._unfinished_end if d[0] == kind]
            if not items:
                continue
            rnd = self._submit(kind, items, t if kind == INIT else t + self._delay)
            self._rounds.append(rnd)
            self._unfinished_end = [d for d in self._unfinished_end if d[0] != kind]
            if rnd.install_step == t or (self._eager and rnd.ready(self._engine)):
                self._install_round(rnd)
        self._unfinished_end = None
        self._raise_failures()

    def _settle_step_end(self) -> None:
        """Finish a step end that a signal interrupted (see ``_step_end``)."""
        if getattr(self, "_unfinished_end", None) is not None:
            self._finish_step_end()

    def _submit(self, kind: str, items: list, install_step: int) -> _Round:
        groups: dict = defaultdict(list)
        for _, p, j, dims in items:
            for dim in dims:
                op, f, q, pw, eps = self._refresh_input(kind, p, j, dim)
                key = (op, f.shape[-1], f.dtype, f.device, pw, eps, self._replicas(p))
                groups[key].append((p, j, dim, f, q))
        jobs = []
        # libasteria's pool takes the factors as parts: its shadow snapshots them straight into
        # one ring slot, with no stack in fresh memory first (whose page faults were half of a
        # refresh step's extra time on the host)
        local = self._local_c_engine()
        for (op, _, _, _, pw, eps, replicas), entries in groups.items():
            fs = [e[3] for e in entries]
            f = fs if local else torch.stack(fs)
            q = None
            if entries[0][4] is not None:
                qs = [e[4] for e in entries]
                if len({x.device for x in qs}) > 1:  # some in host memory, some on the device
                    qs = [x.cpu() for x in qs]
                q = torch.stack(qs)
                del qs
            targets = [(p, j, dim) for p, j, dim, _, _ in entries]
            key = (kind, op, tuple((self._pindex[p], j, dim) for p, j, dim in targets))
            block = self._block_keys.setdefault(key, len(self._block_keys) + 1)
            version = self._versions[block] = self._versions.get(block, 0) + 1
            extra = {} if replicas is None else {"replicas": replicas}
            if q is not None and local:
                # the basis stack was made here for the job: the worker reads it in place
                extra["donate"] = ("q",)
            if self._tiered is not None and all(
                    self._owned(p, self._output_name(p, j, dim)) for p, j, dim in targets):
                extra["host_outputs"] = True  # the results go to host memory: no round trip
            ticket = self._engine.submit(op, f, q, block=block, version=version,
                                         deadline=install_step, snapshot_step=self._t,
                                         p=pw, eps=eps, **extra)
            self._counters["refreshes_submitted"] += 1
            jobs.append(_Job(ticket, targets))
        return _Round(kind, self._t, install_step, jobs)

    def _output_name(self, p: torch.Tensor, j: int, dim: int) -> str:
        """The state name a REFRESH output 0 of (block j, dim) is installed into."""
        return f"b{j}.Q{dim}"

    def _install_round(self, rnd: _Round) -> None:
        outputs = rnd.resolve(self._engine)
        self._install(rnd.kind, outputs)
        self._counters["refresh_failures"] += rnd.failed
        self._count_failures(rnd)
        lag = self._t - rnd.snapshot_step
        # one install per job; a round restored from a checkpoint has one per parameter
        for _ in range(len(rnd.jobs) if rnd.jobs else len(outputs)):
            self._engine.note_install(rnd.snapshot_step, self._t)
            self._counters["installs"] += 1
        self._counters["max_install_lag"] = max(self._counters["max_install_lag"], lag)
        if rnd in self._rounds:
            self._rounds.remove(rnd)

    def _count_failures(self, rnd: _Round) -> None:
        """Consecutive failed refreshes per (parameter, block, dimension), the same count in
        every mode. At ``max_failures`` in a row the failure is recorded for
        ``_raise_failures`` (``on_failure="raise"``) or warned about once (``"keep"``)."""
        failed = {}
        for targets, error in rnd.failures:
            for p, j, dim in targets:
                failed[(self._pindex[p], j, dim)] = error
        for p, outs in rnd.outputs.items():
            for (j, dim), out in outs.items():
                key = (self._pindex[p], j, dim)
                if key not in failed:
                    self._fail_streak.pop(key, None)
        limit = self._cfg.max_failures
        params = {i: p for p, i in self._pindex.items()}
        for key, error in failed.items():
            n = self._fail_streak[key] = self._fail_streak.get(key, 0) + 1
            if n != limit:
                continue
            factor = self._refresh_input(REFRESH, params[key[0]], key[1], key[2])[1]
            if not bool(torch.isfinite(factor).all()):
                error = "its Kronecker factor is not finite: it overflowed; last error: " + error
            what = (f"the REFRESH of {self._describe_param(key[0])}, block {key[1]}, "
                    f"dimension {key[2]} failed {n} times in a row ({error})")
            if self._cfg.on_failure == "raise":
                self._failed.append(what)
            else:
                warnings.warn(f"Asteria: {what}; the previous preconditioner is kept "
                              f"(runtime on_failure='keep')", RuntimeWarning, stacklevel=5)

    def _count_lazy(self, name: str, n: torch.Tensor) -> None:
        """Add a count that lives on the device (no sync in the step); read by
        ``asteria_stats()``."""
        prev = self._lazy_counts.get(name)
        self._lazy_counts[name] = n if prev is None else prev + n.to(prev.device)

    def _raise_failures(self) -> None:
        if not self._failed:
            return
        whats, self._failed = self._failed, []
        raise RuntimeError(
            "Asteria: " + "; ".join(whats) + ". This step is complete and the state is "
            "consistent; runtime {'on_failure': 'keep'} keeps training with the previous "
            "preconditioner instead of raising")

    def _describe_param(self, pidx: int) -> str:
        name = self._pnames.get(pidx)
        return f"parameter {pidx}" + (f" ({name})" if name else "")

    # ---- SOAP's m re-expression on the workers ----------------------------------------------------
    def _offloads_rotation(self) -> bool:
        """Does this optimizer hand SOAP's m re-expression at install to the workers? Only
        SOAP has one; only the C engine's workers (``mode="async"``), rank-local (a replicated
        block's m is re-expressed by every replica itself, on its own thread)."""
        return self._rotates_m and self._local_c_engine()

    def _local_c_engine(self) -> bool:
        """Is the engine libasteria's worker pool itself (not a distributed wrapper)? Its jobs
        may then be given inputs made for them (``CEngine.submit(donate=)``)."""
        from asteria.engine_c import CEngine

        return self._async and isinstance(self._engine, CEngine)

    def _rotation_offload(self, members: list, ndim: int) -> bool:
        """Offload the re-expression of these members' m: CPU parameters (on a GPU it is two
        device matmuls per side, cheaper than the round trip) with blocks of at most 2 dims
        (the op's layout)."""
        return (self._offloads_rotation() and ndim <= 2
                and all(local(p).device.type == "cpu" for p, _ in members))

    def _submit_rotation(self, members: list, m: torch.Tensor, pairs: list) -> None:
        """Start m_new = Q_new^T (Q_old m Q_old^T) Q_new (per side) on a worker; m stays as it
        is until a read of it waits for the result (``_settle_rotation``). ``m`` (a stack made
        for this) and ``pairs`` ((B, 2, n, n): old, new basis per block; None: identity side)
        are given to the job: the worker reads them in place, nothing here writes them."""
        x = m.reshape(m.shape[0], m.shape[1], -1)
        pairs = list(pairs) + [None] * (2 - len(pairs))
        key = ("soap_rotate", tuple((self._pindex[p], j) for p, j in members))
        block = self._block_keys.setdefault(key, len(self._block_keys) + 1)
        version = self._versions[block] = self._versions.get(block, 0) + 1
        ticket = self._engine.submit("soap_rotate", x, pairs[0], b=pairs[1], block=block,
                                     version=version, deadline=self._t + 1,
                                     snapshot_step=self._t, host_outputs=True,
                                     donate=("f", "q", "b"))
        self._counters["rotations_submitted"] += 1
        rot = _Rotation(ticket, list(members), (x, pairs[0], pairs[1]), tuple(m.shape[1:]))
        for p, j in members:
            self._rotations[(p, f"b{j}.exp_avg")] = rot

    def _settle_rotation(self, p, name) -> None:
        rot = self._rotations.get((p, name))
        if rot is not None:
            self._finish_rotation(rot)

    def _settle_rotations(self) -> None:
        for rot in list({id(r): r for r in self._rotations.values()}.values()):
            self._finish_rotation(rot)

    def _finish_rotation(self, rot: "_Rotation") -> None:
        """Wait for a rotation job and write its result into m; a failed job is redone here
        with torch (the result is the same math; the state must not keep the old basis' m)."""
        res = self._engine.wait(rot.ticket)  # an interrupted wait leaves the rotation pending
        for p, j in rot.members:
            self._rotations.pop((p, f"b{j}.exp_avg"), None)
        if res.status == 0:
            out = res.outputs[0]
        else:
            self._counters["rotation_failures"] += 1
            warnings.warn(f"Asteria: re-expressing SOAP's first moment on a worker failed "
                          f"({res.error}); done on the training thread instead",
                          RuntimeWarning, stacklevel=3)
            from asteria.engine_torch import soap_rotate

            out = soap_rotate(*rot.inputs)[0]
        for i, (p, j) in enumerate(rot.members):
            dst = dict.__getitem__(self.state[p], f"b{j}.exp_avg")
            dst.copy_(out[i].reshape(rot.shape))

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim's state dict, with the same keys as the live state (the fixed key set):
        a refresh in flight is waited for and stored, not installed, in its
        ``b{j}.pending{dim}.{i}`` tensors (flag ``b{j}.pending{dim}_ok`` = 1) with
        ``pending.install_in`` / ``pending.age``; without one they are zeros, flags 0 and
        ``pending.install_in`` = -1.

        The state of a DTensor parameter sharded over several ranks (FSDP2) is its local
        shard's, under keys tagged with the shard (``b0.exp_avg@shard1of2``, ``step@...``, as
        the live state shows them): torch.distributed.checkpoint keeps one copy of a plain
        value saved under one name by several ranks, so untagged keys would lose all ranks'
        state but one. Resuming needs the same mesh and sharding (``load_state_dict`` raises
        ValueError on another shard's keys)."""
        self._settle_step_end()
        self._settle_rotations()
        for rnd in self._rounds:
            rnd.resolve(self._engine)
        # torch's post hooks must see the state dict as returned: they run after ours is built
        with _hooks_off(self, "_optimizer_state_dict_post_hooks") as post_hooks:
            sd = super().state_dict()
        index = {}
        for p in itertools.chain.from_iterable(g["params"] for g in self.param_groups):
            index.setdefault(p, len(index))
        ids = set(index.values())
        # the optimizer's names, copies; entries that are not a parameter's state stay as torch
        # stores them
        sd["state"] = {i: ((st.raw() if isinstance(st, _ParamState) else dict(st))
                           if i in ids and isinstance(st, dict) else st)
                       for i, st in sd["state"].items()}
        if self._tiered is not None:  # roots / eigenbases as the all-device path stores them
            params = {i: p for p, i in self._pindex.items()}
            values = self._tiered.materialize(self._tiered.keys())
            for (pidx, name), value in values.items():
                sd["state"][index[params[pidx]]][name] = value
        for i, st in list(sd["state"].items()):
            if i in ids and isinstance(st, dict) and _PENDING_IN in st:
                # real zeros for the placeholders (a checkpoint writes them)
                st = sd["state"][i] = dict(st)
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and _PENDING_OUT_RE.fullmatch(k):
                        st[k] = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        for rnd in self._rounds:
            for p, outs in rnd.outputs.items():
                st = dict(sd["state"][index[p]])
                st[_PENDING_IN] = rnd.install_step - self._t
                st[_PENDING_AGE] = self._t - rnd.snapshot_step
                for (j, dim), out in outs.items():
                    if out is None:  # the job failed: nothing to install
                        continue
                    for i, tensor in enumerate(out):
                        st[f"b{j}{_PENDING}{dim}.{i}"] = tensor
                    st[f"b{j}{_PENDING}{dim}{_PENDING_OK}"] = 1
                sd["state"][index[p]] = st
        for p, tag in self._tags.items():  # per-shard state: the shard's own key names
            st = sd["state"].get(index.get(p))
            if st is not None:
                sd["state"][index[p]] = {f"{k}{_TAG_SEP}{tag}": v for k, v in st.items()}
        for hook in post_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def _untag(self, state_dict: dict) -> dict:
        """A loaded state dict under the optimizer's key names: a sharded parameter's own tag
        stripped; another shard's tag (another mesh or rank) is a ValueError."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        state = dict(state_dict["state"])
        for i, p in zip(saved_ids, params):
            st = state.get(i)
            if not st:
                continue
            tag = self._tags.get(p)
            out = {}
            for k, v in st.items():
                m = _TAG_RE.search(k) if isinstance(k, str) else None
                if m is not None and m.end() == len(k):
                    if m.group(0) != _TAG_SEP + str(tag):
                        here = f"shard {tag}" if tag else "an unsharded parameter"
                        raise ValueError(
                            f"optimizer state key {k!r} of parameter {self._pindex[p]} belongs "
                            f"to shard {m.group(0)[1:]}, this rank has {here}: a sharded "
                            f"checkpoint resumes on the same mesh and sharding only")
                    k = k[:m.start()]
                out[k] = v
            state[i] = out
        return dict(state_dict, state=state)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's load, checked first: a state dict that does not fit this optimizer
        (another optimizer's, or saved for parameters of other shapes) raises ValueError naming
        the parameter, the key and what was expected, and the optimizer is left unchanged.
        Every state tensor is stored in the dtype this optimizer keeps it in (KL-Shampoo's
        compute dtype, the int64 permutations; torch would cast it to the parameter's dtype),
        as a copy. Entries of ``state`` that are not a parameter's state are kept as torch
        keeps them. The load hooks run as torch runs them: pre hooks first, post hooks on the
        loaded optimizer."""
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        state_dict = self._untag(state_dict)
        loaded, others = self._loaded_states(state_dict)
        # checked: from here on the optimizer changes
        self._unfinished_end = None
        self._settle_rotations()
        for rnd in self._rounds:
            rnd.drop(self._engine)
        self._rounds = []
        self._fail_streak, self._failed = {}, []
        with _hooks_off(self, "_optimizer_load_state_dict_pre_hooks"), \
                _hooks_off(self, "_optimizer_load_state_dict_post_hooks") as post_hooks:
            super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for p, st in loaded.items():
            self.state[p] = st
        for k, v in others.items():
            self.state[k] = v
        if self._tiered is not None:
            self._tiered.clear()
            self.state = _States(self, self.state)
        elif self._tags or self._offloads_rotation():
            self.state = _States(self, self.state)
        rounds: dict = {}
        for p in loaded:
            st = self.state[p]
            if self._tiered is not None:
                for name in [n for n in dict.keys(st) if self._owned(p, n)]:
                    self._tiered.write(self._key(p, name), dict.pop(st, name))
            group = self._group_of(p)
            if p.numel() == 0 or self._is_adamw(p, group):
                continue
            install_in = _count(st.pop(_PENDING_IN, NO_ROUND))
            age = _count(st.pop(_PENDING_AGE, 0))
            outs: dict = defaultdict(dict)
            oks: dict = {}
            for k in [k for k in dict.keys(st) if _PENDING in k]:
                m = _PENDING_OUT_RE.fullmatch(k)
                if m:
                    outs[(int(m.group(1)), int(m.group(2)))][int(m.group(3))] = st.pop(k)
                    continue
                m = _PENDING_OK_RE.fullmatch(k)
                if m:
                    oks[(int(m.group(1)), int(m.group(2)))] = _count(st.pop(k))
            if install_in != NO_ROUND:
                rnd = rounds.get((install_in, age))
                if rnd is None:
                    rnd = rounds[(install_in, age)] = _Round(
                        REFRESH, self._t - age, self._t + install_in, [], outputs={})
                # without a flag (a state dict from before the fixed key set): present = a result
                rnd.outputs[p] = {key: tuple(v[n] for n in sorted(v))
                                  for key, v in outs.items() if oks.get(key, 1)}
            self._fixed_state(p, group, self._layout(p, group))
        self._rounds = list(rounds.values())
        if self._tiered is not None:
            self._tiered.end_step()  # NVMe-homed blocks go back to NVMe (best effort)
        for hook in post_hooks.values():
            hook(self)

    def _loaded_states(self, state_dict: dict) -> tuple[dict, dict]:
        """Check a state dict against this optimizer without changing anything. Returns
        ({param: its state as it will be stored}, {key: value} of the entries that are not a
        parameter's state)."""
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, (list, tuple)) or not isinstance(state, Mapping):
            raise ValueError("load_state_dict: a state dict has 'state' (a dict) and "
                             "'param_groups' (a list), as optimizer.state_dict() returns")
        name = type(self).__name__
        if len(groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: the state dict has {len(groups)} param groups, "
                             f"this {name} has {len(self.param_groups)}")
        loaded: dict = {}
        seen: set = set()
        for gi, (saved, live) in enumerate(zip(groups, self.param_groups)):
            ids = list(saved.get("params", ()))
            if len(ids) != len(live["params"]):
                raise ValueError(f"load_state_dict: param group {gi} of the state dict has "
                                 f"{len(ids)} parameters, this {name}'s has "
                                 f"{len(live['params'])}")
            missing = [k for k in self.defaults if k not in saved]
            if missing:
                raise ValueError(f"load_state_dict: param group {gi} of the state dict lacks "
                                 f"{name}'s hyperparameter(s) {missing}: it was saved by another "
                                 f"optimizer (its keys: {sorted(k for k in saved if k != 'params')})")
            group = {k: v for k, v in saved.items() if k != "params"}
            self._check_hyperparameters(group)
            if self._async:
                self._cfg.check_frequency(group["precondition_frequency"])
            for i, p in zip(ids, live["params"]):
                seen.add(i)
                st = state.get(i)
                if st:
                    loaded[p] = self._loaded_state(p, group, live, st)
        others = {k: v for k, v in state.items() if k not in seen}
        return loaded, others

    def _loaded_state(self, p: torch.Tensor, group: dict, live: dict, st: Any) -> dict:
        """One parameter's saved state, checked against what this optimizer keeps for it
        (keys, shapes, kinds) and converted: tensors copied to the parameter's device in the
        dtype this optimizer keeps them in."""
        who = self._describe_param(self._pindex[p])
        lp = local(p)

        def bad(msg):
            return ValueError(f"load_state_dict: the state of {who} {tuple(lp.shape)} does not "
                              f"fit this {type(self).__name__}: {msg}")

        if not isinstance(st, Mapping):
            raise bad(f"expected a dict of state, found {type(st).__name__}")
        tensors: dict = {}   # key -> (shape, dtype) it must have
        flags: set = {"step"}
        if lp.numel() == 0 or self._is_adamw(p, group):
            tensors = {n: (tuple(lp.shape), lp.dtype) for n in ("exp_avg", "exp_avg_sq")}
            required = set(tensors) | {"step"}
        else:
            layout = make_layout(lp.shape, group["block_size"], self._merge_dims(group),
                                 self._max_dim(group))
            here = self._layout(p, live)
            if layout.block_shapes != here.block_shapes:
                raise bad(f"it was saved with blocks {layout.block_shapes}, this optimizer "
                          f"cuts {here.block_shapes}")
            spec = self._state_spec(p, group, layout)
            tensors = {n: (tuple(shape), dt) for n, _, shape, dt in spec}
            # Shampoo's roots may be absent (a state dict from before the fixed key set)
            required = {n for n, kind, _, _ in spec if kind != "roots"} | {"step"}
            flags |= {_PENDING_IN, _PENDING_AGE} | set(self._flag_keys(p, group, layout))
            for j, bshape in enumerate(layout.block_shapes):
                for dim, has in enumerate(self._has_factor(bshape, group)):
                    if has:
                        flags.add(f"b{j}{_PENDING}{dim}{_PENDING_OK}")
                        for i, (oshape, dt) in enumerate(
                                self._output_specs(p, group, bshape[dim])):
                            tensors[f"b{j}{_PENDING}{dim}.{i}"] = (tuple(oshape), dt)
        missing = sorted(required - set(st))
        if missing:
            raise bad(f"key {missing[0]!r} is missing (keys found: {sorted(st)}); was it "
                      f"saved by another optimizer?")
        out = {}
        for k, v in st.items():
            if k in tensors:
                shape, dt = tensors[k]
                if not isinstance(v, torch.Tensor):
                    raise bad(f"key {k!r}: expected a tensor of shape {shape}, found "
                              f"{type(v).__name__}")
                if tuple(v.shape) != shape:
                    raise bad(f"key {k!r}: expected shape {shape}, found {tuple(v.shape)}")
                if v.is_floating_point() != dt.is_floating_point or v.is_complex():
                    raise bad(f"key {k!r}: expected {dt} values, found {v.dtype}")
                out[k] = v.detach().to(device=lp.device, dtype=dt, copy=True)
            elif k in flags:
                if isinstance(v, torch.Tensor):
                    if v.numel() != 1:
                        raise bad(f"key {k!r}: expected a number, found a tensor of shape "
                                  f"{tuple(v.shape)}")
                    v = v.detach().clone()
                elif not isinstance(v, (int, float)):
                    raise bad(f"key {k!r}: expected a number, found {type(v).__name__}")
                out[k] = v
            else:
                raise bad(f"unexpected key {k!r}; it keeps {sorted(required)} and the flags "
                          f"and results of a refresh in flight")
        return out

    # ---- runtime ------------------------------------------------------------------------------
    def asteria_stats(self) -> dict:
        """engine.stats() plus this optimizer's counters, optimizer-state bytes per tier (the
        staging ring counts as device bytes), copy bytes per direction and NVMe bandwidth."""
        stats = {k: 0 for k in STATS_KEYS}
        stats["nvme_read_MBps"] = stats["nvme_write_MBps"] = 0.0
        stats["bytes_device_ring"] = 0
        stats.update(self._engine.stats())
        stats.update(self._counters)
        stats["overflow_skipped"] = 0
        stats.update({k: int(v) for k, v in self._lazy_counts.items()})
        dev = 0
        plan = self._plan
        for p, st in self._param_states():
            pidx = self._pindex.get(p)
            for name, v in dict.items(st):
                if _PENDING in name:  # placeholders: views of one shared zero
                    continue
                if isinstance(v, torch.Tensor) and (plan is None or
                                                    plan.tier((pidx, name)) == "device"):
                    dev += v.numel() * v.element_size()
        stats["bytes_state_device"] = dev
        stats["bytes_h2d"] = stats.get("bytes_h2d_results", 0)
        stats["bytes_d2h"] = stats.get("bytes_d2h_snapshots", 0)
        ts = None
        if self._tiered is not None:
            ts = self._tiered.stats()
        elif getattr(self, "_tiered_final", None) is not None:
            ts = dict(self._tiered_final)
        if ts is not None:
            h2d, d2h = ts.pop("bytes_h2d"), ts.pop("bytes_d2h")
            stats.update(ts)
            stats["bytes_h2d"] += h2d
            stats["bytes_d2h"] += d2h
            dev += self._plan.ring_bytes
        stats["bytes_device"] = dev
        return stats

    def close(self) -> None:
        """Release the engine (workers, buffers; the trace file is written now) and the
        residency. Idempotent; the optimizer cannot step after."""
        self._close(detier=True)

    def _close(self, detier: bool) -> None:
        if getattr(self, "_closed", True):
            return
        if detier:
            self._settle_step_end()  # a step end a signal interrupted: its installs are state
        if detier and getattr(self, "_rotations", None):
            self._settle_rotations()
        self._closed = True
        if detier:
            self._detier()
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
            return
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()

    def _detier(self) -> None:
        """At close: the tiered roots / eigenbases become plain tensors of ``self.state`` on
        their parameters' devices, so the state stays inspectable (and checkpointable) after
        the residency is gone. A block that cannot be read back is left out, with a warning."""
        tiered = self._tiered
        if tiered is None:
            return
        params = {i: p for p, i in self._pindex.items()}
        values: dict = {}
        try:
            values = tiered.materialize(tiered.keys())
        except Exception as exc:
            warnings.warn(f"Asteria: close() could not read every tiered block back ({exc}); "
                          "they are left out of optimizer.state", RuntimeWarning, stacklevel=3)
            for key in tiered.keys():
                try:
                    values.update(tiered.materialize([key]))
                except Exception:
                    pass
        self._tiered_final = tiered.stats_final()
        self._tiered = None
        plain: defaultdict = defaultdict(dict)
        for p, st in self.state.items():
            plain[p] = st.raw() if isinstance(st, _ParamState) else st
        for (pidx, name), v in values.items():
            plain[params[pidx]][name] = v
        self.state = plain

    # ---- copies -------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """What ``copy.deepcopy`` and pickle keep: the param groups (their parameters, which a
        deepcopy copies along with the model when both are copied together), the runtime config
        and ``state_dict()`` (refreshes in flight waited for and kept, not installed). The copy
        is a working optimizer with its own runtime: it continues bitwise like the original
        would. The workers, buffers and tiered blocks are the original's and are not copied."""
        if getattr(self, "_closed", True):
            raise RuntimeError(f"cannot copy or pickle a closed {type(self).__name__}: copy it "
                               f"before close(), or build a new one and load_state_dict() "
                               f"its state_dict()")
        return {"param_groups": self.param_groups, "defaults": self.defaults,
                "runtime": self._cfg, "state_dict": self.state_dict(),
                "names": dict(self._pnames)}

    def __setstate__(self, state: dict) -> None:
        if "runtime" not in state:  # torch.optim's load_state_dict sets state this way
            super().__setstate__(state)
            return
        groups = [dict(g) for g in state["param_groups"]]
        AsteriaOptimizer.__init__(self, groups, state["defaults"], state["runtime"])
        self._pnames.update(state.get("names", {}))
        self.load_state_dict(state["state_dict"])

    def __del__(self) -> None:
        try:
            self._close(detier=False)  # a dying optimizer's state need not be kept
        except Exception:  # interpreter shutdown: the engine module may already be gone
            pass
