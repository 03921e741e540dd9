"""``asteria.Shampoo``: Shampoo (Gupta et al. 2018) with Adam grafting, as Distributed Shampoo
practises it, with its inverse roots computed on the Asteria engine.

Owns Shampoo's hyperparameters and per-block state; the math is in ``functional``
(shampoo_step / shampoo_root_input), the scheduling in ``schedule``.

State of a preconditioned parameter: ``step`` (k) and per block j ``b{j}.momentum`` (m1),
``b{j}.grafting_v`` (vg), and for every dimension i with a factor ``b{j}.L{i}``,
``b{j}.Linv{i}`` = (L_i/c + epsilon I)^(-1/(2*order)), order = the block's number of
dimensions, and ``b{j}.Linv{i}_set``: 1 once a refresh was installed there, before that 0 with
``b{j}.Linv{i}`` a zero placeholder (the key set stays fixed, which a flattened
torch.distributed.checkpoint load needs); with S > 0 also the fixed keys of a refresh in flight
(``pending.install_in``, ``pending.age``, ``b{j}.pending{i}.0``, ``b{j}.pending{i}_ok``; see
``AsteriaOptimizer``). 1-D and 0-D parameters, and every parameter of a group with
``"algorithm": "adamw"``, are AdamW with betas (betas[0], grafting_beta2) and eps
grafting_epsilon: Shampoo's betas[1] and epsilon belong to the factors.

Runtime ``tier_dtype``: "float32" or "bfloat16". The quantized tiers ("int8", "int4") store
orthogonal eigenbases, whose error Bjorck steps pull back; an inverse root is not orthogonal,
so Shampoo refuses them (its ``Linv`` fields are of kind "roots": tiers/plan.py
``check_tier_dtype``, at construction).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from asteria.optim import _layout as K
from asteria.optim import functional as F
from asteria.optim.method import Field, Method, check_common, is_int, register, require
from asteria.optim.optimizer import AsteriaOptimizer


def _flag(v) -> bool:
    return bool(v.item()) if isinstance(v, torch.Tensor) else bool(v)


class ShampooMethod(Method):
    """shampoo's math."""

    NAME = "shampoo"
    REFRESH_OP = ("inv_root", 4.0)
    init_step = False
    # step 1 of a zero gradient leaves zero factors, momentum and grafting_v; the roots exist
    # from the start, zero and not set until the first install
    STATE = (Field("momentum", "moments", zeros=True, fake_zero=True),
             Field("grafting_v", "moments", zeros=True, fake_zero=True),
             Field("L", "factors", per_dim=True, zeros=True, fake_zero=True),
             Field("Linv", "roots", per_dim=True, flagged=True))

    def check(self, group: dict) -> None:
        check_common(group, beta_max=(False, True))
        for key in ("epsilon", "grafting_epsilon"):
            v = group[key]
            require(key, isinstance(v, (int, float)) and v >= 0.0, v, "a float >= 0")
        gb = group["grafting_beta2"]
        require("grafting_beta2", isinstance(gb, (int, float)) and 0.0 <= gb < 1.0, gb,
                "a float in [0, 1)")
        sp = group["start_preconditioning_step"]
        require("start_preconditioning_step", is_int(sp) and (sp == -1 or sp >= 1), sp,
                "-1 (= precondition_frequency) or an integer >= 1")
        md = group["max_preconditioner_dim"]
        require("max_preconditioner_dim", is_int(md) and md >= 1, md, "an integer >= 1")
        ov = group["inverse_exponent_override"]
        values = list(ov.values()) if isinstance(ov, dict) else [ov]
        require("inverse_exponent_override",
                ov is None or all(isinstance(v, (int, float)) and v > 0 for v in values), ov,
                "None, a root p > 0, or a dict {order: p}")

    def adamw_hparams(self, group):
        return group["betas"][0], group["grafting_beta2"], group["grafting_epsilon"]

    def max_dim(self, group):
        return group["max_preconditioner_dim"]

    def batch_tag(self, p, j):
        st = self.state[p]  # True once every factor of the block has an installed root
        dims = [i for i in range(st[K.key(j, "momentum")].dim()) if K.key(j, "L", i) in st]
        return bool(dims) and all(_flag(st.get(K.set_flag(j, "Linv", i), 0)) for i in dims)

    def step_blocks(self, group, members, w, g, steps):
        has = self.has_factor(g.shape[1:], group)
        # the state's packed stacks, updated in place (copies only for tiered blocks)
        factors = self.placement.stack_dims(members, "L", has, view=True)
        p0, j0 = members[0]
        roots = (self.placement.stack_dims(members, "Linv", has, view=True) if self.batch_tag(p0, j0)
                 else None)
        start = group["start_preconditioning_step"]
        if start == -1:
            start = self.cadence.frequency(group, initial=True)
        m1 = self.placement.stack(members, "momentum", view=True)
        vg = self.placement.stack(members, "grafting_v", view=True)
        F.shampoo_step(w, g, factors, roots, m1, vg, steps, [k >= start for k in steps],
                       lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                       grafting_beta2=group["grafting_beta2"],
                       grafting_epsilon=group["grafting_epsilon"],
                       weight_decay=group["weight_decay"])
        self.placement.unstack(members, "momentum", m1)
        self.placement.unstack(members, "grafting_v", vg)
        self.placement.unstack_dims(members, "L", factors)

    def refresh_input(self, kind, p, j, dim):
        group = self.group_of(p)
        st = self.state[p]
        order = st[K.key(j, "momentum")].dim()
        ov = group["inverse_exponent_override"]
        if isinstance(ov, dict):
            ov = ov.get(order)
        root = float(2 * order if ov is None else ov)
        f = F.shampoo_root_input(st[K.key(j, "L", dim)], st["step"], group["betas"][1])
        return self.REFRESH_OP[0], f, None, root, float(group["epsilon"])

    def install(self, kind, outputs):
        for p, outs in outputs.items():
            for (j, dim), out in outs.items():
                if out is not None:
                    self.placement.root_set(p, K.key(j, "Linv", dim), out[0])
                    self.state[p][K.set_flag(j, "Linv", dim)] = 1


@register
class Shampoo(AsteriaOptimizer):
    """Shampoo with Adam grafting. ``start_preconditioning_step=-1`` means
    ``precondition_frequency`` (Distributed Shampoo's convention; with ``"auto"`` the f the run
    starts with, before f is chosen: 1, or an integer S). ``inverse_exponent_override``:
    None (root 2*order), a number p (every factor uses the root p), or a dict {order: p}.

    Param group key ``"algorithm"``: ``"adamw"`` sends every parameter of the group, 2-D ones
    too (embeddings, an output head), to AdamW exactly as 1-D parameters go (betas
    (betas[0], grafting_beta2), eps grafting_epsilon, the group's lr and weight_decay;
    OLMo-core's convention)."""


    METHOD = ShampooMethod

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), epsilon: float = 1e-12,
                 grafting_beta2: float = 0.999, grafting_epsilon: float = 1e-8,
                 weight_decay: float = 0.0, precondition_frequency: Union[int, str] = 10,
                 start_preconditioning_step: int = -1, max_preconditioner_dim: int = 1024,
                 inverse_exponent_override: Union[None, float, dict] = None, *,
                 block_size: Optional[int] = None, runtime=None):
        defaults = dict(lr=lr, betas=betas, epsilon=epsilon, grafting_beta2=grafting_beta2,
                        grafting_epsilon=grafting_epsilon, weight_decay=weight_decay,
                        precondition_frequency=precondition_frequency,
                        start_preconditioning_step=start_preconditioning_step,
                        max_preconditioner_dim=max_preconditioner_dim,
                        inverse_exponent_override=inverse_exponent_override,
                        block_size=block_size)
        super().__init__(params, defaults, runtime)
