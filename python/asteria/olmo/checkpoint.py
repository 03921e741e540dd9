"""The checkpoint form of one parameter's Asteria state: the same keys at every step.

Owns the translation between an Asteria optimizer's per-parameter ``state_dict()`` entry (the
base form, ``asteria.optim._base``) and its checkpoint form, and the test for "this state is
what torch.distributed.checkpoint's empty-state fake step left". Calls only torch; no state.

Why a second form: torch.distributed.checkpoint loads a flattened optimizer state dict into a
*template*, the ``state_dict()`` of the freshly built optimizer after its "fake step" (zero
gradients, lr 0), and keeps only the keys the template has. In the base form some keys exist
only part of the time: a REFRESH result in flight (``pending.install_in``, ``pending.age``,
``b{j}.pending{dim}.{i}``) and Shampoo's inverse roots before their first install
(``b{j}.Linv{i}``). Loaded through such a template they would be dropped and the resumed run
would leave the trajectory. The checkpoint form always has them: a result or root that does not
exist is a zero placeholder of its exact shape and dtype, with an integer flag beside it
(``b{j}.pending{dim}_ok``, ``b{j}.Linv{i}_set``, ``pending.install_in`` = -1).

No key of either form is a dotted prefix of another, so a form that went through the nested
reconstruction of ``_unflatten_optim_state_dict`` (``{"b0": {"exp_avg": t}}``) is turned back by
joining the keys with dots (``join_nested``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional

import torch

from asteria.optim import KLShampoo, SOAP, Shampoo
from asteria.optim._base import _PENDING, _PENDING_AGE, _PENDING_IN

NO_ROUND = -1  # pending.install_in of a parameter without a refresh in flight


@dataclasses.dataclass(frozen=True)
class Schema:
    """What the state of one method looks like."""

    factor: str               # state name of the Kronecker factors: b{j}.{factor}{dim}
    outputs: tuple            # per REFRESH output: the state name it looks like, or "perm"
    root: Optional[str]       # a state that exists only after the first install (Shampoo)
    fake_step_count: int      # the ``step`` a fake step leaves: 0 if the first step is the
                              # eigenbasis initialisation (no update), else 1
    fake_zero: tuple          # state names that a fake step leaves at zero


SCHEMAS: dict[type, Schema] = {
    SOAP: Schema("GG", ("Q", "perm"), None, 0, ("GG",)),
    KLShampoo: Schema("S", ("Q",), None, 0, ("S",)),
    Shampoo: Schema("L", ("L",), "Linv", 1, ("L", "momentum", "grafting_v")),
}


def schema_of(method: type) -> Schema:
    for cls, schema in SCHEMAS.items():
        if issubclass(method, cls):
            return schema
    raise TypeError(f"no checkpoint schema for {method.__name__}; "
                    f"known: {', '.join(c.__name__ for c in SCHEMAS)}")


def _factor_dims(st: Mapping[str, Any], factor: str) -> list[tuple[int, int]]:
    """(block j, dim) of every factor in a state, in a stable order."""
    pat = re.compile(rf"b(\d+)\.{re.escape(factor)}(\d+)")
    out = []
    for key in st:
        m = pat.fullmatch(key)
        if m:
            out.append((int(m.group(1)), int(m.group(2))))
    return sorted(out)


def _placeholder(st: Mapping[str, Any], j: int, dim: int, like: str) -> torch.Tensor:
    if like == "perm":
        q = st[f"b{j}.Q{dim}"]
        return torch.zeros(q.shape[0], dtype=torch.int64, device=q.device)
    return torch.zeros_like(st[f"b{j}.{like}{dim}"])


def to_checkpoint(st: Mapping[str, Any], schema: Schema) -> dict[str, Any]:
    """Base form -> checkpoint form. ``st`` is not modified."""
    out = dict(st)
    if not out:
        return out
    install_in = int(out.pop(_PENDING_IN, NO_ROUND))
    age = int(out.pop(_PENDING_AGE, 0))
    out[_PENDING_IN], out[_PENDING_AGE] = install_in, age
    for j, dim in _factor_dims(st, schema.factor):
        keys = [f"b{j}{_PENDING}{dim}.{i}" for i in range(len(schema.outputs))]
        present = install_in != NO_ROUND and all(k in out for k in keys)
        for key, like in zip(keys, schema.outputs):
            if not present:
                out[key] = _placeholder(st, j, dim, like)
        out[f"b{j}{_PENDING}{dim}_ok"] = int(present)
        if schema.root is not None:
            key = f"b{j}.{schema.root}{dim}"
            out[f"{key}_set"] = int(key in out)
            if key not in out:
                out[key] = _placeholder(st, j, dim, schema.factor)
    return out


def from_checkpoint(ck: Mapping[str, Any], schema: Schema) -> dict[str, Any]:
    """Checkpoint form -> base form. ``ck`` is not modified."""
    out = dict(ck)
    if not out:
        return out
    install_in = int(out.pop(_PENDING_IN, NO_ROUND))
    age = int(out.pop(_PENDING_AGE, 0))
    if install_in != NO_ROUND:
        out[_PENDING_IN], out[_PENDING_AGE] = install_in, age
    for j, dim in _factor_dims(ck, schema.factor):
        ok = int(out.pop(f"b{j}{_PENDING}{dim}_ok", 0))
        if install_in == NO_ROUND or not ok:  # no round, or its job failed: nothing to install
            for i in range(len(schema.outputs)):
                out.pop(f"b{j}{_PENDING}{dim}.{i}", None)
        if schema.root is not None:
            key = f"b{j}.{schema.root}{dim}"
            if not int(out.pop(f"{key}_set", 0)):
                out.pop(key, None)
    return out


def join_nested(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"b0": {"exp_avg": t}, "step": 3} -> {"b0.exp_avg": t, "step": 3}; flat dicts unchanged."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(join_nested(v, key))
        else:
            out[key] = v
    return out


def _step_value(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def is_fake_step_state(st: Mapping[str, Any], schema: Schema) -> bool:
    """True if this base-form state is exactly what one all-zero-gradient step left (the fake
    step of torch.distributed.checkpoint; a genuine all-zero first gradient leaves the same)."""
    if not st or "step" not in st or _step_value(st["step"]) != schema.fake_step_count:
        return False
    names = "|".join(re.escape(n) for n in schema.fake_zero)
    pat = re.compile(rf"b\d+\.(?:{names})\d*")
    tensors = [v for k, v in st.items() if pat.fullmatch(k) and isinstance(v, torch.Tensor)]
    return bool(tensors) and all(not bool(t.any()) for t in tensors)


def is_fake_step_adamw(st: Mapping[str, Any]) -> bool:
    """The same test for the state of a torch.optim.AdamW parameter."""
    if not st or "step" not in st or _step_value(st["step"]) != 1:
        return False
    return all(not bool(st[k].any()) for k in ("exp_avg", "exp_avg_sq") if k in st)
