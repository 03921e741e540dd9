"""The REFRESH op table (asteria.refresh.ops) is the C runtime's: the same names and ast_op codes
as asteria._C.OPS, and every op has a torch function in the inline executor. Also the house
rules of python/asteria that the layout depends on: no import cycle among its modules
(imports inside functions count) and no module over 800 lines."""

import ast
import os

import torch

from asteria.refresh import inline_torch, ops
from models import require_c_extension

PKG = os.path.dirname(os.path.abspath(ops.__file__)).rsplit(os.sep, 1)[0]  # .../asteria


def test_op_table_matches_the_c_runtime():
    require_c_extension()
    from asteria import _C

    assert {name: op.code for name, op in ops.OPS.items()} == dict(_C.OPS)
    assert set(inline_torch.FUNCTIONS) == set(ops.OPS)


def test_output_spec_matches_the_torch_executor():
    torch.manual_seed(0)
    n, n1 = 5, 3
    g = torch.randn(2, n, n, dtype=torch.float64)
    f = g @ g.transpose(1, 2) + torch.eye(n, dtype=torch.float64)
    q = torch.linalg.qr(torch.randn(2, n, n, dtype=torch.float64)).Q
    pairs = torch.stack([q, q], dim=1)
    x = torch.randn(2, n, n1, dtype=torch.float64)
    for name in ops.OPS:
        args = (x, pairs, None) if name == "soap_rotate" else (f, q, None)
        out = inline_torch.compute(name, args[0], args[1], 2.0, 1e-6, args[2])
        want = ops.output_spec(name, n, torch.float64, n1)
        assert [(tuple(t.shape[1:]), t.dtype) for t in out] == want, name


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
