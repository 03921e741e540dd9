#!/usr/bin/env python3
"""check_exports.py - src/asteria.map lists exactly the public functions of include/asteria/*.h,
and each of them documents its return values.

A function declared in a public header but missing from the map is not exported by the shared
library; a symbol the map exports without a declaration there is ABI nobody meant to promise.
The test-only node (ASTERIA_TESTING_*) may list only functions declared in src/testing.h.
With a library file given (static or shared), every name the map lists must also be defined
in it, so the map names no function that does not exist; a shared library's dynamic symbol
table must hold exactly the map's ast* names.

Every public function's comment (the nearest one above it, which may cover a group of
declarations) says what it returns: "Returns ...", "RETURN VALUE: ..." or "No return value"
(liburing's habit).

usage: check_exports.py SOURCE_DIR [LIBRARY]; exits 0 pass, 1 fail.
"""
import pathlib
import re
import subprocess
import sys

DECL = re.compile(r"^(?!\s*(?:typedef|static|#|return\b))[A-Za-z_][\w \t\*]*?\b(ast_\w+)\s*\(",
                  re.M)


def declared(paths):
    names = set()
    for p in paths:
        text = re.sub(r"/\*.*?\*/", "", p.read_text(), flags=re.S)  # no comments
        names.update(DECL.findall(text))
    return names


def undocumented(paths):
    """Public functions whose comment does not say what they return."""
    out = []
    for p in paths:
        lines = p.read_text().split("\n")
        for i, line in enumerate(lines):
            m = DECL.match(line)
            if not m:
                continue
            j = i - 1  # past the declarations grouped under the same comment
            while j >= 0 and lines[j].strip() and not lines[j].strip().endswith("*/"):
                j -= 1
            comment = []
            while j >= 0 and lines[j].strip().startswith(("/*", "*")):
                comment.append(lines[j])
                j -= 1
            if not re.search(r"Returns?\b|RETURN VALUE|[Nn]o return value", " ".join(comment)):
                out.append(f"{p.name}: {m.group(1)}")
    return out


def map_nodes(path):
    """{node name: set of global symbols}; refuses wildcards."""
    nodes, bad = {}, []
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    for node, body in re.findall(r"(\w+)\s*\{(.*?)\}\s*\w*\s*;", text, flags=re.S):
        glob = re.search(r"global:(.*?)(?:local:|$)", body, flags=re.S)
        syms = set()
        for s in re.findall(r"([^\s;]+)\s*;", glob.group(1) if glob else ""):
            if any(c in s for c in "*?["):
                bad.append(f"{node}: wildcard '{s}' (list each symbol)")
            syms.add(s)
        nodes[node] = syms
    return nodes, bad


def main():
    src = pathlib.Path(sys.argv[1])
    headers = sorted((src / "include" / "asteria").glob("*.h"))
    public = declared(headers)
    testing = declared([src / "src" / "testing.h"])
    nodes, errors = map_nodes(src / "src" / "asteria.map")
    exported = set().union(*nodes.values()) if nodes else set()
    test_nodes = {n for n in nodes if n.startswith("ASTERIA_TESTING")}
    for name in sorted(public - exported):
        errors.append(f"declared in include/asteria/ but not in src/asteria.map: {name}")
    for node, syms in sorted(nodes.items()):
        allowed = testing if node in test_nodes else public
        for name in sorted(syms - allowed):
            where = "src/testing.h" if node in test_nodes else "include/asteria/*.h"
            errors.append(f"src/asteria.map node {node} exports {name}, not declared in {where}")
    if len(sys.argv) > 2:
        out = subprocess.run(["nm", "--defined-only", "-g", sys.argv[2]], capture_output=True,
                             text=True, check=True).stdout
        defined = {line.split()[-1] for line in out.splitlines() if len(line.split()) >= 3}
        for name in sorted(exported - defined):
            errors.append(f"src/asteria.map lists {name}, which the library does not define")
        if ".so" in pathlib.Path(sys.argv[2]).name:  # a shared library: what it really exports
            out = subprocess.run(["nm", "-D", "--defined-only", sys.argv[2]], capture_output=True,
                                 text=True, check=True).stdout
            dynamic = {line.split()[-1].split("@")[0] for line in out.splitlines()
                       if len(line.split()) >= 3}
            for name in sorted(n for n in dynamic - exported if n.startswith("ast")):
                errors.append(f"the shared library exports {name}, which the map does not list")
            for name in sorted(exported - dynamic):
                errors.append(f"the shared library does not export {name}")
    for name in undocumented(headers):
        errors.append(f"{name}: its comment does not say what it returns")
    for e in errors:
        print(e)
    print(f"{len(public)} public functions, {len(exported)} exported, {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
