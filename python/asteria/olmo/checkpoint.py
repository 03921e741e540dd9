"""Helpers for ``MatrixAwareAsteria``'s checkpoints: the nested form DCP reconstructs, and the
fake-step test for AdamW.

Owns the test for "this torch.optim.AdamW state is what torch.distributed.checkpoint's
empty-state fake step left" and the undoing of DCP's nested reconstruction. Calls only torch;
no state.

torch.distributed.checkpoint loads a flattened optimizer state dict into the live state of the
freshly built optimizer after its "fake step" (zero gradients, lr 0), keeping only the keys it
has. The Asteria optimizers now keep one fixed key set per parameter from its state's creation
on (``asteria.optim.checkpoint``, "Checkpoints through torch.distributed.checkpoint"): a REFRESH in
flight is ``pending.install_in`` (-1: none), ``pending.age``, ``b{j}.pending{dim}.{i}`` (zero
placeholders) with ``b{j}.pending{dim}_ok``, and Shampoo's roots exist from the start with
``b{j}.Linv{i}_set``. So the optimizer's own form is the checkpoint form, stored as it is.
The optimizers also forget the state of the fake step themselves; only torch.optim.AdamW's
(``is_fake_step_adamw``) is left to ``MatrixAwareAsteria``.

No key of the form is a dotted prefix of another, so a form that went through the nested
reconstruction of ``_unflatten_optim_state_dict`` (``{"b0": {"exp_avg": t}}``) is turned back by
joining the keys with dots (``join_nested``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch


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


def is_fake_step_adamw(st: Mapping[str, Any]) -> bool:
    """True if this torch.optim.AdamW parameter state is exactly what one all-zero-gradient
    step left (the fake step of torch.distributed.checkpoint)."""
    if not st or "step" not in st or _step_value(st["step"]) != 1:
        return False
    return all(not bool(st[k].any()) for k in ("exp_avg", "exp_avg_sq") if k in st)
