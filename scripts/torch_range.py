"""The torch versions Asteria supports, for the setup scripts. The range has one home, the torch
requirement in pyproject.toml; this reads it there and compares the torch installed in the
running interpreter's environment (its package metadata: torch is not imported, which takes
seconds). Standard library only: it runs in a fresh virtual environment.

  torch_range.py range          print the supported range, e.g. ">=2.8,<2.16"
  torch_range.py oldest         print its lower bound as a full version, e.g. "2.8.0"
  torch_range.py installed      print the installed torch's version ("" and exit 1 if none)
  torch_range.py check [SPEC]   exit 0 if the installed torch satisfies SPEC (default: the
                                supported range), 1 if it does not or there is none
"""

from __future__ import annotations

import importlib.metadata
import operator
import os
import re
import sys

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "pyproject.toml")
OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
       ">": operator.gt, "<": operator.lt}


def supported() -> str:
    with open(PYPROJECT, encoding="utf-8") as fh:
        m = re.search(r'^\s*"torch\s*([^"]+)"', fh.read(), re.M)
    if not m:
        raise SystemExit(f"{PYPROJECT}: no torch requirement in the dependencies")
    return m.group(1).replace(" ", "")


def release(version: str) -> tuple[int, ...]:
    """2.8.0+cu128 -> (2, 8, 0); trailing zeros dropped so that 2.8 == 2.8.0."""
    parts = [int(p) for p in re.match(r"\d+(?:\.\d+)*", version).group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def satisfies(version: str, spec: str) -> bool:
    for clause in spec.split(","):
        op, bound = re.fullmatch(r"(>=|<=|==|!=|>|<)([\d.]+)", clause).groups()
        if not OPS[op](release(version), release(bound)):
            return False
    return True


def installed() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else ""
    if cmd == "range":
        print(supported())
    elif cmd == "oldest":
        low = re.search(r">=([\d.]+)", supported()).group(1)
        print(".".join((low.split(".") + ["0", "0"])[:3]))
    elif cmd == "installed":
        print(installed())
        return 0 if installed() else 1
    elif cmd == "check":
        have = installed()
        return 0 if have and satisfies(have, argv[1] if len(argv) > 1 else supported()) else 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
