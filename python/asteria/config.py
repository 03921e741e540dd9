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


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    mode: str = "async"
    staleness: int = 5
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
        need("staleness", is_int(self.staleness) and self.staleness >= 0,
             "an integer S with 0 <= S <= precondition_frequency")
        need("workers", self.workers is None or (is_int(self.workers) and self.workers >= 1),
             "None (the cores the training thread does not use) or an integer >= 1")
        need("max_failures", is_int(self.max_failures) and self.max_failures >= 1, "an integer >= 1")
        need("pin", isinstance(self.pin, bool), "True, False")
        for key in ("device_budget_bytes", "host_budget_bytes"):
            v = getattr(self, key)
            need(key, v is None or (is_int(v) and v >= 0), "None or a byte count >= 0")
        for key in ("nvme_dir", "trace", "cpuset"):
            v = getattr(self, key)
            need(key, v is None or isinstance(v, (str, os.PathLike)), "None or a path string")
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
            "staleness": str(self.staleness),
            "install": self.install,
            "pin": "1" if self.pin else "0",
            "max_failures": str(self.max_failures),
        }
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
        """S <= f: a refresh must be installed before the next one is snapshotted."""
        if self.staleness > precondition_frequency:
            raise ValueError(
                f"runtime key 'staleness': got {self.staleness}; allowed: 0 <= S <= "
                f"precondition_frequency ({precondition_frequency})")
