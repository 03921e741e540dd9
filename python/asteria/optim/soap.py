"""``asteria.SOAP``: Shampoo's eigenbasis with Adam in it (Vyas et al., ICLR 2025).

Owns SOAP's hyperparameters, per-block state layout and the install of a refreshed basis; the
math is in ``functional`` (soap_init / soap_step / soap_install), the scheduling in
``schedule``. Two pieces of a step's work may run on the pool's workers while the next forward
and backward run (docs/departures.md), where the schedule puts a job that writes state on a
worker (``Schedule.on_worker``: libasteria's pool, host parameters) and the job fits its op: at
an install, m's re-expression in the new basis (``soap_rotate`` jobs; an install deferred to
the next step's start, S = 0, hands it to a worker too: that step updates the factors and
projects the gradient first and reads m, waiting for the job, only then); with runtime
``factor_emas="workers"``, on a step whose factors no REFRESH reads at its end, the factor EMAs
L, R (``gram_ema`` jobs, in place in the packed state, ``Placement.is_state``). Each job is registered in the optimizer's
``PendingWrites`` (``schedule.writes``: ``_Rotation`` / ``_FactorEma``, with the state keys it
writes and how its result is applied), so a read of what it writes waits for it; the next step takes
them all first. A factor EMA is made due in its stack's ``step_blocks`` and started once the
group's stacks have all run (``schedule.writes.start_due``).

State of a preconditioned parameter: ``step`` (k) and per block j ``b{j}.exp_avg`` (m),
``b{j}.exp_avg_sq`` (v), both in the rotated basis, and for every dimension i with a factor
``b{j}.GG{i}`` (L, R, ...) and ``b{j}.Q{i}`` (its eigenbasis); with S > 0 also the fixed keys
of a refresh in flight (``pending.install_in``, ``pending.age``, ``b{j}.pending{i}.0`` (Q) /
``.1`` (the int64 sort order), ``b{j}.pending{i}_ok``; see ``AsteriaOptimizer``). 1-D parameters
(unless ``precondition_1d``), 0-D ones and every parameter of a group with
``"algorithm": "adamw"`` are AdamW with state ``step``, ``exp_avg``, ``exp_avg_sq``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch

from asteria.optim import _layout as K
from asteria.optim import functional as F
from asteria.refresh.engine import SubmitOptions
from asteria.refresh.ops import soap_rotate
from asteria.optim._writes import Write
from asteria.optim._state import real
from asteria.optim.method import (INIT, Field, Method, check_common, eigh_input, is_int,
                                  register, require)
from asteria.optim.optimizer import AsteriaOptimizer


# SOAP's worker jobs hand their results back in host memory (they write host state) and give
# the worker the inputs made for them: a rotation all three, a factor EMA its gradient stack
_GIVEN_TO_WORKER = SubmitOptions(host_outputs=True, donate=("f", "q", "b"))
_G_TO_WORKER = SubmitOptions(host_outputs=True, donate=("f",))


@dataclasses.dataclass(eq=False)  # a job is itself: no field-wise (tensor) comparison
class _Rotation(Write):
    """One soap_rotate job, started at once: it writes the members' m (``b{j}.exp_avg``);
    its inputs are kept for a fallback on failure, with the block shape of m."""

    method: "SOAPMethod"  # applies the result
    ticket: int
    members: list
    inputs: tuple
    shape: tuple

    def __post_init__(self):
        self.keys = [(p, K.key(j, "exp_avg")) for p, j in self.members]

    def apply(self, result):
        self.method.finish_rotation(self, result)


@dataclasses.dataclass(eq=False)  # a job is itself: no field-wise (tensor) comparison
class _FactorEma(Write):
    """One gram_ema job, due once the group's stacks have all run: it writes the members'
    factors (``b{j}.GG{i}``); the gradient stack and the factor stacks (the state's packed
    memory, updated in place; None: no factor) and beta are kept to redo the update here
    should the job fail."""

    method: "SOAPMethod"  # starts the job and applies its result
    members: list
    g: torch.Tensor
    factors: list
    beta: float
    ticket: Optional[int] = None

    def __post_init__(self):
        self.keys = [(p, K.key(j, "GG", i)) for p, j in self.members
                     for i, f in enumerate(self.factors) if f is not None]

    def start(self):
        self.method.submit_factor_ema(self)

    def apply(self, result):
        self.method.finish_factor_ema(self, result)


class SOAPMethod(Method):
    """SOAP's math (``functional.soap_*``) and its two kinds of worker jobs."""

    NAME = "soap"
    REFRESH_OP = ("soap_qr", 0.0)
    weights_in_place = True  # soap_step updates a list of whole parameters where they are
    # m and v in the rotated basis; L, R, ... and their eigenbases (a fake step's factors are
    # zero, its bases the identity, from them)
    STATE = (Field("exp_avg", "moments", zeros=True),
             Field("exp_avg_sq", "moments", zeros=True),
             Field("GG", "factors", per_dim=True, fake_zero=True),
             Field("Q", "eigenbases", per_dim=True))
    EXTRA_OUTPUTS = (torch.int64,)  # soap_qr: (Q, sort order)

    def check(self, group: dict) -> None:
        check_common(group)
        sb = group["shampoo_beta"]
        require("shampoo_beta", isinstance(sb, (int, float)) and (sb == -1 or 0.0 <= sb < 1.0),
                sb, "-1 (use betas[1]) or a float in [0, 1)")
        require("eps", isinstance(group["eps"], (int, float)) and group["eps"] >= 0.0,
                group["eps"], "a float >= 0")
        md = group["max_precond_dim"]
        require("max_precond_dim", is_int(md) and md >= 1, md, "an integer >= 1")

    @staticmethod
    def shampoo_beta(group: dict) -> float:
        sb = group["shampoo_beta"]
        return sb if sb >= 0 else group["betas"][1]

    def uses_adamw(self, p, group):
        d = real(p).dim()
        return d == 0 or (d == 1 and not group["precondition_1d"])

    def merge_dims(self, group):
        return group["merge_dims"]

    def init_blocks(self, group, members, g):
        has = self.has_factor(g.shape[1:], group)
        factors = F.soap_init(g, has, shampoo_beta=self.shampoo_beta(group))
        return self.init_bases(members, factors)

    def step_blocks(self, group, members, w, g, steps):
        has = self.has_factor(g.shape[1:], group)
        # the state's packed stacks, updated in place (copies only for tiered blocks)
        v = self.placement.stack(members, "exp_avg_sq", view=True)
        factors = self.placement.stack_dims(members, "GG", has, view=True)
        bases = self.placement.stack_dims(members, "Q", has, view=True)
        offload = self.factor_offload(group, members, g, factors, steps)

        def moment():
            # m may still be re-expressed on a worker (an install deferred to this step):
            # read once soap_step has done what does not need it
            for p, j in members:
                self.schedule.writes.settle(p, K.key(j, "exp_avg"))
            return self.placement.stack(members, "exp_avg", view=True)

        m = F.soap_step(w, g, moment, v, [None] * len(factors) if offload else factors, bases,
                        steps, lr=float(group["lr"]),
                        beta1=group["betas"][0], beta2=group["betas"][1],
                        shampoo_beta=self.shampoo_beta(group), eps=group["eps"],
                        weight_decay=group["weight_decay"], correct_bias=group["correct_bias"],
                        normalize_grads=group["normalize_grads"])
        self.placement.unstack(members, "exp_avg", m)
        self.placement.unstack(members, "exp_avg_sq", v)
        for i, f in enumerate(factors):
            if f is not None:
                self.placement.unstack(members, "GG", f, dim=i)
        if offload:  # started once the group's stacks have all run (schedule.writes.start_due)
            self.schedule.writes.defer(_FactorEma(self, list(members), g, list(factors),
                                                  self.shampoo_beta(group)))

    def refresh_input(self, kind, p, j, dim):
        st = self.state[p]
        f = st[K.key(j, "GG", dim)]
        if kind == INIT:
            return "eigh", eigh_input(f), None, 0.0, 0.0
        return "soap_qr", f, self.placement.root_for_job(p, K.key(j, "Q", dim)), 0.0, 0.0

    def install(self, kind, outputs):
        if kind == INIT:
            self.install_bases(outputs)
            return
        for all_members, has in _stacks_of(self.state, self.placement, outputs):
            for members in self.placement.chunks(all_members):
                self.install_chunk(members, has, outputs)

    def install_chunk(self, members, has, outputs):
        m, v = self.placement.stack(members, "exp_avg"), self.placement.stack(members, "exp_avg_sq")
        offload = self.rotation_offload(members, len(has))
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
                # m is re-expressed in the basis as it will be stored (tier_dtype)
                qs.append(q if out is None else
                          self.placement.as_stored(p, K.key(j, "Q", i), out[0].to(q.device)))
                ps.append(torch.arange(q.shape[0], device=q.device) if out is None
                          else out[1].to(q.device))
            new.append(torch.stack(qs, out=None if pairs[i] is None else pairs[i][:, 1]))
            perms.append(torch.stack(ps))
        if offload:
            # v permuted here (cheap), m re-expressed by a worker while the next forward and
            # backward run; the next read of m waits for it (submit_rotation)
            F.soap_permute(v, perms)
            if self.placement.on_nvme(members):
                # bases on NVMe trade the overlap of one install's rotations for memory: one
                # rotation in flight: the previous chunk's m, pairs and result are let go
                # before this chunk's are made (memory for one chunk, not one round)
                self.schedule.writes.settle_all()
            self.submit_rotation(members, m, pairs)
        else:
            F.soap_install(m, v, old, new, perms)
            self.placement.unstack(members, "exp_avg", m)
        self.placement.unstack(members, "exp_avg_sq", v)
        for i, q in enumerate(new):
            if q is not None:
                self.placement.unstack(members, "Q", q, dim=i)

    # ---- m's re-expression on the workers ------------------------------------------------------
    def rotation_offload(self, members: list, ndim: int) -> bool:
        """Offload the re-expression of these members' m? Blocks of at most 2 dims (the op's
        layout), where the schedule puts such a job on a worker (``Schedule.on_worker``)."""
        return ndim <= 2 and self.schedule.on_worker(members)

    def submit_rotation(self, members: list, m: torch.Tensor, pairs: list) -> None:
        """Start m_new = Q_new^T (Q_old m Q_old^T) Q_new (per side) on a worker; m stays as it
        is until a read of it waits for the result (``schedule.writes``). ``m`` (a stack made
        for this) and ``pairs`` ((B, 2, n, n): old, new basis per block; None: identity side)
        are given to the job: the worker reads them in place, nothing here writes them."""
        x = m.reshape(m.shape[0], m.shape[1], -1)
        pairs = list(pairs) + [None] * (2 - len(pairs))
        ticket = self.schedule.submit_write("soap_rotate", members, x, pairs[0], b=pairs[1],
                                            opts=_GIVEN_TO_WORKER)
        self.count("rotations_submitted")
        self.schedule.writes.add(_Rotation(self, ticket, list(members),
                                           (x, pairs[0], pairs[1]), tuple(m.shape[1:])))

    def finish_rotation(self, rot: _Rotation, res) -> None:
        """Write a rotation job's result into m; a failed job is redone here with torch (the
        result is the same math; the state must not keep the old basis' m)."""
        if res.status == 0:
            out = res.outputs[0]
        else:
            self.count("rotation_failures")
            warnings.warn(f"Asteria: re-expressing SOAP's first moment on a worker failed "
                          f"({res.error}); done on the training thread instead",
                          RuntimeWarning, stacklevel=3)
            out = soap_rotate(*rot.inputs)[0]
        for i, (p, j) in enumerate(rot.members):
            dst = dict.__getitem__(self.state[p], K.key(j, "exp_avg"))
            dst.copy_(out[i].reshape(rot.shape))

    # ---- the factor EMAs on the workers ---------------------------------------------------------
    def factor_offload(self, group: dict, members: list, g: torch.Tensor, factors: list,
                        steps: list) -> bool:
        """Hand this step's L, R update to a worker? With runtime ``factor_emas="workers"``,
        matrix blocks of float32 / float64, factor stacks that are the state itself (the
        packed state: the worker writes the state), no REFRESH due at this step's end (it
        reads the factors at once: the update stays here), where the schedule puts such a
        job on a worker (``Schedule.on_worker``)."""
        if (self.config.factor_emas != "workers"
                or g.dim() != 3 or g.dtype not in (torch.float32, torch.float64)
                or all(f is None for f in factors)):
            return False
        freq = self.schedule.frequency(group)
        if any(k % freq == 0 for k in steps) or not self.schedule.on_worker(members):
            return False
        return all(f is None or (f.dtype == g.dtype and f.is_contiguous()
                                 and self.placement.is_state(members, "GG", i, f))
                   for i, f in enumerate(factors))

    def submit_factor_ema(self, job: _FactorEma) -> None:
        """Start a due factor EMA, L = beta L + (1 - beta) G G^T, R = beta R + (1 - beta) G^T G,
        on a worker, in the state's own factor memory: after the group's last stack
        (``schedule.writes.start_due``), so that it does not compete with the training thread's step
        for the memory bus. ``g`` (a stack made for this step) is given to the job; a read of
        a factor waits for it (``schedule.writes``)."""
        members, factors, beta = job.members, job.factors, job.beta
        job.ticket = self.schedule.submit_write("gram_ema", members, job.g, factors[0],
                                                b=factors[1], p=beta, eps=1.0 - beta,
                                                opts=_G_TO_WORKER)
        self.count("factor_emas_submitted")
        self.schedule.writes.add(job)

    def finish_factor_ema(self, job: _FactorEma, res) -> None:
        """Apply a gram_ema job's result. Its factors are updated where they are; a failed job
        has written nothing, and its update is done here with torch instead."""
        if res.status == 0:
            for f, out in zip(job.factors, res.outputs):
                if f is not None and out is not None and out.data_ptr() != f.data_ptr():
                    f.copy_(out)
            return
        self.count("factor_ema_failures")
        warnings.warn(f"Asteria: updating SOAP's factors on a worker failed ({res.error}); "
                      f"done on the training thread instead", RuntimeWarning, stacklevel=3)
        for i, f in enumerate(job.factors):
            if f is not None:
                F.ema_gram(f, job.g, i, job.beta, 1.0 - job.beta)


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
