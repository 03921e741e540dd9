"""Plain-torch restatements of DESIGN.md's optimizer equations, for the numerics tests.

Written straight from the pseudo-code in DESIGN.md ("The optimizers (exact semantics)" and
"Staleness"), with the canonical bases of rank-deficient factors of docs/departures.md, one
parameter at a time, with no code shared with the ``asteria`` package, so a
test that compares the two checks the package against the specification, not against itself.

Each class takes a list of tensors (updated in place; they may be views of a model's
parameters, e.g. the blocks of a blocked matrix) and ``step(grads)`` applies one step. 1-D and
0-D tensors follow AdamW (decoupled weight decay first, as ``torch.optim.AdamW``).

``SOAPRef(one_sided=True)``: one-sided SOAP (``asteria.OneSidedSOAP``), a factor and eigenbasis
on the smallest dimension of each tensor only (the first of them on a tie, and only if it is at
most max_precond_dim); the other dimensions keep their coordinates.

``install_delay=k``: a REFRESH snapshotted at the end of step t (its inputs taken after that
step's factor update) is installed at the end of step t + k; at a step end, installs due come
before new snapshots. k = 0 is the synchronous reference. Steps are counted per ``step`` call.
"""

from __future__ import annotations

import math

import torch


def mode(x, m, d):
    """x with dimension d multiplied by matrix m: out[.., a, ..] = sum_b m[a, b] x[.., b, ..]."""
    return torch.movedim(torch.tensordot(m, x, dims=([1], [d])), 0, d)


def rotate(x, qs):
    """Q_0^T x Q_1 for a matrix (Q^T along every dimension that has a basis)."""
    for d, q in enumerate(qs):
        if q is not None:
            x = mode(x, q.T, d)
    return x


def rotate_back(x, qs):
    """Q_0 x Q_1^T for a matrix."""
    for d, q in enumerate(qs):
        if q is not None:
            x = mode(x, q, d)
    return x


def outer(g, d):
    """G G^T along dimension d (contracting all the others)."""
    others = [i for i in range(g.dim()) if i != d]
    return torch.tensordot(g, g, dims=(others, others))


# ---- canonical bases on rank-deficient factors (docs/departures.md) ----------------------------
# Where a factor is rank-deficient, the basis of its null space is chosen by a rule instead of
# being LAPACK's rounding noise: Gram-Schmidt, in order, of candidate vectors (the previous
# basis's columns there), then of the identity's columns, each accepted when its residual
# exceeds 1 / (2 sqrt(n)). Null eigenvalues: at most n eps_m of the largest; dependent QR
# columns: at most QR_TOL n eps_m.
QR_TOL = 8


def gram_schmidt(vectors, basis, threshold):
    """Gram-Schmidt (twice per vector) of vectors against basis and the ones accepted before;
    a vector whose residual norm is at most threshold is skipped. (accepted, skipped indices)."""
    out, skipped = [], []
    for i, v in enumerate(vectors):
        for _ in range(2):
            for u in list(basis) + out:
                v = v - (u @ v) * u
        nrm = torch.linalg.vector_norm(v)
        if nrm > threshold:
            out.append(v / nrm)
        else:
            skipped.append(i)
    return out, skipped


def null_complete(basis, cand, n, dtype):
    """n - len(basis) orthonormal vectors completing basis: the candidates, then the identity."""
    pool = list(cand) + list(torch.eye(n, dtype=dtype))
    acc, _ = gram_schmidt(pool, basis, 0.5 / math.sqrt(n))
    return acc[:n - len(basis)]


def _assemble(range_cols, null_cols, null_pos, n, dtype):
    out = torch.empty(n, n, dtype=dtype)
    ri, ni = iter(range_cols), iter(null_cols)
    for j in range(n):
        out[:, j] = next(ni) if j in null_pos else next(ri)
    return out


def canonical_qr(c, q_prev):
    """Q of the QR of c, whose columns that depend on the ones before them (residual at most
    QR_TOL n eps_m max|R_kk|) take the completion from q_prev's columns at their positions; the others
    are the QR of the independent columns alone."""
    n = c.shape[0]
    tol = QR_TOL * n * torch.finfo(c.dtype).eps * torch.linalg.qr(c).R.diagonal().abs().max()
    _, dep = gram_schmidt(list(c.T), [], tol)
    keep = [j for j in range(n) if j not in dep]
    rng = list(torch.linalg.qr(c[:, keep]).Q.T) if keep else []
    null = null_complete(rng, [q_prev[:, j] for j in dep], n, c.dtype)
    return _assemble(rng, null, set(dep), n, c.dtype)


def eigvecs_descending(f):
    """Eigenvectors in descending eigenvalue order; those of |w| <= n eps_m max|w| (the null
    space) completed from the identity's columns at their positions."""
    n = f.shape[0]
    w, v = torch.linalg.eigh(f)
    w, v = w.flip(0), v.flip(1)
    null = (w.abs() <= n * torch.finfo(f.dtype).eps * w.abs().max())
    null = null.nonzero().flatten().tolist()
    rng = [v[:, j] for j in range(n) if j not in null]
    eye = torch.eye(n, dtype=f.dtype)
    return _assemble(rng, null_complete(rng, [eye[:, j] for j in null], n, f.dtype), set(null),
                     n, f.dtype)


class _AdamW:
    def __init__(self, lr, beta1, beta2, eps, weight_decay):
        self.lr, self.beta1, self.beta2, self.eps, self.wd = lr, beta1, beta2, eps, weight_decay

    def step(self, w, g, st, lr):
        if not st:
            st.update(k=0, m=torch.zeros_like(w), v=torch.zeros_like(w))
        st["k"] += 1
        k = st["k"]
        w.mul_(1 - lr * self.wd)
        st["m"] = self.beta1 * st["m"] + (1 - self.beta1) * g
        st["v"] = self.beta2 * st["v"] + (1 - self.beta2) * g * g
        m_hat = st["m"] / (1 - self.beta1 ** k)
        v_hat = st["v"] / (1 - self.beta2 ** k)
        w.sub_(lr * m_hat / (v_hat.sqrt() + self.eps))


class _Reference:
    """The staleness schedule shared by the restatements."""

    def __init__(self, params, lr, install_delay):
        self.params = list(params)
        self.lr = lr
        self.install_delay = install_delay
        self.state = [dict() for _ in self.params]
        self.t = 0
        self.pending = []  # [(install step, param index, refresh result)]

    @torch.no_grad()
    def step(self, grads):
        self.t += 1
        due = []
        for i, (w, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            if w.dim() <= 1 and not self.precondition(w):
                self.adamw.step(w, g, self.state[i], self.lr)
            elif self.update(w, g, self.state[i]):
                due.append(i)
        for item in [p for p in self.pending if p[0] == self.t]:
            self.pending.remove(item)
            self.install(self.state[item[1]], item[2])
        for i in due:
            result = self.refresh(self.state[i])
            if self.install_delay == 0:
                self.install(self.state[i], result)
            else:
                self.pending.append((self.t + self.install_delay, i, result))

    def precondition(self, w):
        return False


class SOAPRef(_Reference):
    def __init__(self, params, lr=3e-3, betas=(0.95, 0.95), shampoo_beta=-1, eps=1e-8,
                 weight_decay=0.01, precondition_frequency=10, max_precond_dim=10000,
                 precondition_1d=False, normalize_grads=False, correct_bias=True,
                 install_delay=0, one_sided=False):
        super().__init__(params, lr, install_delay)
        self.one_sided = one_sided
        self.b1, self.b2 = betas
        self.bs = shampoo_beta if shampoo_beta >= 0 else betas[1]
        self.eps, self.wd, self.f = eps, weight_decay, precondition_frequency
        self.max_dim, self.pre1d = max_precond_dim, precondition_1d
        self.normalize, self.correct_bias = normalize_grads, correct_bias
        self.adamw = _AdamW(lr, betas[0], betas[1], eps, weight_decay)

    def precondition(self, w):
        return w.dim() == 1 and self.pre1d

    def has_factor(self, shape):
        """Which dimensions carry a factor: every one up to max_precond_dim; one-sided SOAP
        only the smallest (the first of them on a tie), if it is up to max_precond_dim."""
        if not self.one_sided:
            return [n <= self.max_dim for n in shape]
        side = list(shape).index(min(shape))
        return [d == side and n <= self.max_dim for d, n in enumerate(shape)]

    def update(self, w, g, st):
        if not st:  # first step: factors, eigenbases, no parameter update
            st["L"] = [torch.lerp(torch.zeros(n, n, dtype=g.dtype), outer(g, d), 1 - self.bs)
                       if has else None
                       for d, (n, has) in enumerate(zip(g.shape, self.has_factor(g.shape)))]
            st["Q"] = [None if f is None else
                       eigvecs_descending(f + 1e-30 * torch.eye(f.shape[0], dtype=f.dtype))
                       for f in st["L"]]
            st["m"] = torch.zeros_like(g)
            st["v"] = torch.zeros_like(g)
            st["k"] = 0
            return False
        gp = rotate(g, st["Q"])
        st["k"] += 1
        k = st["k"]
        st["m"] = self.b1 * st["m"] + (1 - self.b1) * gp
        st["v"] = self.b2 * st["v"] + (1 - self.b2) * gp ** 2
        lr = self.lr
        step = lr * math.sqrt(1 - self.b2 ** k) / (1 - self.b1 ** k) if self.correct_bias else lr
        u = rotate_back(st["m"] / (st["v"].sqrt() + self.eps), st["Q"])
        if self.normalize:
            u = u / (u.pow(2).mean().sqrt() + 1e-30)
        w.sub_(step * u)
        w.sub_(lr * self.wd * w)
        st["L"] = [None if f is None else torch.lerp(f, outer(g, d), 1 - self.bs)
                   for d, f in enumerate(st["L"])]
        return k % self.f == 0 and any(f is not None for f in st["L"])

    def refresh(self, st):
        out = []
        for f, q in zip(st["L"], st["Q"]):
            if f is None:
                out.append(None)
                continue
            e = torch.diag(q.T @ f @ q)
            s = torch.argsort(e, descending=True, stable=True)
            out.append((s, canonical_qr(f @ q[:, s], q[:, s])))
        return out

    def install(self, st, result):
        for d, r in enumerate(result):
            if r is not None:
                st["v"] = st["v"].index_select(d, r[0])
        q_new = [None if r is None else r[1] for r in result]
        st["m"] = rotate(rotate_back(st["m"], st["Q"]), q_new)
        st["Q"] = [q if r is None else r[1] for q, r in zip(st["Q"], result)]


class KLShampooRef(_Reference):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.98), shampoo_beta=-1, eps=1e-8,
                 weight_decay=0.01, precondition_frequency=10, init_factor=0.1,
                 using_clamping=True, max_clamp_value=4000, max_precond_dim=10000,
                 install_delay=0):
        super().__init__(params, lr, install_delay)
        self.b1 = betas[0]
        self.b = shampoo_beta if shampoo_beta >= 0 else betas[1]
        self.eps, self.wd, self.f = eps, weight_decay, precondition_frequency
        self.init_factor = init_factor
        self.clamping, self.max_clamp = using_clamping, max_clamp_value
        self.max_dim = max_precond_dim
        self.adamw = _AdamW(lr, betas[0], betas[1], eps, weight_decay)

    def update(self, w, g, st):
        b = self.b
        dims = [d for d, n in enumerate(g.shape) if n <= self.max_dim]
        if not st:
            st["S"], st["Q"], st["s"] = {}, {}, {}
            for d in dims:
                n_other = g.numel() // g.shape[d]
                st["S"][d] = (1 - b) / n_other * outer(g, d)
                st["Q"][d] = eigvecs_descending(
                    st["S"][d] + 1e-30 * torch.eye(g.shape[d], dtype=g.dtype))
                st["s"][d] = torch.full((g.shape[d],), self.init_factor, dtype=g.dtype) ** -0.5
            st["M"] = torch.zeros_like(g)
            st["k"] = 0
            return False
        st["k"] += 1
        qs = [st["Q"].get(d) for d in range(g.dim())]
        st["M"] = torch.lerp(st["M"], g, 1 - self.b1)
        p = torch.ones_like(g)
        for d in dims:
            p = p * st["s"][d].view([-1 if i == d else 1 for i in range(g.dim())])
        p = p / (1 + self.eps * p)
        u = rotate_back(rotate(st["M"], qs) * p, qs)
        # factor and eigenvalue updates with the PREVIOUS Q and s
        h = rotate(g, qs)
        new_s = {}
        for d in dims:
            x = g
            hs = h
            for e in dims:
                if e != d:
                    x = mode(x, (st["Q"][e] * st["s"][e]).T, e)   # G Q_e diag(s_e)
                    hs = hs * st["s"][e].view([-1 if i == e else 1 for i in range(g.dim())])
            n_other = g.numel() // g.shape[d]
            st["S"][d] = b * st["S"][d] + (1 - b) / n_other * outer(x, d)
            diag = (hs ** 2).mean(dim=[i for i in range(g.dim()) if i != d])
            lam = torch.lerp(1 / st["s"][d] ** 2, diag, 1 - b)
            s = lam ** -0.5
            if self.clamping:
                s = torch.clamp(s, max=max(10, min(g.shape[d], self.max_clamp)))
            new_s[d] = s
        st["s"].update(new_s)
        w.sub_(self.lr * u)
        w.sub_(self.lr * self.wd * w)
        return st["k"] % self.f == 0 and bool(dims)

    def refresh(self, st):
        return {d: canonical_qr(st["S"][d] @ st["Q"][d], st["Q"][d]) for d in st["S"]}

    def install(self, st, result):
        st["Q"].update(result)


class ShampooRef(_Reference):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12,
                 grafting_beta2=0.999, grafting_epsilon=1e-8, weight_decay=0.0,
                 precondition_frequency=10, start_preconditioning_step=None,
                 max_preconditioner_dim=1024, inverse_root=None, install_delay=0):
        super().__init__(params, lr, install_delay)
        self.b1, self.b2 = betas
        self.epsilon, self.gb2, self.geps = epsilon, grafting_beta2, grafting_epsilon
        self.wd, self.f = weight_decay, precondition_frequency
        self.start = precondition_frequency if start_preconditioning_step is None \
            else start_preconditioning_step
        self.max_dim, self.inverse_root = max_preconditioner_dim, inverse_root
        self.adamw = _AdamW(lr, betas[0], grafting_beta2, grafting_epsilon, weight_decay)

    def update(self, w, g, st):
        if not st:
            st["L"] = {d: torch.zeros(n, n, dtype=g.dtype) for d, n in enumerate(g.shape)
                       if n <= self.max_dim}
            st["Linv"] = None
            st["m1"] = torch.zeros_like(g)
            st["vg"] = torch.zeros_like(g)
            st["k"] = 0
        st["k"] += 1
        k = st["k"]
        for d in st["L"]:
            if self.b2 == 1:
                st["L"][d] = st["L"][d] + outer(g, d)
            else:
                st["L"][d] = self.b2 * st["L"][d] + (1 - self.b2) * outer(g, d)
        st["m1"] = self.b1 * st["m1"] + (1 - self.b1) * g
        mh = st["m1"] / (1 - self.b1 ** k)
        st["vg"] = self.gb2 * st["vg"] + (1 - self.gb2) * g ** 2
        a = mh / ((st["vg"] / (1 - self.gb2 ** k)).sqrt() + self.geps)
        if st["Linv"] is None or k < self.start:
            direction = a
        else:
            p = mh
            for d, r in st["Linv"].items():
                p = mode(p, r, d)
            direction = p * a.norm() / p.norm()
        w.sub_(self.lr * direction)
        w.sub_(self.lr * self.wd * w)
        return k % self.f == 0 and bool(st["L"])

    def refresh(self, st):
        c = (1 - self.b2 ** st["k"]) if self.b2 < 1 else 1.0
        order = st["m1"].dim()
        root = 2 * order if self.inverse_root is None else self.inverse_root
        out = {}
        for d, f in st["L"].items():
            lam, q = torch.linalg.eigh(f / c)
            # eigenvalues below n eps_m lam_max are raised to it (docs/departures.md)
            floor = lam.numel() * torch.finfo(lam.dtype).eps * lam.max().clamp(min=0)
            lam = torch.maximum(lam, floor) + self.epsilon
            out[d] = q @ torch.diag(lam ** (-1.0 / root)) @ q.T
        return out

    def install(self, st, result):
        st["Linv"] = dict(result)
