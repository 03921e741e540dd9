"""The ``runtime=`` dict of the Asteria optimizers, validated once at construction.

``RuntimeConfig.from_user`` accepts ``None``, a plain dict or a ``RuntimeConfig``. Python checks
the types here; the values go through libasteria's own key/value setter
(``ast_config_set``, via ``asteria._C.validate_config``), so the C runtime and Python accept
exactly the same things and reject them with the same message, which names the key and the
allowed values. See the config table in README.md / DESIGN.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Union

PLACEMENT_KINDS = ("factors", "roots", "eigenbases", "moments")
TIERS = ("device", "host_pinned", "host", "uvm", "nvme")


def _check_text(key: str, value: Any) -> None:
    """A path or cpuset string that the C runtime can take: no NUL byte, encodable to the
    file system's bytes."""
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
    staleness: Union[int, str] = 5  # or "auto": the schedule picks S from measurements
    install: str = "deterministic"
    workers: Optional[int] = None
    placement: Union[str, Mapping[str, str]] = "auto"
    device_budget_bytes: Optional[int] = None
    host_budget_bytes: Optional[int] = None
    nvme_dir: Optional[str] = None
    trace: Optional[str] = None
    cpuset: Optional[str] = None
    pin: bool = True
    max_failures: int = 3
    on_failure: str = "raise"
    #: FSDP2 parameters: blocks cut from each rank's shard ("local"), or from the full
    #: parameter with one owner rank per block ("global", docs/distributed.md); Python only
    fsdp_blocking: str = "local"

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
        cfg._validate()
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
        need("workers", self.workers is None or (is_int(self.workers) and self.workers >= 1),
             "None (the cores the training thread does not use) or an integer >= 1")
        need("max_failures", is_int(self.max_failures) and self.max_failures >= 1, "an integer >= 1")
        need("pin", isinstance(self.pin, bool), "True, False")
        for key in ("device_budget_bytes", "host_budget_bytes"):
            v = getattr(self, key)
            need(key, v is None or (is_int(v) and v >= 0), "None or a byte count >= 0")
        need("on_failure", self.on_failure in ("raise", "keep"), '"raise", "keep"')
        need("fsdp_blocking", self.fsdp_blocking in ("local", "global"), '"local", "global"')
        # each rank would choose its own S from its own measurements: the owners of one
        # parameter's blocks would install at different steps
        need("fsdp_blocking", self.fsdp_blocking == "local" or self.staleness != "auto"
             or self.mode == "sync", '"local" with staleness="auto" (global blocking needs one '
             'S on every rank: give staleness an integer)')
        for key in ("nvme_dir", "trace", "cpuset"):
            v = getattr(self, key)
            need(key, v is None or isinstance(v, (str, os.PathLike)), "None or a path string")
            if v is not None:
                _check_text(key, v)
        if self.nvme_dir is not None:
            d = os.fspath(self.nvme_dir)
            need("nvme_dir", os.path.isdir(d),
                 "an existing directory (the NVMe tier writes its records there)")
            need("nvme_dir", os.access(d, os.W_OK | os.X_OK), "a directory this process can write")
        if self.trace is not None:
            path = os.fspath(self.trace)
            parent = os.path.dirname(os.path.abspath(path))
            need("trace", not os.path.isdir(path), "a file path (this is a directory)")
            need("trace", os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK),
                 "a file path in an existing directory this process can write")
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

        _C.validate_config(self.c_items())

    def placement_for(self, kind: str) -> Optional[str]:
        """The tier the user pinned for a state kind, or None under "auto"."""
        if isinstance(self.placement, Mapping):
            return self.placement.get(kind)
        return None

    def c_items(self) -> dict[str, str]:
        """The config as the string key/value pairs ``ast_config_set`` takes."""
        out: dict[str, str] = {
            "mode": self.mode,
            "install": self.install,
            "pin": "1" if self.pin else "0",
            "max_failures": str(self.max_failures),
        }
        if self.staleness != "auto":  # "auto" is the schedule's to resolve; C keeps its default
            out["staleness"] = str(self.staleness)
        if self.workers is not None:
            out["workers"] = str(self.workers)
        if isinstance(self.placement, Mapping):
            out["placement"] = ",".join(f"{k}={v}" for k, v in self.placement.items())
        else:
            out["placement"] = self.placement
        for key in ("device_budget_bytes", "host_budget_bytes"):
            if getattr(self, key) is not None:
                out[key] = str(getattr(self, key))
        for key in ("nvme_dir", "trace", "cpuset"):
            if getattr(self, key) is not None:
                out[key] = os.fspath(getattr(self, key))
        return out

    def check_frequency(self, precondition_frequency: int) -> None:
        """S <= f: a refresh must be installed before the next one is snapshotted ("auto"
        stays within it by construction)."""
        if self.staleness != "auto" and self.staleness > precondition_frequency:
            raise ValueError(
                f"runtime key 'staleness': got {self.staleness}; allowed: 0 <= S <= "
                f"precondition_frequency ({precondition_frequency})")
