"""``asteria.attach(model, optimizer)`` / ``asteria.detach(handle or model)``: PyTorch module
hooks as the shadow pipeline's scheduling signals (DESIGN.md, point 2).

Owns: the hooks registered on a model for one optimizer (``AttachHandle``) and a weak registry
model -> handles, so ``detach(model)`` finds them. May call: torch, the optimizer's
``_asteria_*`` methods. Runs on the training thread (the hooks fire there).

On every submodule that directly owns parameters of the optimizer:
 - a forward hook: collect finished REFRESH jobs (``_asteria_drain``, a non-blocking poll), and
   in a training forward (grad enabled) read this module's NVMe-resident roots back into host
   memory, so the slow tier's I/O overlaps the rest of forward and backward;
 - a full-backward-pre hook: prefetch this module's roots / eigenbases into the device staging
   ring. Backward reaches modules in reverse order, so the ring fills in the order gradients
   arrive, ahead of ``step()``.
Hooks only move copies earlier; the values the step consumes are the same, so results with and
without ``attach`` are identical (``install="deterministic"``). Prefetching never raises: what
did not happen (a full ring, an I/O error) is redone, or reported, by ``step()``.
FSDP2 (``fully_shard``) modules keep their parameters as DTensor attributes of the original
modules, so the same hooks apply; create the optimizer after ``fully_shard``.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Union

import torch
from torch import nn

# AttachHandle.log keeps the most recent hook firings only: a long run fires millions.
LOG_EVENTS = 4096

_REGISTRY: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


class AttachHandle:
    """The hooks of one ``attach`` call. ``log`` records (event, module name) in firing order:
    ("forward", name) and ("prefetch", name) for each backward-pre prefetch; the last
    ``LOG_EVENTS`` of them (a deque)."""

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        self._model = weakref.ref(model)
        self.optimizer = optimizer
        self.modules: list = []
        self.log: collections.deque = collections.deque(maxlen=LOG_EVENTS)
        self._handles: list = []
        self.attached = True

    def remove(self) -> None:
        """Remove every hook this handle registered. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.attached = False
        model = self._model()
        if model is not None and model in _REGISTRY:
            lst = _REGISTRY[model]
            if self in lst:
                lst.remove(self)
            if not lst:
                del _REGISTRY[model]

    def __enter__(self) -> "AttachHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def attach(model: nn.Module, optimizer: Any) -> AttachHandle:
    """Register the forward and full-backward-pre hooks of ``optimizer`` (an Asteria
    optimizer over parameters of ``model``) on ``model``'s submodules. Returns a handle;
    ``detach(handle)`` or ``detach(model)`` removes the hooks."""
    from asteria.optim.optimizer import AsteriaOptimizer

    if not isinstance(optimizer, AsteriaOptimizer):
        raise TypeError(f"asteria.attach needs an Asteria optimizer, got "
                        f"{type(optimizer).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"asteria.attach needs a torch.nn.Module, got {type(model).__name__}")
    owned = {p for g in optimizer.param_groups for p in g["params"]}
    names = {}
    for name, p in model.named_parameters():
        if p in owned:
            names[p] = name
    if not names:
        raise ValueError("asteria.attach: the optimizer updates none of the model's parameters "
                         "(create the optimizer after fully_shard, from model.parameters())")
    optimizer._asteria_name_params(names)
    handle = AttachHandle(model, optimizer)
    for mname, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p in owned]
        if not params:
            continue
        label = mname or type(module).__name__
        handle.modules.append(label)
        handle._handles.append(module.register_forward_hook(_forward_hook(handle, label, params)))
        handle._handles.append(
            module.register_full_backward_pre_hook(_backward_pre_hook(handle, label, params)))
    _REGISTRY.setdefault(model, []).append(handle)
    return handle


def detach(target: Union[AttachHandle, nn.Module]) -> int:
    """Remove the hooks of one handle, or of every ``attach`` on a model. Returns how many
    handles were removed."""
    if isinstance(target, AttachHandle):
        was = target.attached
        target.remove()
        return int(was)
    if isinstance(target, nn.Module):
        handles = list(_REGISTRY.get(target, ()))
        for h in handles:
            h.remove()
        return len(handles)
    raise TypeError(f"asteria.detach needs an AttachHandle or an nn.Module, got "
                    f"{type(target).__name__}")


def _forward_hook(handle: AttachHandle, label: str, params: list):
    ref = weakref.ref(handle)

    def hook(module, inputs, output):
        h = ref()
        if h is None or not h.attached:
            return None
        h.log.append(("forward", label))
        opt = h.optimizer
        opt._asteria_drain()
        if torch.is_grad_enabled():
            opt._asteria_fetch_early(params)
        return None

    return hook


def _backward_pre_hook(handle: AttachHandle, label: str, params: list):
    ref = weakref.ref(handle)

    def hook(module, grad_output):
        h = ref()
        if h is None or not h.attached:
            return None
        h.log.append(("prefetch", label))
        h.optimizer._asteria_prefetch(params, reason=label)
        return None

    return hook
