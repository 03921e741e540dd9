"""``asteria.SOAP``: Shampoo's eigenbasis with Adam in it (Vyas et al., ICLR 2025).

Owns SOAP's hyperparameters, per-block state layout, the install of a refreshed basis and the
order of a stack's step: the math is in ``functional`` (soap_init, the step's two halves
soap_project / soap_moments + soap_update, soap_install), the scheduling in ``schedule``. Two
pieces of SOAP's math may run on the pool's workers while the next forward and backward run
(docs/departures.md); SOAP declares their kinds (``ROTATION``, ``FACTOR_EMAS``: op, counters,
runtime switch) and each job as a ``background.WorkerJob`` (operands, the state keys it writes,
the state its outputs go into), and hands it to the background-jobs part (``background``),
which decides in one rule whether it runs on a worker (``on_worker``), starts it and writes
its outputs (``offload``): at an install, m's re-expression in the new basis (``soap_rotate``;
an install deferred to the next step's start, S = 0, too: that step runs the
projection half first and waits for m's job, ``wait_for_moment``, only between the halves);
with runtime ``factor_emas="workers"``, on a step whose factors no REFRESH reads at its end,
the factor EMAs L, R (``gram_ema``, in place in the packed state), made due in the stack's
``step_blocks`` and started once the group's stacks have all run. A read of what a job writes
waits for it (``background.settle``).

State of a preconditioned parameter: ``step`` (k) and per block j ``b{j}.exp_avg`` (m),
``b{j}.exp_avg_sq`` (v), both in the rotated basis, and for every dimension i with a factor
``b{j}.GG{i}`` (L, R, ...) and ``b{j}.Q{i}`` (its eigenbasis); with S > 0 also the fixed keys
of a refresh in flight (``pending.install_in``, ``pending.age``, ``b{j}.pending{i}.0`` (Q) /
``.1`` (the int64 sort order), ``b{j}.pending{i}_ok``; see ``AsteriaOptimizer``). 1-D parameters
(unless ``precondition_1d``), 0-D ones and every parameter of a group with
``"algorithm": "adamw"`` are AdamW with state ``step``, ``exp_avg``, ``exp_avg_sq``.
"""

from __future__ import annotations

from typing import Optional

import torch

from asteria.config import RuntimeConfig
from asteria.optim import _layout as K
from asteria.optim import functional as F
from asteria.optim._state import real
from asteria.optim.background import JobKind, WorkerJob
from asteria.optim.method import (INIT, Field, Method, check_eigenbasis, is_int,
                                  register, require, shampoo_beta)
from asteria.optim.optimizer import AsteriaOptimizer


def factor_emas_on_workers(cfg: RuntimeConfig) -> bool:
    """Runtime ``factor_emas``: "workers" hands the factor EMAs to the pool ("thread", the
    default, keeps them on the training thread)."""
    return cfg.factor_emas == "workers"


#: m re-expressed in a new basis at an install (``SOAPMethod.rotation_job``)
ROTATION = JobKind("soap_rotate", submitted="rotations_submitted", failed="rotation_failures",
                   what="re-expressing SOAP's first moment")
#: a step's factor EMAs L, R (``SOAPMethod.factor_ema_job``), where the runtime asks for it
FACTOR_EMAS = JobKind("gram_ema", submitted="factor_emas_submitted",
                      failed="factor_ema_failures", what="updating SOAP's factors",
                      switch=factor_emas_on_workers)


class SOAPMethod(Method):
    """SOAP's math (``functional.soap_*``) and the two pieces of it a worker may do, declared
    as ``WorkerJob``s (the background-jobs part decides and runs them)."""

    NAME = "soap"
    REFRESH_OP = ("soap_qr", 0.0)
    weights_in_place = True  # soap_update updates a list of whole parameters where they are
    # m and v in the rotated basis; L, R, ... and their eigenbases (a fake step's factors are
    # zero, its bases the identity, from them)
    STATE = (Field("exp_avg", "moments", zeros=True),
             Field("exp_avg_sq", "moments", zeros=True),
             Field("GG", "factors", per_dim=True, fake_zero=True),
             Field("Q", "eigenbases", per_dim=True))
    EXTRA_OUTPUTS = (torch.int64,)  # soap_qr: (Q, sort order)

    def check(self, group: dict) -> None:
        check_eigenbasis(group)
        md = group["max_precond_dim"]
        require("max_precond_dim", is_int(md) and md >= 1, md, "an integer >= 1")

    def uses_adamw(self, p, group):
        d = real(p).dim()
        return d == 0 or (d == 1 and not group["precondition_1d"])

    def merge_dims(self, group):
        return group["merge_dims"]

    def init_blocks(self, group, members, g):
        has = self.has_factor(g.shape[1:], group)
        factors = F.soap_init(g, has, shampoo_beta=shampoo_beta(group))
        return self.init_bases(members, factors)

    def step_blocks(self, group, members, w, g, steps):
        has = self.has_factor(g.shape[1:], group)
        # the state's packed stacks, updated in place (copies only for tiered blocks)
        v = self.placement.stack(members, "exp_avg_sq", view=True)
        factors = self.placement.stack_dims(members, "GG", has, view=True)
        bases = self.placement.stack_dims(members, "Q", has, view=True)
        offload = self.factor_emas_offloaded(group, members, g, factors, steps)
        gp = F.soap_project(g, [None] * len(factors) if offload else factors, bases,
                            shampoo_beta=shampoo_beta(group))
        self.wait_for_moment(members)
        m = self.placement.stack(members, "exp_avg", view=True)
        beta1, beta2 = group["betas"]
        F.soap_moments(m, v, gp, beta1=beta1, beta2=beta2)
        del gp  # the projected gradient's memory is free for the update's temporaries
        F.soap_update(w, m, v, bases, steps, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                      eps=group["eps"], weight_decay=group["weight_decay"],
                      correct_bias=group["correct_bias"],
                      normalize_grads=group["normalize_grads"])
        self.placement.unstack(members, "exp_avg", m)
        self.placement.unstack(members, "exp_avg_sq", v)
        self.placement.unstack_dims(members, "GG", factors)
        if offload:  # started once the group's stacks have all run (background.start_due)
            self.background.offload(self.factor_ema_job(list(members), g, list(factors),
                                                        shampoo_beta(group)), due=True)

    def wait_for_moment(self, members: list) -> None:
        """Between a step's halves: m may still be re-expressed on a worker (an install deferred
        to this step), so its job is waited for and applied. Only a job that writes m is
        waited for: a settle of anything else would start the group's due factor EMAs before
        its last stack (``BackgroundJobs.settle``)."""
        background = self.background
        if background:
            for p, j in members:
                key = K.key(j, "exp_avg")
                if (p, key) in background:
                    background.settle(p, key)

    refresh_input = Method.eigenbasis_refresh_input

    def install(self, kind, outputs):
        if kind == INIT:
            self.install_bases(outputs)
            return
        for all_members, has in _stacks_of(self.state, self.placement, outputs):
            for members in self.placement.chunks(all_members):
                self.install_chunk(members, has, outputs)

    def install_chunk(self, members, has, outputs):
        m, v = self.placement.stack(members, "exp_avg"), self.placement.stack(members, "exp_avg_sq")
        offload = self.background.on_worker(ROTATION, members, len(has))
        # offloaded: the old and new bases go straight into the rotation job's (B, 2, n, n)
        # pairs, which the worker reads in place (no stacks of their own, no snapshot)
        pairs = [torch.empty((len(members), 2, m.shape[i + 1], m.shape[i + 1]), dtype=m.dtype)
                 if offload and h else None for i, h in enumerate(has)]
        old = [self.placement.stack(members, "Q", i, out=None if pr is None else pr[:, 0]) if h
               else None for i, (h, pr) in enumerate(zip(has, pairs))]
        new, perms = [], []
        for i, q_old in enumerate(old):
            if q_old is None:
                new.append(None)
                perms.append(None)
                continue
            qs, ps = [], []
            for (p, j), q in zip(members, q_old.unbind(0)):
                out = outputs[p].get((j, i))
                # m is re-expressed in the basis the steps will use: as it will be stored
                # (tier_dtype), widened on m's device
                qs.append(q if out is None else
                          self.placement.as_stored(p, K.key(j, "Q", i), out[0], q.device))
                ps.append(torch.arange(q.shape[0], device=q.device) if out is None
                          else out[1].to(q.device))
            new.append(torch.stack(qs, out=None if pairs[i] is None else pairs[i][:, 1]))
            perms.append(torch.stack(ps))
        if offload:
            # v permuted here (cheap), m re-expressed by a worker while the next forward and
            # backward run; the next read of m waits for it
            F.soap_permute(v, perms)
            self.background.offload(self.rotation_job(members, m, pairs))
        else:
            F.soap_install(m, v, old, new, perms)
            self.placement.unstack(members, "exp_avg", m)
        self.placement.unstack(members, "exp_avg_sq", v)
        # the new bases as refreshed (``new`` holds them as the steps will see them, which a
        # quantized tier would quantize a second time); a block without one keeps its basis
        for p, j in members:
            for i, q in enumerate(new):
                out = None if q is None else outputs[p].get((j, i))
                if out is not None:
                    self.placement.root_set(p, K.key(j, "Q", i), out[0])

    # ---- the pieces a worker may do, declared ---------------------------------------------------
    def rotation_job(self, members: list, m: torch.Tensor, pairs: list) -> WorkerJob:
        """m_new = Q_new^T (Q_old m Q_old^T) Q_new (per side) as a ``soap_rotate`` job: ``m``
        (a stack made for this) and ``pairs`` ((B, 2, n, n): old, new basis per block; None:
        identity side) are given to it; its output is written into the members' m."""
        x = m.reshape(m.shape[0], m.shape[1], -1)
        a, b = (list(pairs) + [None] * (2 - len(pairs)))[:2]
        # the entries themselves: a reader of them waits for the job (nothing re-points them
        # before it, the placement settles jobs first)
        into = [dict.__getitem__(self.state[p], K.key(j, "exp_avg")) for p, j in members]
        return WorkerJob(ROTATION, members=list(members),
                         keys=[(p, K.key(j, "exp_avg")) for p, j in members],
                         inputs=(x, a, b), into=(into,), donate=("f", "q", "b"))

    def factor_emas_offloaded(self, group: dict, members: list, g: torch.Tensor,
                              factors: list, steps: list) -> bool:
        """Hand this step's L, R update to a worker (``factor_ema_job``)? On a step whose
        factors no REFRESH reads at its end (none comes due: ``Cadence.comes_due``; one that
        does is read at once), matrix blocks with a factor, the factor stacks updated in place
        as the state itself, where the rule allows (``BackgroundJobs.on_worker``, runtime
        ``factor_emas="workers"``)."""
        if g.dim() != 3 or all(f is None for f in factors):
            return False
        if any(self.cadence.comes_due(group, k) for k in steps):
            return False
        return self.background.on_worker(
            FACTOR_EMAS, members, 2, dtype=g.dtype,
            in_place=tuple(("GG", i, f) for i, f in enumerate(factors) if f is not None))

    def factor_ema_job(self, members: list, g: torch.Tensor, factors: list,
                       beta: float) -> WorkerJob:
        """L = beta L + (1 - beta) G G^T, R = beta R + (1 - beta) G^T G as a ``gram_ema`` job,
        in the state's own factor memory (``factors``: the packed stacks; None: no factor),
        which the op updates in place; ``g`` (a stack made for this step) is given to it.
        Started after the group's last stack, so that it does not compete with the step for
        the memory bus."""
        return WorkerJob(FACTOR_EMAS, members=list(members),
                         keys=[(p, K.key(j, "GG", i)) for p, j in members
                               for i, f in enumerate(factors) if f is not None],
                         inputs=(g, factors[0], factors[1]), into=(factors[0], factors[1]),
                         p=beta, eps=1.0 - beta, donate=("f",))


def _stacks_of(state, placement, outputs: dict):
    """Group the blocks of a round's outputs into stacks of one shape, dtype and factor dims:
    yields (members, has_factor)."""
    stacks: dict = {}
    for p, outs in outputs.items():
        st = state[p]
        for j in sorted({j for j, _ in outs}):
            ref = st[K.key(j, "exp_avg")]
            has = tuple(placement.root_has(p, K.key(j, "Q", i)) for i in range(ref.dim()))
            stacks.setdefault((tuple(ref.shape), ref.dtype, ref.device, has), []).append((p, j))
    for (_, _, _, has), members in stacks.items():
        yield members, list(has)


@register
class SOAP(AsteriaOptimizer):
    """SOAP with its REFRESH (QR power iteration of the eigenbasis) on the Asteria engine.

    Keyword names and defaults are those of nikhilvyas/SOAP. Asteria's own: ``block_size``
    (split matrices into blocks of at most this size per dimension) and ``runtime`` (the
    runtime config dict, see ``asteria.RuntimeConfig``).

    Param group key ``"algorithm"``: ``"adamw"`` sends every parameter of the group, 2-D ones
    too (embeddings, an output head), to AdamW with the group's lr, betas, eps and
    weight_decay, exactly as 1-D parameters go (OLMo-core's convention); any other value, or
    none, preconditions the group as usual.
    """

    METHOD = SOAPMethod

    def __init__(self, params, lr: float = 3e-3, betas=(0.95, 0.95), shampoo_beta: float = -1,
                 eps: float = 1e-8, weight_decay: float = 0.01, precondition_frequency: int = 10,
                 max_precond_dim: int = 10000, merge_dims: bool = False,
                 precondition_1d: bool = False, normalize_grads: bool = False,
                 correct_bias: bool = True, *, block_size: Optional[int] = None, runtime=None):
        defaults = dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps,
                        weight_decay=weight_decay, precondition_frequency=precondition_frequency,
                        max_precond_dim=max_precond_dim, merge_dims=merge_dims,
                        precondition_1d=precondition_1d, normalize_grads=normalize_grads,
                        correct_bias=correct_bias, block_size=block_size)
        super().__init__(params, defaults, runtime)
