"""The ``runtime=`` dict of the Asteria optimizers, validated once at construction.

``RuntimeConfig.from_user`` accepts ``None``, a plain dict or a ``RuntimeConfig``. Each key has
one validator. The optimizer's keys (mode, staleness, install, placement, the budgets, nvme_dir,
max_failures, on_failure, fsdp_blocking, tier_dtype, factor_emas, refresh_device, the refresh
policy's refresh_policy, refresh_budget, install_delay, max_age, skip_threshold, and the
distributed keys ranks_per_node, coherence_timeout_s, coherence_topology) are checked here; no
setting is read from the environment. The keys libasteria reads
(``_C.config_keys()``: workers, cpuset, pin, trace) are handed over once, at
construction, to libasteria's validator (``ast_config_set``, via
``asteria._C.validate_config``), whose result (``c_config``, a ``_C.Config``) ``_C.Runtime``
takes as it is. Every rejection is a ValueError naming the key and the allowed values. See the
config table in README.md / DESIGN.md. A param group's ``precondition_frequency`` is checked
against these keys (S <= f; "auto" needs mode "async" and local blocking) with the value
itself, by the cadence's ``check_frequency`` (``asteria.optim.cadence``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional, Union

from asteria import _C

PLACEMENT_KINDS = ("factors", "roots", "eigenbases", "moments")


def _tiers() -> tuple:
    """libasteria's memory tiers (``_C.tiers()``, src/store.c's one list), in the order they are
    listed to users; refuses to import if they are not the tiers this package's tier code (the
    planner's rules, tiers/plan.py; the residency's staging, tiers/residency.py) is written for,
    so a tier added, renamed or dropped on one side only is found here (docs/architecture.md,
    "A tier")."""
    c_tiers = tuple(_C.tiers())
    python_tiers = {"device", "host_pinned", "host", "uvm", "nvme"}  # compared, never listed
    if set(c_tiers) != python_tiers or len(c_tiers) != len(python_tiers):
        raise ImportError(f"asteria.config and libasteria's tiers disagree: C has "
                          f"{list(c_tiers)}, the Python tier code is written for "
                          f"{sorted(python_tiers)}; a tier is added in both "
                          f"(docs/architecture.md, 'A tier')")
    return c_tiers


#: the memory tiers, libasteria's (``_C.tiers()``), in the order they are listed to users
TIERS = _tiers()
#: storage dtypes of the tiers outside the device ("float32": every block in its state's dtype;
#: "bfloat16": wider blocks narrowed; "int8" / "int4": eigenbases block-quantized, tiers/plan.py)
TIER_DTYPES = ("float32", "bfloat16", "int8", "int4")
#: the quantized tiers' format (asteria/quant.h): values per float32 scale, per type. Both are
#: 4-bit Shampoo's 64, libasteria's default (int8 0.266, int4 0.141 of float32's bytes). int4
#: at 128 (0.133) trained worse: 1.16-1.17x float32's steps to AdamW's loss against 1.06-1.07x
#: at 64, though its bases came back as near orthogonal after the 3 Bjorck steps (docs/results.md,
#: "Reduced-precision and quantized tiers"; benchmarks/bench_quant_orth.py)
TIER_QUANT_BLOCK = {"int8": _C.QUANT_BLOCK_DEFAULT, "int4": _C.QUANT_BLOCK_DEFAULT}
#: Bjorck steps that rectify a quantized eigenbasis where it is widened: the fewest that leave
#: ||V^T V - I||_F below the bfloat16 tier's (an unrectified bfloat16 basis, which trains as
#: float32 does: 0.02 at n = 64 to 0.11 at n = 2048) for the bases training makes. int8: 0.07
#: to 0.6 as stored, at most 0.013 after one step. int4: up to 5 (delocalized eigenvectors) or
#: 8 (partly localized ones, as trained factors have) as stored, up to 0.19 after two steps,
#: at most 3e-3 after three (docs/memory.md)
TIER_RECTIFY_STEPS = {"int8": 1, "int4": 3}
#: eigenbases smaller than n x n for this n stay in their dtype under int8 / int4: their bytes
#: are few, and rectifying them at every step would cost more time than they save memory
TIER_QUANT_MIN_DIM = 64
#: how replicated blocks reach every replica (docs/distributed.md, "Who sends what")
COHERENCE_TOPOLOGIES = ("hier", "flat")
#: which factors start a refresh at a step end (asteria.optim.cadence, docs/capacity.md)
REFRESH_POLICIES = ("round", "drift")


def _check_text(key: str, value: Any) -> None:
    """A path or cpuset string that can cross into C: no NUL byte, encodable to the file
    system's bytes and to UTF-8 (libasteria keeps its strings as UTF-8). The one place that
    says so, naming the key, for every string key (libasteria's validator never sees a value
    that cannot cross)."""
    try:
        # the C runtime keeps its strings as UTF-8
        raw = os.fsencode(value)
        text = os.fspath(value)
        if isinstance(text, str):
            text.encode("utf-8")
    except (UnicodeError, TypeError) as exc:
        raise ValueError(f"runtime key {key!r}: got {value!r}, which is not valid UTF-8 "
                         f"({exc}); allowed: a path string in UTF-8") from None
    if b"\0" in raw:
        raise ValueError(f"runtime key {key!r}: got {value!r}, which has an embedded NUL "
                         f"character; allowed: a path string without NUL")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    mode: str = "async"
    staleness: Union[int, str] = 5  # or "auto": the cadence picks S from measurements
    install: str = "deterministic"
    workers: Optional[int] = None
    placement: Union[str, Mapping[str, str]] = "auto"
    device_budget_bytes: Optional[int] = None
    host_budget_bytes: Optional[int] = None
    nvme_dir: Optional[str] = None
    trace: Optional[str] = None
    cpuset: Optional[str] = None
    pin: bool = True
    #: consecutive failed refreshes of one factor (parameter, block, dimension) at which the
    #: step raises or warns (on_failure); counted by the schedule (optim/schedule.py), the one
    #: count every executor reaches: libasteria keeps none (docs/departures.md); Python only
    max_failures: int = 3
    on_failure: str = "raise"
    #: FSDP2 parameters: blocks cut from each rank's shard ("local"), or from the full
    #: parameter with one owner rank per block ("global", docs/distributed.md); Python only
    fsdp_blocking: str = "local"
    #: the form roots / eigenbases are stored and moved in outside the device (host, pinned,
    #: UVM, NVMe): "bfloat16" narrows wider blocks once when written and widens them where
    #: used; "int8" / "int4" block-quantize eigenbases of at least TIER_QUANT_MIN_DIM rows
    #: (roots and smaller bases stay as they are), widened and rectified where used (tiers/
    #: plan.py, stored_format); "float32" keeps every block as it is; Python only
    tier_dtype: str = "float32"
    #: where SOAP's factor EMAs (L, R) of host parameters run in mode "async": "thread" (the
    #: training thread, in the step) or "workers" (libasteria's pool, in place, during the next
    #: forward and backward). "thread" by default: on a 2-core machine a worker's job slows the
    #: forward and backward it overlaps by more than it takes off the step
    #: (docs/departures.md); "workers" where the pool has cores of its own; Python only
    factor_emas: str = "thread"
    #: mode "async" with CUDA parameters: True divides each REFRESH round among the host
    #: workers and a device executor on the parameters' device; False among the host workers
    #: alone (how a run measures host-only against hybrid); Python only
    refresh_device: bool = True
    #: distributed runs: ranks per node, node = rank // N (a simulation on one machine, or a
    #: launch that cannot set GROUP_RANK); None: the launcher's GROUP_RANK, else
    #: rank // LOCAL_WORLD_SIZE, else one node (asteria.distributed.local_node_id); Python only
    ranks_per_node: Optional[int] = None
    #: distributed runs: the collective timeout of the coherence process groups in seconds;
    #: None: the default process group's timeout; Python only
    coherence_timeout_s: Optional[float] = None
    #: distributed runs: "hier" (replicated blocks move inside a node through host memory, then
    #: among node representatives) or "flat" (one broadcast among all replicas: the baseline);
    #: Python only
    coherence_topology: str = "hier"
    #: which factors start a refresh at a step end (asteria.optim.cadence): "round" (every
    #: factor that came due, installed together S steps later) or "drift" (the factors that came
    #: due, stalest first by a drift score, within ``refresh_budget``, each installed
    #: ``install_delay`` steps after its start; docs/capacity.md, "Refresh per factor"); Python
    #: only
    refresh_policy: str = "round"
    #: "drift": the share of a full round's cost (the cost model's FLOPs of every factor) that
    #: may start per step, a number in (0, 1], or "auto" (chosen once from the measured round
    #: and step times; stored in the state dict); Python only
    refresh_budget: Union[float, str] = "auto"
    #: "drift": d, steps from a factor's refresh start to its install, an integer >= 0, or
    #: "auto" (chosen with the budget; stored in the state dict); Python only
    install_delay: Union[int, str] = "auto"
    #: "drift": no basis gets older than this many steps (a factor that would is started
    #: whatever its score and the budget), an integer >= 1, or "auto": ceil(4 / budget) + d;
    #: Python only
    max_age: Union[int, str] = "auto"
    #: "drift": None, or a number >= 0: a factor whose drift score is below it skips its
    #: refresh (max_age still forces it); Python only
    skip_threshold: Optional[float] = None

    def __post_init__(self) -> None:
        self._validate()

    def __getstate__(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.keys()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A config read back (pickle, deepcopy) enters again: validated again."""
        for key, value in state.items():
            object.__setattr__(self, key, value)
        self._validate()

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_user(cls, runtime: Union[None, Mapping[str, Any], "RuntimeConfig"]) -> "RuntimeConfig":
        if runtime is None:
            cfg = cls()
        elif isinstance(runtime, RuntimeConfig):
            cfg = runtime
        elif isinstance(runtime, Mapping):
            allowed = cls.keys()
            for key in runtime:
                if key not in allowed:
                    raise ValueError(
                        f"unknown runtime key {key!r}; allowed keys: {', '.join(allowed)}")
            cfg = cls(**dict(runtime))
        else:
            raise ValueError(
                f"runtime must be None, a dict or asteria.RuntimeConfig, got {type(runtime).__name__}")
        return cfg

    def _validate(self) -> None:
        def need(key: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(
                    f"runtime key {key!r}: got {getattr(self, key)!r}; allowed: {allowed}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need("mode", self.mode in ("sync", "async"), '"sync", "async"')
        need("install", self.install in ("deterministic", "eager"), '"deterministic", "eager"')
        need("staleness", (is_int(self.staleness) and self.staleness >= 0)
             or self.staleness == "auto",
             'an integer S with 0 <= S <= precondition_frequency, or "auto" (S chosen from '
             'the measured round time, at most precondition_frequency)')
        for key in ("device_budget_bytes", "host_budget_bytes"):
            v = getattr(self, key)
            need(key, v is None or (is_int(v) and v >= 0), "None or a byte count >= 0")
        need("max_failures", is_int(self.max_failures) and self.max_failures >= 1,
             "an integer >= 1")
        need("on_failure", self.on_failure in ("raise", "keep"), '"raise", "keep"')
        need("fsdp_blocking", self.fsdp_blocking in ("local", "global"), '"local", "global"')
        need("factor_emas", self.factor_emas in ("thread", "workers"), '"thread", "workers"')
        need("refresh_device", isinstance(self.refresh_device, bool), "True, False")
        need("ranks_per_node", self.ranks_per_node is None
             or (is_int(self.ranks_per_node) and self.ranks_per_node >= 1),
             "None or an integer >= 1")
        t = self.coherence_timeout_s
        need("coherence_timeout_s", t is None
             or (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                 and t > 0), "None or a finite number of seconds > 0")
        need("coherence_topology", isinstance(self.coherence_topology, str)
             and self.coherence_topology in COHERENCE_TOPOLOGIES,
             ", ".join(f'"{v}"' for v in COHERENCE_TOPOLOGIES))
        need("tier_dtype", isinstance(self.tier_dtype, str) and self.tier_dtype in TIER_DTYPES,
             ", ".join(f'"{d}"' for d in TIER_DTYPES))
        need("refresh_policy", isinstance(self.refresh_policy, str)
             and self.refresh_policy in REFRESH_POLICIES,
             ", ".join(f'"{v}"' for v in REFRESH_POLICIES))
        b = self.refresh_budget
        need("refresh_budget", b == "auto" or (isinstance(b, (int, float))
                                              and not isinstance(b, bool) and math.isfinite(b)
                                              and 0 < b <= 1),
             '"auto" (chosen once from the measured round and step times), or a number in '
             '(0, 1]: the share of a full round that may start per step')
        need("install_delay", self.install_delay == "auto"
             or (is_int(self.install_delay) and self.install_delay >= 0),
             '"auto" (chosen once with refresh_budget), or an integer d >= 0: steps from a '
             "factor's refresh start to its install")
        need("max_age", self.max_age == "auto" or (is_int(self.max_age) and self.max_age >= 1),
             '"auto" (ceil(4 / refresh_budget) + install_delay), or an integer >= 1: steps')
        th = self.skip_threshold
        need("skip_threshold", th is None or (isinstance(th, (int, float))
                                             and not isinstance(th, bool) and math.isfinite(th)
                                             and th >= 0),
             "None, or a number >= 0: a factor whose drift score is below it skips")
        if self.refresh_policy == "drift" and self.mode == "async":
            # each rank would choose its own from its own measurements, and a checkpoint keeps
            # one rank's copy of a value every rank saves under one name
            for key in ("refresh_budget", "install_delay"):
                need(key, self.fsdp_blocking == "local" or getattr(self, key) != "auto",
                     f'a value, not "auto", with fsdp_blocking="global" (one {key} on every '
                     f'rank)')
        # each rank would choose its own S from its own measurements: the owners of one
        # parameter's blocks would install at different steps
        need("fsdp_blocking", self.fsdp_blocking == "local" or self.staleness != "auto"
             or self.mode == "sync", '"local" with staleness="auto" (global blocking needs one '
             'S on every rank: give staleness an integer)')
        if self.nvme_dir is not None:
            need("nvme_dir", isinstance(self.nvme_dir, (str, os.PathLike)), "None or a path string")
            _check_text("nvme_dir", self.nvme_dir)
            d = os.fspath(self.nvme_dir)
            need("nvme_dir", os.path.isdir(d),
                 "an existing directory (the NVMe tier writes its records there)")
            need("nvme_dir", os.access(d, os.W_OK | os.X_OK), "a directory this process can write")
        p = self.placement
        if isinstance(p, Mapping):
            for kind, tier in p.items():
                if kind not in PLACEMENT_KINDS:
                    raise ValueError(f"runtime key 'placement': unknown state kind {kind!r}; "
                                     f"allowed: {', '.join(PLACEMENT_KINDS)}")
                if tier not in TIERS:
                    raise ValueError(f"runtime key 'placement': unknown tier {tier!r} for "
                                     f"{kind!r}; allowed: {', '.join(TIERS)}")
        else:
            need("placement", p == "auto",
                 '"auto" or a dict {kind: tier} with kinds ' + ", ".join(PLACEMENT_KINDS)
                 + " and tiers " + ", ".join(TIERS))
        from asteria import _C

        c_config = _C.validate_config(self.c_items())
        object.__setattr__(self, "_c_config", c_config)
        # the C keys as libasteria took them (workers "3" -> 3): the Python readers see
        # the one validated value
        for key, value in c_config.as_dict().items():
            object.__setattr__(self, key, value)

    @property
    def c_config(self) -> Any:
        """The keys libasteria reads, validated by it at construction (a ``_C.Config``, which
        ``_C.Runtime`` takes as it is)."""
        return self._c_config

    def c_items(self) -> dict[str, Any]:
        """The keys libasteria reads (``_C.config_keys()``), as ``_C.validate_config`` takes
        them: None (C's default) left out, path strings as str."""
        from asteria import _C

        out: dict[str, Any] = {}
        for key in _C.config_keys():
            value = getattr(self, key)
            if value is None:
                continue
            if key in ("trace", "cpuset"):
                if not isinstance(value, (str, os.PathLike)):
                    raise ValueError(f"runtime key {key!r}: got {value!r}; allowed: None or a "
                                     f"path string")
                _check_text(key, value)
                value = os.fsdecode(value)
            out[key] = value
        return out
