"""Functional step kernels of SOAP, Shampoo and KL-Shampoo (DESIGN.md, "The optimizers").

Owns the math, nothing else: no optimizer state, no engine, no scheduling. The optimizer classes
stack same-shape blocks and call these kernels once per stack; tests may call them directly.

Conventions
 - A stack ``x`` has shape ``(B, d_0, ..., d_{r-1})``: B blocks of one shape.
 - Per-dimension matrices (factors L/R/S, bases Q, roots) come as a list with one entry per
   block dimension: a ``(B, d_i, d_i)`` tensor, or ``None`` for a dimension without a factor
   (larger than max_precond_dim: identity).
 - ``steps``: each block's step count k after this step's increment (python ints), so blocks of
   parameters that skipped a step (non-finite gradient) can share a stack.
 - Kernels update their tensor arguments in place.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.optim.adamw import adamw as _torch_adamw

Mats = Sequence[Optional[torch.Tensor]]


def mode_mul(x: torch.Tensor, m: torch.Tensor, dim: int) -> torch.Tensor:
    """Contract block dimension ``dim`` of ``x`` with the first index of ``m`` (B, d, e):
    ``y[.., b, ..] = sum_a x[.., a, ..] m[a, b]``; for a matrix and dim 0 that is ``m^T x``."""
    if x.dim() == 3:  # a stack of matrices: one bmm, operands as (transposed) views, no copies
        return torch.bmm(m.transpose(1, 2), x) if dim == 0 else torch.bmm(x, m)
    return _mode_mul_nd(x, m, dim)


def _mode_mul_nd(x: torch.Tensor, m: torch.Tensor, dim: int) -> torch.Tensor:
    """mode_mul for blocks of any rank: dimension ``dim`` moved last, one bmm, moved back."""
    xm = x.movedim(dim + 1, -1)
    shape = xm.shape
    y = torch.bmm(xm.reshape(shape[0], -1, shape[-1]), m)
    return y.reshape(*shape[:-1], m.shape[-1]).movedim(-1, dim + 1)


def project(x: torch.Tensor, bases: Mats) -> torch.Tensor:
    """Coordinates in the eigenbases: ``Q_L^T X Q_R`` for a matrix."""
    for i, q in enumerate(bases):
        if q is not None:
            x = mode_mul(x, q, i)
    return x


def project_back(x: torch.Tensor, bases: Mats) -> torch.Tensor:
    """Back from the eigenbases: ``Q_L X Q_R^T`` for a matrix."""
    for i, q in enumerate(bases):
        if q is not None:
            x = mode_mul(x, q.transpose(1, 2), i)
    return x


def gram(g: torch.Tensor, dim: int) -> torch.Tensor:
    """``G G^T`` along block dimension ``dim``, contracting every other dimension: (B, d, d)."""
    if g.dim() == 3:
        return torch.bmm(g, g.transpose(1, 2)) if dim == 0 else torch.bmm(g.transpose(1, 2), g)
    gm = g.movedim(dim + 1, 1).reshape(g.shape[0], g.shape[dim + 1], -1)
    return torch.bmm(gm, gm.transpose(1, 2))


def ema_gram(f: torch.Tensor, g: torch.Tensor, dim: int, beta: float, alpha: float,
              inplace: bool = True) -> torch.Tensor:
    """``beta * f + alpha * gram(g, dim)``, into f (``inplace``) or a new tensor. For a stack of
    matrices one baddbmm: the product accumulates into the result, no (B, d, d) temporary and
    no second pass over f."""
    if g.dim() == 3 and f.dtype == g.dtype:
        gt = g.transpose(1, 2)
        a, b = (g, gt) if dim == 0 else (gt, g)
        if inplace:
            return f.baddbmm_(a, b, beta=beta, alpha=alpha)
        return torch.baddbmm(f, a, b, beta=beta, alpha=alpha)
    if inplace:
        return f.mul_(beta).add_(gram(g, dim), alpha=alpha)
    return torch.add(f * beta, gram(g, dim), alpha=alpha)


def is_scaled_identity(f: torch.Tensor) -> list[bool]:
    """Per block: is ``f`` c*I (c = 0 included)? The identity is then a valid eigenbasis and no
    eigendecomposition is needed (the all-zero "fake step" of torch.distributed.checkpoint)."""
    diag = f.diagonal(dim1=1, dim2=2)
    off = (f - torch.diag_embed(diag)).flatten(1)
    return ((off == 0).all(1) & (diag == diag[:, :1]).all(1)).tolist()


def _per_block(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """A (B, 1, ..., 1) tensor broadcasting one scalar per block against ``like``."""
    t = torch.tensor(list(values), dtype=like.dtype, device=like.device)
    return t.view(-1, *([1] * (like.dim() - 1)))


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.square().flatten(1).mean(1).sqrt().view(-1, *([1] * (x.dim() - 1)))


def _frobenius(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.flatten(1), dim=1).view(-1, *([1] * (x.dim() - 1)))


# --------------------------------------------------------------------------------------------
# AdamW for 1-D (and 0-D) parameters: torch.optim.AdamW's update, over lists of any shapes.

def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor],
               exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
               steps: Sequence[int], *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float) -> None:
    """torch.optim.AdamW's own update (its functional form, the foreach path) on parameters
    whose step counts (after this step) are the ints ``steps``: the state keeps ints, torch's
    functional form takes step tensors it increments itself."""
    if not params:
        return
    counts = [torch.tensor(float(k - 1)) for k in steps]
    _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, [], counts, foreach=True, amsgrad=False,
                 beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                 maximize=False)


# --------------------------------------------------------------------------------------------
# SOAP

def soap_init(g: torch.Tensor, has_factor: Sequence[bool], *,
              shampoo_beta: float) -> list[Optional[torch.Tensor]]:
    """First step: L = lerp(0, G G^T, 1-b_s) (and R, and one per dimension of an N-D block)."""
    out: list[Optional[torch.Tensor]] = []
    for i, has in enumerate(has_factor):
        if has:
            c = gram(g, i)
            out.append(torch.zeros_like(c).lerp_(c, 1.0 - shampoo_beta))
        else:
            out.append(None)
    return out


def soap_step(w: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, factors: Mats, bases: Mats, steps: Sequence[int], *,
              lr: float, beta1: float, beta2: float, shampoo_beta: float, eps: float,
              weight_decay: float, correct_bias: bool, normalize_grads: bool) -> torch.Tensor:
    """One later SOAP step: L/R update with the current gradient, moments in the rotated
    basis, parameter update; its two halves one after the other (``soap_project``, then
    ``soap_moments`` and ``soap_update``: a caller whose m may still be in the making waits for
    it between them). The REFRESH (k % f == 0) is the caller's business. ``w``: the stack of
    weight blocks, or the list of the blocks themselves (each updated in place). Returns m."""
    gp = soap_project(g, factors, bases, shampoo_beta=shampoo_beta)
    soap_moments(exp_avg, exp_avg_sq, gp, beta1=beta1, beta2=beta2)
    del gp
    soap_update(w, exp_avg, exp_avg_sq, bases, steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, correct_bias=correct_bias,
                normalize_grads=normalize_grads)
    return exp_avg


def soap_project(g: torch.Tensor, factors: Mats, bases: Mats, *,
                 shampoo_beta: float) -> torch.Tensor:
    """The half of a SOAP step that reads neither moment: the factors' update with the
    current gradient (L = b L + (1-b) G G^T, ...; in place, the bases are separate tensors),
    then the gradient projected into the eigenbases (returned)."""
    for i, f in enumerate(factors):
        if f is not None:
            ema_gram(f, g, i, shampoo_beta, 1.0 - shampoo_beta)
    return project(g, bases)


def soap_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, gp: torch.Tensor, *,
                 beta1: float, beta2: float) -> None:
    """The update half's start: m and v, in the rotated basis, take the projected gradient
    ``gp`` (``soap_project``'s), in place. The caller lets go of ``gp`` after it."""
    exp_avg.lerp_(gp, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(gp, gp, value=1.0 - beta2)


def soap_update(w: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, bases: Mats,
                steps: Sequence[int], *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, correct_bias: bool, normalize_grads: bool) -> None:
    """The parameter update of a SOAP step from its moments (``soap_moments``'): the Adam
    direction m / (sqrt(v) + eps) projected back from the eigenbases, with bias correction and
    weight decay. ``w``: the stack of weight blocks, or the list of the blocks themselves
    (each updated in place)."""
    ws = w if isinstance(w, list) else None
    x = exp_avg_sq.sqrt().add_(eps)
    x = torch.div(exp_avg, x, out=x)  # m / (sqrt(v) + eps), in the one temporary
    if correct_bias:
        sizes = [lr * math.sqrt(1.0 - beta2 ** k) / (1.0 - beta1 ** k) for k in steps]
    else:
        sizes = [lr] * len(steps)
    decay = 1.0 - lr * weight_decay
    if (x.dim() == 3 and not normalize_grads and any(q is not None for q in bases)
            and all(t.dtype == x.dtype for t in (ws if ws is not None else [w]))):
        # W = (W - step U) - lr wd (W - step U) = decay W - decay step U: U's last product
        # accumulates into W (one baddbmm, or one addmm per block: no U, no separate update
        # or weight-decay pass)
        if ws is not None:  # one addmm per block, with its own step size
            alphas = [-decay * s for s in sizes]
        elif all(s == sizes[0] for s in sizes):
            alpha = -decay * sizes[0]
        else:
            x.mul_(_per_block(sizes, x))
            alpha = -decay
        q_l, q_r = bases
        a, b = (q_l, x) if q_r is None else (project_back(x, [q_l, None]), q_r.transpose(1, 2))
        if ws is not None:
            for wi, ai, bi, alpha in zip(ws, a.unbind(0), b.unbind(0), alphas):
                if wi.is_contiguous():
                    wi.addmm_(ai, bi, beta=decay, alpha=alpha)
                else:  # computed as for a contiguous one: a parameter's layout rounds alike
                    wi.copy_(torch.addmm(wi.contiguous(), ai, bi, beta=decay, alpha=alpha))
        else:
            w.baddbmm_(a, b, beta=decay, alpha=alpha)
    else:
        w_stack = torch.stack(ws) if ws is not None else w  # these updates take a stack
        u = project_back(x, bases)
        if normalize_grads:
            u = u / (_rms(u) + 1e-30)
        if all(s == sizes[0] for s in sizes):
            w_stack.add_(u, alpha=-sizes[0])
        else:
            w_stack.sub_(u.mul_(_per_block(sizes, u)))  # u is this step's own temporary
        w_stack.add_(w_stack, alpha=-lr * weight_decay)
        for wi, new in zip(ws or (), w_stack.unbind(0)):
            wi.copy_(new)


def soap_install(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, old_bases: Mats,
                 new_bases: Mats, perms: Sequence[Optional[torch.Tensor]]) -> None:
    """Side effects of installing a refreshed basis: v permuted by each factor's sort order s,
    m re-expressed in the new basis: m = Q_L,new^T (Q_L,old m Q_R,old^T) Q_R,new."""
    soap_permute(exp_avg_sq, perms)
    exp_avg.copy_(project(project_back(exp_avg, old_bases), new_bases))


def soap_permute(exp_avg_sq: torch.Tensor, perms: Sequence[Optional[torch.Tensor]]) -> None:
    """v permuted (in place) along each dimension i by the sort order s_i of its factor."""
    v = exp_avg_sq
    if v.device.type == "cpu":
        # on the host a per-block index_select (whole rows / columns) is about twice as fast
        # as the expanded-index gather, and each block permuted along all its dimensions and
        # written back at once (no stack per dimension) a third faster again
        for b, vb in enumerate(v.unbind(0)):
            x = vb
            for i, perm in enumerate(perms):
                if perm is not None:
                    x = x.index_select(i, perm[b])
            if x is not vb:
                vb.copy_(x)
        return
    for i, perm in enumerate(perms):  # on a device the gather is one kernel for the stack
        if perm is None:
            continue
        shape = [perm.shape[0]] + [1] * (v.dim() - 1)
        shape[i + 1] = perm.shape[1]
        v = torch.gather(v, i + 1, perm.view(shape).expand_as(v))
    exp_avg_sq.copy_(v)


# --------------------------------------------------------------------------------------------
# KL-Shampoo

def kl_init(g: torch.Tensor, has_factor: Sequence[bool], *,
            shampoo_beta: float) -> list[Optional[torch.Tensor]]:
    """First step: S_i = (1-b)/N_i * G G^T along dim i, N_i = product of the other dims."""
    numel = math.prod(g.shape[1:])
    out: list[Optional[torch.Tensor]] = []
    for i, has in enumerate(has_factor):
        if has:
            c = gram(g, i)
            alpha = (1.0 - shampoo_beta) / (numel / g.shape[i + 1])
            out.append(torch.zeros_like(c).add_(c, alpha=alpha))
        else:
            out.append(None)
    return out


def kl_clamp_max(size: int, max_clamp_value: float) -> float:
    """The reference's cap on s = lam^(-1/2) for a dimension of ``size``."""
    return float(max(10, min(size, max_clamp_value)))


def kl_step(w: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, factors: Mats,
            bases: Mats, scales: Sequence[Optional[torch.Tensor]], *, lr: float, beta1: float,
            shampoo_beta: float, eps: float, weight_decay: float, normalize_grads: bool,
            clamp: Sequence[Optional[float]]) -> torch.Tensor:
    """One later KL-Shampoo step. ``g``, ``exp_avg``, factors, bases and ``scales`` (s_i, shape
    (B, d_i)) are in the compute dtype; ``w`` in the parameter's. U uses the current Q, s; the
    factor and eigenvalue updates use the PREVIOUS Q, s (all of them, old values throughout).

    A block whose new state would not be finite (a finite gradient so large that a factor,
    an eigenvalue estimate lam or the update overflows; lam = inf gives s = 0, and the next
    step's lerp(1/s^2, ...) = inf - inf = NaN) is left as it was: weight, moment, factors and
    scales untouched. Decided per block on the device, without a sync. Returns the (B,) bool
    tensor of the blocks that were updated."""
    b = shampoo_beta
    shape = exp_avg.shape
    m_new = exp_avg.lerp(g, 1.0 - beta1)

    def broadcast(i: int, s: torch.Tensor) -> torch.Tensor:
        view = [shape[0]] + [1] * (len(shape) - 1)
        view[i + 1] = shape[i + 1]
        return s.view(view)

    p = torch.ones_like(m_new)
    for i, s in enumerate(scales):
        if s is not None:
            p = p * broadcast(i, s)
    p = p / (1.0 + eps * p)
    u = project_back(project(m_new, bases) * p, bases)
    if normalize_grads:
        u = u / (_rms(u) + 1e-30)

    def per_block(x: torch.Tensor) -> torch.Tensor:
        return torch.isfinite(x).reshape(x.shape[0], -1).all(dim=1)

    ok = per_block(u)
    numel = math.prod(shape[1:])
    h = project(g, bases)
    new_state = []
    for i, (f, s) in enumerate(zip(factors, scales)):
        if f is None:
            continue
        x = g
        hs = h
        for j, (qj, sj) in enumerate(zip(bases, scales)):
            if j != i and qj is not None:
                x = mode_mul(x, qj * sj.unsqueeze(1), j)
                hs = hs * broadcast(j, sj)
        f_new = ema_gram(f, x, i, b, (1.0 - b) / (numel / shape[i + 1]), inplace=False)
        other = [d for d in range(1, len(shape)) if d != i + 1]
        d = hs.square().mean(dim=other) if other else hs.square()
        lam = torch.lerp(1.0 / s.square(), d, 1.0 - b)
        s_new = 1.0 / torch.sqrt(lam)
        if clamp[i] is not None:
            s_new = s_new.clamp(max=clamp[i])
        ok = ok & per_block(f_new) & per_block(lam) & (lam > 0).all(dim=1)
        new_state.append((f, f_new))
        new_state.append((s, s_new))
    new_state.append((exp_avg, m_new))

    def keep_ok(x: torch.Tensor) -> torch.Tensor:
        return ok.view(-1, *([1] * (x.dim() - 1)))

    for old, new in new_state:
        old.copy_(torch.where(keep_ok(old), new, old))
    w.add_(torch.where(keep_ok(u), u, 0).to(w.dtype), alpha=-lr)
    w.add_(torch.where(keep_ok(w), w, 0), alpha=-lr * weight_decay)
    return ok


# --------------------------------------------------------------------------------------------
# Shampoo with Adam grafting

def shampoo_step(w: torch.Tensor, g: torch.Tensor, factors: Mats, roots: Optional[Mats],
                 momentum: torch.Tensor, grafting_v: torch.Tensor, steps: Sequence[int],
                 use_roots: Sequence[bool], *, lr: float, beta1: float, beta2: float,
                 grafting_beta2: float, grafting_epsilon: float, weight_decay: float) -> None:
    """One Shampoo step. ``roots`` is None while no inverse root was installed; ``use_roots``
    says per block whether the preconditioned direction applies (k >= start step)."""
    for i, f in enumerate(factors):
        if f is None:
            continue
        ema_gram(f, g, i, beta2, 1.0 if beta2 == 1.0 else 1.0 - beta2)  # b2 = 1: L += G G^T
    momentum.mul_(beta1).add_(g, alpha=1.0 - beta1)
    mh = momentum / _per_block([1.0 - beta1 ** k for k in steps], momentum)
    grafting_v.mul_(grafting_beta2).addcmul_(g, g, value=1.0 - grafting_beta2)
    bc2 = _per_block([1.0 - grafting_beta2 ** k for k in steps], grafting_v)
    a = mh / ((grafting_v / bc2).sqrt() + grafting_epsilon)
    d = a
    if roots is not None and any(use_roots):
        pre = mh
        for i, r in enumerate(roots):
            if r is not None:
                pre = mode_mul(pre, r, i)
        pn = _frobenius(pre)
        graft = torch.where(pn > 0, pre * (_frobenius(a) / pn), torch.zeros_like(pre))
        mask = torch.tensor(list(use_roots), device=w.device).view(-1, *([1] * (w.dim() - 1)))
        d = torch.where(mask, graft, a)
    w.add_(d, alpha=-lr)
    w.add_(w, alpha=-lr * weight_decay)


def shampoo_root_input(factor: torch.Tensor, step: int, beta2: float) -> torch.Tensor:
    """The REFRESH input L/c with the bias correction c = 1 - b2^k (1 for a running sum)."""
    c = (1.0 - beta2 ** step) if beta2 < 1.0 else 1.0
    return factor / c
