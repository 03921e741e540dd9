#!/usr/bin/env python3
"""check_file_cycles.py - no two of libasteria's source files call each other, directly or
through a chain of other files.

The call graph between files is read from the object files, as the linker sees it: file A
depends on file B when a symbol A's object leaves undefined is defined by B's (nm). A cycle
(A needs B and B, through any chain, needs A) means neither file can be read, tested or
replaced on its own; the files of every cycle are printed, with the symbols of each edge.

usage: check_file_cycles.py NM OBJECTS [--count]
  NM       the nm of the toolchain (CMake's CMAKE_NM)
  OBJECTS  the object files, ';'-separated (CMake's $<TARGET_OBJECTS:asteria>) or as more
           arguments
  --count  print the number of source files in a cycle and exit 0 whatever it is
Exits 0 when no file is in a cycle, 1 otherwise.
"""
import pathlib
import subprocess
import sys

DEFINED = set("TDBRVWGSCuvi")  # nm -P types of a global definition


def symbols(nm, obj):
    """(defined, undefined) global symbol names of one object file."""
    out = subprocess.run([nm, "-P", "-g", obj], check=True, capture_output=True,
                         text=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[0], parts[1]
        if kind == "U":
            undefined.add(name)
        elif kind in DEFINED:
            defined.add(name)
    return defined, undefined


def source_name(obj):
    """src/linalg.c for .../CMakeFiles/asteria.dir/src/linalg.c.o."""
    p = pathlib.PurePath(obj)
    name = p.name[:-2] if p.name.endswith(".o") else p.stem
    return f"{p.parent.name}/{name}"


def graph(nm, objects):
    """{file: {file it needs: sorted symbols}}."""
    tables = {source_name(o): symbols(nm, o) for o in objects}
    owner = {}
    for f, (defined, _) in tables.items():
        for s in defined:
            owner[s] = f
    edges = {f: {} for f in tables}
    for f, (_, undefined) in tables.items():
        for s in undefined:
            g = owner.get(s)
            if g is not None and g != f:
                edges[f].setdefault(g, []).append(s)
    return {f: {g: sorted(v) for g, v in e.items()} for f, e in edges.items()}


def cycles(edges):
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main(argv):
    count_only = "--count" in argv
    args = [a for a in argv[1:] if a != "--count"]
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    nm = args[0]
    objects = [o for a in args[1:] for o in a.split(";") if o]
    edges = graph(nm, objects)
    found = cycles(edges)
    in_cycle = sum(len(c) for c in found)
    if count_only:
        print(in_cycle)
        return 0
    for comp in found:
        print("files in a cycle: " + ", ".join(comp))
        for f in comp:
            for g in comp:
                if g in edges[f]:
                    print(f"  {f} -> {g}: {', '.join(edges[f][g])}")
    if found:
        print(f"FAIL: {in_cycle} of {len(edges)} files are in a cycle")
        return 1
    print(f"ok: {len(edges)} files, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
