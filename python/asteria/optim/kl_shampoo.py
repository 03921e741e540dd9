"""``asteria.KLShampoo``: KL-Shampoo (Lin et al., ICLR 2026; yorkerlin/KL-Methods, KL-Shampoo
mode) with its QR eigenbasis refresh on the Asteria engine.

Owns KL-Shampoo's hyperparameters and per-block state; the math is in ``functional``
(kl_init / kl_step), the scheduling in ``schedule``.

State of a preconditioned parameter, in ``compute_dtype``: ``step`` (k) and per block j
``b{j}.exp_avg`` (M), and for every dimension i with a factor ``b{j}.S{i}`` (S_a, S_b, ...),
``b{j}.Q{i}`` (its eigenbasis) and ``b{j}.s{i}`` (s_i = lam_i^(-1/2)); with S > 0 also the fixed
keys of a refresh in flight (``pending.install_in``, ``pending.age``, ``b{j}.pending{i}.0`` (Q),
``b{j}.pending{i}_ok``; see ``AsteriaOptimizer``). 1-D and 0-D parameters, and every parameter
of a group with ``"algorithm": "adamw"``, are AdamW.

``compute_dtype`` is kept in the param groups by name (``"float32"``): torch.distributed
checkpoint's state-dict helpers handle no torch.dtype values (``cpu_offload=True``).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from asteria.optim import _layout as K
from asteria.optim import functional as F
from asteria.optim.method import (Field, Method, check_eigenbasis, is_int,
                                  register, require, shampoo_beta)
from asteria.optim.optimizer import AsteriaOptimizer


def _as_dtype(v) -> Optional[torch.dtype]:
    """A torch.dtype, or the torch.dtype of a name ("float32", "torch.float32"); else None."""
    if isinstance(v, torch.dtype):
        return v
    if isinstance(v, str):
        dt = getattr(torch, v.removeprefix("torch."), None)
        return dt if isinstance(dt, torch.dtype) else None
    return None


def dtype_name(v):
    """A torch.dtype by its name ("float32"); anything else unchanged (the check names it)."""
    dt = _as_dtype(v)
    return str(dt).removeprefix("torch.") if dt is not None else v


def _cdtype(group: dict) -> torch.dtype:
    return _as_dtype(group["compute_dtype"])


class KLShampooMethod(Method):
    """kl_shampoo's math."""

    NAME = "kl_shampoo"
    REFRESH_OP = ("kl_qr", 0.0)
    # M; per dimension S, s = lam^(-1/2) and the basis (a fake step's S are zero, its bases
    # the identity, from them); all in the compute dtype
    STATE = (Field("exp_avg", "moments", zeros=True),
             Field("S", "factors", per_dim=True, fake_zero=True),
             Field("s", "factors", per_dim=True, vector=True),
             Field("Q", "eigenbases", per_dim=True))

    def check(self, group: dict) -> None:
        check_eigenbasis(group)
        fi = group["init_factor"]
        require("init_factor", isinstance(fi, (int, float)) and fi > 0.0, fi, "a float > 0")
        mc = group["max_clamp_value"]
        require("max_clamp_value", isinstance(mc, (int, float)) and mc > 0, mc, "a number > 0")
        cd = group["compute_dtype"]
        dt = _as_dtype(cd)
        require("compute_dtype", dt is not None and dt.is_floating_point, cd,
                "a floating-point torch.dtype or its name ('float32', 'float64', 'bfloat16')")
        md = group["max_precond_dim"]
        require("max_precond_dim", is_int(md) and md >= 1, md, "an integer >= 1")

    def normalize_group(self, group):
        if "compute_dtype" in group:  # by name in the group (torch keeps this dict)
            group["compute_dtype"] = dtype_name(group["compute_dtype"])

    def state_dtype(self, p, group):
        return _cdtype(group)

    def init_blocks(self, group, members, g):
        g = g.to(_cdtype(group))
        has = self.has_factor(g.shape[1:], group)
        factors = F.kl_init(g, has, shampoo_beta=shampoo_beta(group))
        for i, f in enumerate(factors):
            if f is None:
                continue
            s = 1.0 / torch.sqrt(torch.full((f.shape[-1],), group["init_factor"],
                                            dtype=f.dtype, device=f.device))
            for p, j in members:
                self.state[p][K.key(j, "s", i)] = s.clone()
        return self.init_bases(members, factors)

    def step_blocks(self, group, members, w, g, steps):
        g = g.to(_cdtype(group))
        has = self.has_factor(g.shape[1:], group)
        # the state's packed stacks, updated in place (copies only for tiered blocks)
        m = self.placement.stack(members, "exp_avg", view=True)
        factors = self.placement.stack_dims(members, "S", has, view=True)
        bases = self.placement.stack_dims(members, "Q", has, view=True)
        scales = self.placement.stack_dims(members, "s", has, view=True)
        clamp = [F.kl_clamp_max(d, group["max_clamp_value"]) if h and group["using_clamping"]
                 else None for d, h in zip(g.shape[1:], has)]
        ok = F.kl_step(w, g, m, factors, bases, scales, lr=float(group["lr"]),
                  beta1=group["betas"][0], shampoo_beta=shampoo_beta(group),
                  eps=group["eps"], weight_decay=group["weight_decay"],
                  normalize_grads=group["normalize_grads"], clamp=clamp)
        self.schedule.count_lazy("overflow_skipped", (~ok).sum())
        self.placement.unstack(members, "exp_avg", m)
        self.placement.unstack_dims(members, "S", factors)
        self.placement.unstack_dims(members, "s", scales)

    refresh_input = Method.eigenbasis_refresh_input

    def install(self, kind, outputs):
        self.install_bases(outputs)  # lam (s) is kept: the QR refresh only rotates Q


@register
class KLShampoo(AsteriaOptimizer):
    """KL-Shampoo. Keyword names and defaults are the reference's KL-Shampoo mode, plus
    ``compute_dtype`` (the reference casts to bf16; here float32 by default; a floating-point
    torch.dtype or its name, stored by name), ``max_precond_dim`` (a dimension larger than it
    gets no factor; not in the reference), ``block_size`` and ``runtime``.

    Param group key ``"algorithm"``: ``"adamw"`` sends every parameter of the group, 2-D ones
    too (embeddings, an output head), to AdamW with the group's lr, betas, eps and
    weight_decay, exactly as 1-D parameters go (OLMo-core's convention)."""

    METHOD = KLShampooMethod

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.98), shampoo_beta: float = -1,
                 eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: Union[int, str] = 10,
                 normalize_grads: bool = False, init_factor: float = 0.1,
                 using_clamping: bool = True, max_clamp_value: int = 4000,
                 compute_dtype: Union[torch.dtype, str] = torch.float32, *,
                 max_precond_dim: int = 10000, block_size: Optional[int] = None, runtime=None):
        compute_dtype = dtype_name(compute_dtype)
        defaults = dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps,
                        weight_decay=weight_decay, precondition_frequency=precondition_frequency,
                        normalize_grads=normalize_grads, init_factor=init_factor,
                        using_clamping=using_clamping, max_clamp_value=max_clamp_value,
                        compute_dtype=compute_dtype, max_precond_dim=max_precond_dim,
                        block_size=block_size)
        super().__init__(params, defaults, runtime)
