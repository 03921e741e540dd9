"""Canonical bases for the null space of a rank-deficient factor: the torch side of
src/linalg_basis.c's canonical bases (docs/departures.md, "SOAP's basis on a rank-deficient
factor").

Owns: the rule that makes SOAP's eigenbasis a function of its factor (and of the previous basis)
where the factor is rank-deficient, for the ``eigh``, ``soap_qr`` and ``kl_qr``
references of ``asteria.refresh.ops``. A factor built from fewer rows than its width has a null space; the
eigensolver's or the QR's columns there are rounding noise turned into unit vectors, different
for every LAPACK, process count and executor, and SOAP's Adam statistics, kept elementwise in
that basis, inherit the difference. Here those columns are replaced by a basis that depends
only on the factor's range and on candidate vectors the caller supplies:

- ``eigh``: eigenvalues |w| <= n eps_m max |w| are null (``null_tol``, the floor the inverse
  roots use; absolute, so that an indefinite matrix's negative eigenvalues stay in the range); the range part
  is the other eigenvectors; the null part is ``complete`` of the identity's
  columns at the null positions (the basis SOAP starts from).
- ``soap_qr`` (``kl_qr`` alike, with no sorting): C = F Q[:, perm]; a column of C whose QR diagonal |R_kk| <= 8 n eps_m max|R| (``QR_TOL_SAFETY``) is
  dependent on the columns before it. The range part is the QR of the independent columns
  alone (so no noise column is orthogonalised against), placed at their positions; the null
  part is ``complete`` of the previous basis's columns at the dependent positions, so a
  direction that stays null keeps its statistics.
- ``complete(U, cand)``: Gram-Schmidt of the candidates, then of the identity's columns, in that
  fixed order, each projected off U and off the vectors accepted before it (twice, for
  orthogonality to rounding) and accepted when its residual exceeds 1 / (2 sqrt(n)); with that
  threshold one pass over the identity always fills the space. Signs are Gram-Schmidt's
  (positive R diagonal). When every candidate is accepted this is one QR of the projected
  candidates, which is how it is computed.

A full-rank factor takes none of this: its result is the plain decomposition's, bit for bit.
When the dependent columns are the trailing ones (the usual case: SOAP sorts its columns by
decreasing diag(Q^T F Q)), the full QR already holds the range part and an orthonormal basis W
of its complement, and the completion is W qr(W^T cand): a d x d QR instead of two n-row ones.
Batched: only the rank-deficient entries of a batch take the per-entry path. May call: torch.
"""

from __future__ import annotations

import math

import torch

#: a refresh's dependent columns are those within this many times ``null_tol``: a truly
#: dependent column's residual carries the rounding of the factor's accumulation (its EMA over
#: steps) as well as the QR's own, measured at up to 42 eps_m max|R| for n = 24 in float64
#: (src/linalg_basis.c's QR_TOL_SAFETY)
QR_TOL_SAFETY = 8

def null_tol(scale: torch.Tensor, n: int) -> torch.Tensor:
    """n eps_m scale: what is rounding noise next to ``scale`` in a factor of size n (the floor
    of the inverse roots; eigh's null space)."""
    return n * torch.finfo(scale.dtype).eps * scale


def accept_tol(n: int) -> float:
    """A completion candidate's residual must exceed this (see the module header)."""
    return 0.5 / math.sqrt(n)


def _project_off(u: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y minus its component in span(u) (u orthonormal columns), done twice."""
    if u.shape[-1] == 0:
        return y
    y = y - u @ (u.transpose(-1, -2) @ y)
    return y - u @ (u.transpose(-1, -2) @ y)


def complete(u: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (n, n - r) of the complement of span(u) (u: (n, r) orthonormal)
    from the candidates (n, c), then the identity's columns (module header)."""
    n, r = u.shape
    need = n - r
    if need == 0:
        return u.new_zeros(n, 0)
    delta = accept_tol(n)
    if cand.shape[1] == need:
        qy, ry = torch.linalg.qr(_project_off(u, cand))
        rd = ry.diagonal()
        if bool((rd.abs() > delta).all()):
            return qy * torch.sign(rd)
    basis = torch.empty(n, n, dtype=u.dtype, device=u.device)  # u, then what is accepted
    basis[:, :r] = u
    have = r
    eye = torch.eye(n, dtype=u.dtype, device=u.device)
    for c in torch.cat([cand, eye], 1).unbind(1):
        y = _project_off(basis[:, :have], c.unsqueeze(1))
        nrm = float(torch.linalg.vector_norm(y))
        if nrm > delta:
            basis[:, have:have + 1] = y / nrm
            have += 1
            if have == n:
                break
    return basis[:, r:]


def _with_null(range_cols: torch.Tensor, null: torch.Tensor, null_cols: torch.Tensor) -> torch.Tensor:
    """The (n, n) basis with range_cols at the positions not in the mask null, null_cols at
    those in it."""
    out = torch.empty(null.shape[0], null.shape[0], dtype=range_cols.dtype,
                      device=range_cols.device)
    out[:, ~null] = range_cols
    out[:, null] = null_cols
    return out


def eigh_basis(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """w (batch, n) descending, q (batch, n, n) its eigenvectors -> q with the null space of
    each rank-deficient entry given the canonical basis."""
    n = w.shape[-1]
    null = w.abs() <= null_tol(w.abs().amax(-1, keepdim=True), n)
    if not bool(null.any()):
        return q
    q = q.clone()
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    for b in null.any(-1).nonzero().flatten().tolist():
        keep = ~null[b]
        q[b] = _with_null(q[b][:, keep], null[b], complete(q[b][:, keep], eye[:, null[b]]))
    return q


def _independent(c: torch.Tensor, dep: torch.Tensor, tol: torch.Tensor):
    """QR of the columns of c (n, n) not marked in dep, marking any found dependent there too
    until none is: (their Q, the final mask)."""
    dep = dep.clone()
    while True:
        keep = (~dep).nonzero().flatten()
        if keep.numel() == 0:
            return c.new_zeros(c.shape[0], 0), dep
        u, r = torch.linalg.qr(c[:, keep])
        bad = r.diagonal().abs() <= tol
        if not bool(bad.any()):
            return u, dep
        dep[keep[bad]] = True


def qr_basis(c: torch.Tensor, q_prev: torch.Tensor) -> torch.Tensor:
    """Q of the QR of each c (batch, n, n), with dependent columns given the canonical basis;
    q_prev (batch, n, n): the previous basis with columns in c's order (the candidates)."""
    n = c.shape[-1]
    qn, r = torch.linalg.qr(c)
    rd = r.diagonal(dim1=-2, dim2=-1).abs()
    tol = QR_TOL_SAFETY * null_tol(rd.amax(-1, keepdim=True), n)
    dep = rd <= tol
    if not bool(dep.any()):
        return qn
    qn = qn.clone()
    for b in dep.any(-1).nonzero().flatten().tolist():
        trailing = _complete_trailing(qn[b], dep[b], q_prev[b])
        if trailing is not None:
            qn[b] = trailing
            continue
        u, d = _independent(c[b], dep[b], tol[b])
        qn[b] = _with_null(u, d, complete(u, q_prev[b][:, d]))
    return qn


def _complete_trailing(q: torch.Tensor, dep: torch.Tensor, q_prev: torch.Tensor):
    """The common case: the dependent columns are the trailing n - m (m > 0), so the QR of the
    independent ones is q's first m columns and its others, W, are an orthonormal basis of
    their complement; the completion is then W qr(W^T cand) with Gram-Schmidt's signs. None
    where that does not apply or a candidate falls short (the general path decides then)."""
    n = q.shape[-1]
    m = int((~dep).sum())
    if m == 0 or bool(dep[:m].any()):
        return None
    w = q[:, m:]
    qm, rm = torch.linalg.qr(w.transpose(0, 1) @ q_prev[:, m:])
    rd = rm.diagonal()
    if not bool((rd.abs() > accept_tol(n)).all()):
        return None
    out = q.clone()
    out[:, m:] = w @ (qm * torch.sign(rd))
    return out
