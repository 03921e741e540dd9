"""``python -m asteria``: what this install is (distribution version, libasteria's features)
and which path the optimizers take on this machine. A CUDA build on a machine without a CUDA
device imports and runs the CPU path; this is where that is said."""

import importlib.metadata

import torch

from asteria import __version__, _C


def describe() -> list:
    try:
        dist = importlib.metadata.version("asteria")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        dist = f"{__version__} (not installed)"
    lines = [
        f"asteria {dist}, torch {torch.__version__}, module {_C.__file__}",
        "libasteria: CUDA {}, NVMe tier (liburing) {}, worker pinning (hwloc) {}".format(
            *("yes" if f else "no" for f in (_C.HAVE_CUDA, _C.HAVE_URING, _C.HAVE_HWLOC))),
    ]
    if _C.HAVE_CUDA and torch.cuda.is_available():
        lines.append(f"CUDA path: {torch.cuda.device_count()} device(s) visible to torch")
    elif _C.HAVE_CUDA:
        lines.append("note: built with CUDA, but torch sees no CUDA device: the optimizers run "
                     "their CPU path (refresh on the C pool, host and NVMe tiers)")
    else:
        lines.append("CPU build: libasteria has no CUDA paths (shadow stream, pinned and UVM "
                     "tiers); the CUDA build has them")
    return lines


if __name__ == "__main__":
    print("\n".join(describe()))
