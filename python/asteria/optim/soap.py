"""``asteria.SOAP``: Shampoo's eigenbasis with Adam in it (Vyas et al., ICLR 2025).

Owns SOAP's hyperparameters, per-block state layout and the install of a refreshed basis; the
math is in ``functional`` (soap_init / soap_step / soap_install), the scheduling in ``_base``.

State of a preconditioned parameter: ``step`` (k) and per block j ``b{j}.exp_avg`` (m),
``b{j}.exp_avg_sq`` (v), both in the rotated basis, and for every dimension i with a factor
``b{j}.GG{i}`` (L, R, ...) and ``b{j}.Q{i}`` (its eigenbasis); with S > 0 also the fixed keys
of a refresh in flight (``pending.install_in``, ``pending.age``, ``b{j}.pending{i}.0`` (Q) /
``.1`` (the int64 sort order), ``b{j}.pending{i}_ok``; see ``AsteriaOptimizer``). 1-D parameters
(unless ``precondition_1d``), 0-D ones and every parameter of a group with
``"algorithm": "adamw"`` are AdamW with state ``step``, ``exp_avg``, ``exp_avg_sq``.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from asteria.optim import functional as F
from asteria.optim._base import (INIT, AsteriaOptimizer, check_common, eigh_input, init_bases,
                                 install_bases, is_int, require)

_FACTOR = re.compile(r"b\d+\.GG\d+")


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

    _rotates_m = True

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

    def _check_hyperparameters(self, group: dict) -> None:
        check_common(group)
        sb = group["shampoo_beta"]
        require("shampoo_beta", isinstance(sb, (int, float)) and (sb == -1 or 0.0 <= sb < 1.0),
                sb, "-1 (use betas[1]) or a float in [0, 1)")
        require("eps", isinstance(group["eps"], (int, float)) and group["eps"] >= 0.0,
                group["eps"], "a float >= 0")
        md = group["max_precond_dim"]
        require("max_precond_dim", is_int(md) and md >= 1, md, "an integer >= 1")

    @staticmethod
    def _shampoo_beta(group: dict) -> float:
        sb = group["shampoo_beta"]
        return sb if sb >= 0 else group["betas"][1]

    def _uses_adamw(self, p, group):
        return p.dim() == 0 or (p.dim() == 1 and not group["precondition_1d"])

    def _adamw_hparams(self, group):
        return group["betas"][0], group["betas"][1], group["eps"]

    def _output_specs(self, p, group, d):
        return [((d, d), p.dtype), ((d,), torch.int64)]  # soap_qr: (Q, sort order)

    def _fake_step_tensors(self, p):
        st = self.state[p]  # a fake step's factors are zero (its bases the identity, from them)
        return [v for k, v in dict.items(st) if _FACTOR.fullmatch(k)]

    def _max_dim(self, group):
        return group["max_precond_dim"]

    def _merge_dims(self, group):
        return group["merge_dims"]

    def _create_state(self, p, group, layout):
        st = self.state[p]
        st["step"] = 0
        for j, shape in enumerate(layout.block_shapes):
            st[f"b{j}.exp_avg"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
            st[f"b{j}.exp_avg_sq"] = torch.zeros(shape, dtype=p.dtype, device=p.device)

    def _state_spec(self, p, group, layout):
        dt = p.dtype
        out = []
        for j, shape in enumerate(layout.block_shapes):
            out += [(f"b{j}.exp_avg", "moments", shape, dt),
                    (f"b{j}.exp_avg_sq", "moments", shape, dt)]
            for i, has in enumerate(self._has_factor(shape, group)):
                if has:
                    out += [(f"b{j}.GG{i}", "factors", (shape[i], shape[i]), dt),
                            (f"b{j}.Q{i}", "eigenbases", (shape[i], shape[i]), dt)]
        return out

    def _init_blocks(self, group, members, g):
        has = self._has_factor(g.shape[1:], group)
        factors = F.soap_init(g, has, shampoo_beta=self._shampoo_beta(group))
        return init_bases(self, members, factors, "GG")

    def _step_blocks(self, group, members, w, g, steps):
        has = self._has_factor(g.shape[1:], group)
        m, v = self._stack(members, "exp_avg"), self._stack(members, "exp_avg_sq")
        factors = self._stack_dims(members, "GG", has)
        bases = self._stack_dims(members, "Q", has)
        F.soap_step(w, g, m, v, factors, bases, steps, lr=float(group["lr"]),
                    beta1=group["betas"][0], beta2=group["betas"][1],
                    shampoo_beta=self._shampoo_beta(group), eps=group["eps"],
                    weight_decay=group["weight_decay"], correct_bias=group["correct_bias"],
                    normalize_grads=group["normalize_grads"])
        self._unstack(members, "exp_avg", m)
        self._unstack(members, "exp_avg_sq", v)
        for i, f in enumerate(factors):
            if f is not None:
                self._unstack(members, f"GG{i}", f)

    def _refresh_input(self, kind, p, j, dim):
        st = self.state[p]
        f = st[f"b{j}.GG{dim}"]
        if kind == INIT:
            return "eigh", eigh_input(f), None, 0.0, 0.0
        return "soap_qr", f, self._root_for_job(p, f"b{j}.Q{dim}"), 0.0, 0.0

    def _install(self, kind, outputs):
        if kind == INIT:
            install_bases(self, outputs)
            return
        for all_members, has in _stacks_of(self, outputs):
            for members in self._chunks(all_members):
                self._install_chunk(members, has, outputs)

    def _install_chunk(self, members, has, outputs):
        m, v = self._stack(members, "exp_avg"), self._stack(members, "exp_avg_sq")
        offload = self._rotation_offload(members, len(has))
        # offloaded: the old and new bases go straight into the rotation job's (B, 2, n, n)
        # pairs, which the worker reads in place (no stacks of their own, no snapshot)
        pairs = [torch.empty((len(members), 2, m.shape[i + 1], m.shape[i + 1]), dtype=m.dtype)
                 if offload and h else None for i, h in enumerate(has)]
        old = [self._stack(members, f"Q{i}", out=None if pr is None else pr[:, 0]) if h
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
                qs.append(q if out is None else out[0].to(q.device))
                ps.append(torch.arange(q.shape[0], device=q.device) if out is None
                          else out[1].to(q.device))
            new.append(torch.stack(qs, out=None if pairs[i] is None else pairs[i][:, 1]))
            perms.append(torch.stack(ps))
        if offload:
            # v permuted here (cheap), m re-expressed by a worker while the next forward and
            # backward run; the next read of m waits for it (AsteriaOptimizer._submit_rotation)
            F.soap_permute(v, perms)
            self._submit_rotation(members, m, pairs)
        else:
            F.soap_install(m, v, old, new, perms)
            self._unstack(members, "exp_avg", m)
        self._unstack(members, "exp_avg_sq", v)
        for i, q in enumerate(new):
            if q is not None:
                self._unstack(members, f"Q{i}", q)


def _stacks_of(opt, outputs: dict):
    """Group the blocks of a round's outputs into stacks of one shape, dtype and factor dims:
    yields (members, has_factor)."""
    stacks: dict = {}
    for p, outs in outputs.items():
        st = opt.state[p]
        for j in sorted({j for j, _ in outs}):
            ref = st[f"b{j}.exp_avg"]
            has = tuple(opt._root_has(p, f"b{j}.Q{i}") for i in range(ref.dim()))
            stacks.setdefault((tuple(ref.shape), ref.dtype, ref.device, has), []).append((p, j))
    for (_, _, _, has), members in stacks.items():
        yield members, list(has)
