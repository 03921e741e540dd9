"""The REFRESH op table (asteria.refresh.ops) is the C runtime's: the same names and ast_op codes
as asteria._C.OPS, and every op has a torch function in the inline executor. gram_ema's
reference against a per-block restatement, its input checks, and its C op (in place, through
asteria._C.Runtime) against the reference. Also the house rules of python/asteria that the
layout depends on: no import cycle among its modules (imports inside functions count) and no
module over 800 lines."""

import ast
import os

import pytest
import torch

from asteria.refresh import inline_torch, ops
from models import require_c_extension
from tolerance import gram_tol

PKG = os.path.dirname(os.path.abspath(ops.__file__)).rsplit(os.sep, 1)[0]  # .../asteria


def test_op_table_matches_the_c_runtime():
    require_c_extension()
    from asteria import _C

    assert {name: op.code for name, op in ops.OPS.items()} == dict(_C.OPS)
    assert set(inline_torch.FUNCTIONS) == set(ops.OPS)


def test_op_fields_are_the_c_tables():
    """Every property an executor reads is libasteria's op table's, field by field."""
    require_c_extension()
    from asteria import _C

    c_ops = _C.ops()
    assert list(ops.OPS) == sorted(c_ops, key=lambda k: c_ops[k]["code"])
    for name, op in ops.OPS.items():
        c = c_ops[name]
        assert (op.code, op.takes_basis, op.in_place, op.operands) == (
            c["code"], c["takes_basis"], c["in_place"], c["operands"]), name
    assert [n for n, op in ops.OPS.items() if op.takes_basis] == ["soap_qr", "kl_qr"]
    assert [n for n, op in ops.OPS.items() if op.in_place] == ["gram_ema"]
    assert [n for n, op in ops.OPS.items() if op.rectangular] == ["soap_rotate", "gram_ema"]


def test_no_executor_names_an_op():
    """The executors and the cost model read an op's fields (ops.Op), never its name: a new op
    touches none of them."""
    names = set(ops.OPS)
    refresh = os.path.join(PKG, "refresh")
    for fname in sorted(os.listdir(refresh)):
        if not fname.endswith(".py") or fname in ("ops.py", "__init__.py"):
            continue
        with open(os.path.join(refresh, fname)) as fh:
            tree = ast.parse(fh.read())
        # docstrings may name ops; code may not (cost.calibrate's default list of ops to
        # measure is a choice of ops, not a branch on one)
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)}
        calib = {id(c) for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef) and n.name == "calibrate"
                 for d in n.args.defaults for c in ast.walk(d)}
        named = [n.value for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and n.value in names
                 and id(n) not in docs and id(n) not in calib]
        assert not named, f"refresh/{fname} names ops {named}; read their ops.Op fields instead"


def test_output_spec_matches_the_torch_executor():
    torch.manual_seed(0)
    n, n1 = 5, 3
    g = torch.randn(2, n, n, dtype=torch.float64)
    f = g @ g.transpose(1, 2) + torch.eye(n, dtype=torch.float64)
    q = torch.linalg.qr(torch.randn(2, n, n, dtype=torch.float64)).Q
    pairs = torch.stack([q, q], dim=1)
    x = torch.randn(2, n, n1, dtype=torch.float64)
    r = torch.eye(n1, dtype=torch.float64).expand(2, n1, n1)
    for name in ops.OPS:
        args = {"soap_rotate": (x, pairs, None), "gram_ema": (x, f, r)}.get(name, (f, q, None))
        out = inline_torch.compute(name, args[0], args[1], 2.0, 1e-6, args[2])
        want = ops.output_spec(name, n, torch.float64, n1)
        assert [(tuple(t.shape[1:]), t.dtype) for t in out] == want, name


# ---- gram_ema -------------------------------------------------------------------------------


def _gram_inputs(batch, n, n1, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(batch, n, n1, dtype=dtype, generator=gen)
    a = torch.randn(batch, n, n, dtype=dtype, generator=gen)
    b = torch.randn(batch, n1, n1, dtype=dtype, generator=gen)
    return g, a + a.transpose(1, 2), b + b.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n,n1", [(5, 5), (3, 7), (7, 3), (1, 4), (4, 1)])
def test_gram_ema_reference_restatement(dtype, n, n1):
    g, l, r = _gram_inputs(3, n, n1, dtype, seed=n * 10 + n1)
    l0, r0 = l.clone(), r.clone()
    for beta, alpha in ((0.95, 0.05), (-0.5, 2.0), (0.0, 1.0)):
        lw, rw = ops.gram_ema(g, l, r, beta, alpha)
        tol_l, tol_r = gram_tol(g, l, beta, alpha), gram_tol(g, r, beta, alpha)
        for i in range(3):
            gi = g[i].double()
            want_l = beta * l[i].double() + alpha * (gi @ gi.T)
            want_r = beta * r[i].double() + alpha * (gi.T @ gi)
            torch.testing.assert_close(lw[i].double(), want_l, rtol=0, atol=tol_l)
            torch.testing.assert_close(rw[i].double(), want_r, rtol=0, atol=tol_r)
        assert lw.dtype == rw.dtype == dtype
        only_l = ops.gram_ema(g, l, None, beta, alpha)
        only_r = ops.gram_ema(g, None, r, beta, alpha)
        assert only_l[1] is None and only_r[0] is None
        torch.testing.assert_close(only_l[0], lw, rtol=0, atol=0)
        torch.testing.assert_close(only_r[1], rw, rtol=0, atol=0)
    # new tensors: the inputs are untouched
    assert torch.equal(l, l0) and torch.equal(r, r0)
    with pytest.raises(ValueError, match="neither"):
        ops.gram_ema(g, None, None, 0.9, 0.1)


def test_gram_ema_check_op_errors():
    g, l, r = _gram_inputs(2, 4, 3, torch.float64, seed=5)
    ops.check_op("gram_ema", (g, l, r))
    ops.check_op("gram_ema", (g, l))  # a 2-tuple: no R
    ops.check_op("gram_ema", (g, None, r))
    with pytest.raises(ValueError, match=r"gram_ema input G must have shape \(batch, n, n1\)"):
        ops.check_op("gram_ema", (g[0], l, r))
    with pytest.raises(ValueError, match="needs L \\(q\\), R \\(b\\) or both; got neither"):
        ops.check_op("gram_ema", (g, None, None))
    with pytest.raises(ValueError, match=r"L \(q\) must have shape \(2, 4, 4\).*got \(2, 3, 3\)"):
        ops.check_op("gram_ema", (g, r, l))  # the factors swapped
    with pytest.raises(ValueError, match=r"R \(b\) must have shape \(2, 3, 3\).*got \(1, 3, 3\)"):
        ops.check_op("gram_ema", (g, l, r[:1]))
    with pytest.raises(ValueError, match="L \\(q\\) must have G's dtype torch.float64, got "
                       "torch.float32"):
        ops.check_op("gram_ema", (g, l.float(), r))
    with pytest.raises(ValueError, match="only soap_rotate, gram_ema"):
        ops.check_op("kl_qr", (l, l, r))
    with pytest.raises(ValueError, match="gram_ema"):
        ops.check_op("nope", (g, l, r))


def test_gram_ema_inline_executor():
    """The sync executor runs the reference at submit; an absent factor's output is None; a
    non-finite G is a failure with no outputs."""
    g, l, r = _gram_inputs(2, 4, 3, torch.float32, seed=6)
    e = inline_torch.InlineTorchEngine()
    ids = dict(block=1, version=1, deadline=2, snapshot_step=1)
    res = e.wait(e.submit("gram_ema", g, l, b=r, p=0.9, eps=0.1, **ids))
    assert res.status == 0
    want = ops.gram_ema(g, l, r, 0.9, 0.1)
    assert all(torch.equal(a, b) for a, b in zip(res.outputs, want))
    res = e.wait(e.submit("gram_ema", g, None, b=r, p=0.9, eps=0.1, **ids))
    assert res.status == 0 and res.outputs[0] is None and torch.equal(res.outputs[1], want[1])
    g[1, 0, 0] = float("nan")
    res = e.wait(e.submit("gram_ema", g, l, b=r, p=0.9, eps=0.1, **ids))
    assert res.status == ops.AST_ENONFINITE and res.outputs is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gram_ema_c_op_in_place(dtype):
    """The C op through asteria._C.Runtime: L and R updated in their own memory, exactly
    symmetric, as the reference up to rounding; one factor alone; a NaN in any block's G leaves
    every block's L and R as they were."""
    require_c_extension()
    from asteria import _C

    batch, n, n1 = 3, 6, 4
    g, l, r = _gram_inputs(batch, n, n1, dtype, seed=7)
    name = "float64" if dtype == torch.float64 else "float32"
    rt = _C.Runtime({"workers": 1, "pin": False})
    try:
        hs = [rt.register(t.data_ptr(), t.numel() * t.element_size()) for t in (g, l, r)]
        want_l, want_r = ops.gram_ema(g, l, r, 0.95, 0.05)
        tol = 2 * max(gram_tol(g, l, 0.95, 0.05), gram_tol(g, r, 0.95, 0.05))  # both round
        t = rt.submit("gram_ema", name, n, batch, g.data_ptr(), None, l.data_ptr(),
                      r.data_ptr(), p=0.95, eps=0.05, n1=n1)
        assert rt.wait(t, None).status == 0
        torch.testing.assert_close(l, want_l, rtol=0, atol=tol)
        torch.testing.assert_close(r, want_r, rtol=0, atol=tol)
        assert torch.equal(l, l.transpose(1, 2)) and torch.equal(r, r.transpose(1, 2))
        r0 = r.clone()
        want_l, _ = ops.gram_ema(g, l, None, 0.5, 1.0)
        tol = 2 * gram_tol(g, l, 0.5, 1.0)  # both round
        t = rt.submit(7, name, n, batch, g.data_ptr(), None, l.data_ptr(), None, p=0.5,
                      eps=1.0, n1=n1, version=2)
        assert rt.wait(t, None).status == 0
        torch.testing.assert_close(l, want_l, rtol=0, atol=tol)
        assert torch.equal(r, r0)
        l0 = l.clone()
        g[2, 1, 1] = float("inf")
        t = rt.submit("gram_ema", name, n, batch, g.data_ptr(), None, l.data_ptr(),
                      r.data_ptr(), p=0.95, eps=0.05, n1=n1, version=3)
        res = rt.wait(t, None)
        assert res.status == _C.AST_ENONFINITE and res.failed_index == 2
        assert torch.equal(l, l0) and torch.equal(r, r0)
        with pytest.raises(ValueError, match="out0 \\(L\\) overlaps in0 \\(G\\)"):
            rt.submit("gram_ema", name, n, 1, g.data_ptr(), None, g.data_ptr(), None, p=0.9,
                      eps=0.1, n1=n1, version=4)
        for h in hs:
            rt.unregister(h)
    finally:
        rt.close()


def _modules():
    root = os.path.dirname(PKG)
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _imports(name, path, mods):
    """asteria modules ``name`` imports, anywhere in it (an extension such as _C is no module
    of the package; importing a submodule does not count as importing the package)."""
    deps = set()
    is_pkg = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts[:len(parts) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [a.name for a in node.names if f"{mod}.{a.name}" in mods or a.name == "_C"]
            if len(subs) < len(node.names):
                deps.add(mod)
            deps.update(f"{mod}.{a}" for a in subs)
    return {d for d in deps if d in mods and d != name}


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    state: dict = {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path + [m, d]))
            if d not in state:
                visit(d, path + [m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_no_module_over_800_lines():
    big = {m: n for m, p in _modules().items() if (n := sum(1 for _ in open(p))) > 800}
    assert not big, big
