"""A short training run against an installed asteria wheel (scripts/test_wheel_bare.sh runs it
inside a bare Debian root; docs/install.md). Prints what it ran; any failure raises.

 - where asteria._C and its libraries were loaded from (all of them must come from the wheel's
   asteria.libs/ when --vendored is given);
 - SOAP in mode "async" (the refresh on libasteria's C pool) with the eigenbases on the NVMe
   tier in a temporary directory (host budget of one block);
 - a state-dict round trip: the run is saved after SPLIT steps (through torch.save, bytes),
   loaded into a fresh model and optimizer, and both continue; they must stay bitwise equal.
"""

import argparse
import io
import sys
import tempfile
import time

import torch

import asteria
from asteria.__main__ import describe

STEPS, SPLIT, WIDTH = 12, 6, 32
BLOCK = WIDTH * WIDTH * 4  # one float32 eigenbasis


def runtime(nvme_dir):
    return {"mode": "async", "staleness": 2, "workers": 1, "nvme_dir": nvme_dir,
            "host_budget_bytes": BLOCK}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, WIDTH))


def step(model, opt, t):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(64, WIDTH, generator=g)
    y = torch.randn(64, WIDTH, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def loaded_libraries():
    """Paths of the shared objects this process mapped that asteria brought or links (numpy's
    and torch's own BLAS copies are theirs, not asteria's)."""
    names = ("asteria", "openblas", "lapack", "blas", "uring", "hwloc", "gfortran", "quadmath")
    theirs = ("/numpy.libs/", "/numpy/", "/torch/", "/nvidia/")
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "/" in line and ".so" in line}
    return sorted(p for p in paths if any(n in p.rsplit("/", 1)[-1] for n in names)
                  and not any(t in p for t in theirs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vendored", action="store_true",
                    help="fail unless every library of asteria._C comes from the wheel")
    args = ap.parse_args()
    for line in describe():
        print(line)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="asteria-nvme-") as nvme:
        model = make_model()
        opt = asteria.SOAP(model.parameters(), lr=3e-3, precondition_frequency=4,
                           runtime=runtime(nvme))
        losses = [step(model, opt, t) for t in range(1, SPLIT + 1)]
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)

        model2 = make_model()
        opt2 = asteria.SOAP(model2.parameters(), lr=3e-3, precondition_frequency=4,
                            runtime=runtime(nvme))
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])

        for t in range(SPLIT + 1, STEPS + 1):
            losses.append(step(model, opt, t))
            assert step(model2, opt2, t) == losses[-1], f"step {t}: the loaded run differs"
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b), "the loaded run's parameters differ"
        st = opt.asteria_stats()
        plan = opt.asteria_plan()
        opt.close()
        opt2.close()
    secs = time.perf_counter() - t0

    print(f"SOAP async, {STEPS} steps ({WIDTH}x{WIDTH} MLP), loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}, {secs:.1f} s")
    print(f"refresh jobs done on the C pool: {st['jobs_done']}; NVMe tier: {st['bytes_nvme']} "
          f"bytes resident, {st['bytes_nvme_written']} written, {st['bytes_nvme_read']} read, "
          f"O_DIRECT {st['nvme_direct']}")
    print("plan: " + "; ".join(d for d in plan if "NVMe" in d or "eigenbases" in d))
    print(f"state dict round trip after step {SPLIT}: steps {SPLIT + 1}..{STEPS} bitwise equal")
    assert st["jobs_done"] > 0, "no refresh ran on the C pool"
    assert st["bytes_nvme_written"] > 0 and st["bytes_nvme_read"] > 0, "the NVMe tier was unused"
    assert losses[-1] < losses[0], "the loss did not go down"

    libs = loaded_libraries()
    print("loaded: " + ", ".join(libs))
    if args.vendored:
        outside = [p for p in libs if "/asteria.libs/" not in p and "/asteria/" not in p]
        if outside:
            sys.exit(f"libraries from outside the wheel: {outside}")
    print("wheel smoke: OK")


if __name__ == "__main__":
    main()
