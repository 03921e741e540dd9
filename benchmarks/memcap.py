"""Run a command inside a memory cgroup of the kernel, with a byte cap, and report what happened.

Used by benchmarks/bench_memory_cap.py and tests/python/test_memory_cap.py. Supports the cgroup
v1 memory controller (memory.limit_in_bytes, memory.max_usage_in_bytes, memory.oom_control's
oom_kill) and cgroup v2 (memory.max, memory.peak, memory.events' oom_kill; memory.swap.max 0).
The new group is made under this process's own group (so it nests inside whatever limits this
process already has) and removed afterwards. ``available()`` says why a cap cannot be set here
(no controller, no write access), so callers skip with that message instead of failing.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from typing import Any, Optional, Sequence

ROOT = "/sys/fs/cgroup"


def _own_path(controller: Optional[str]) -> Optional[str]:
    """This process's group in the v1 hierarchy of ``controller`` (None: the v2 one)."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if controller is None and ctrls == "":
                    return path
                if controller is not None and controller in ctrls.split(","):
                    return path
    except OSError:
        return None
    return None


def _v1_base() -> Optional[str]:
    if not os.path.exists(os.path.join(ROOT, "memory", "memory.limit_in_bytes")):
        return None
    own = _own_path("memory") or "/"
    base = os.path.join(ROOT, "memory", own.lstrip("/"))
    return base if os.path.isdir(base) else os.path.join(ROOT, "memory")


def _v2_base() -> Optional[str]:
    for cand in (ROOT, os.path.join(ROOT, "unified")):
        ctl = os.path.join(cand, "cgroup.controllers")
        try:
            with open(ctl, encoding="utf-8") as f:
                if "memory" not in f.read().split():
                    continue
        except OSError:
            continue
        own = _own_path(None) or "/"
        base = os.path.join(cand, own.lstrip("/"))
        return base if os.path.isdir(base) else cand
    return None


def available() -> tuple[Optional[str], str]:
    """("v1" | "v2", base directory) where a capped group can be made, else (None, why not)."""
    reasons = []
    for kind, base in (("v1", _v1_base()), ("v2", _v2_base())):
        if base is None:
            reasons.append(f"cgroup {kind}: no memory controller mounted")
            continue
        probe = os.path.join(base, f"asteria-probe-{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(probe)
            os.rmdir(probe)
            return kind, base
        except OSError as e:
            reasons.append(f"cgroup {kind}: cannot make a group under {base}: {e.strerror}")
    return None, "; ".join(reasons)


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(value)


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _field(text: Optional[str], key: str) -> Optional[int]:
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return None


def run_capped(cmd: Sequence[str], cap_bytes: int, timeout: float,
               env: Optional[dict] = None) -> dict[str, Any]:
    """Runs cmd in a fresh memory cgroup capped at cap_bytes (no swap). Returns returncode,
    killed_by_oom (the group's oom_kill count > 0 or SIGKILL with the cap reached), the group's
    peak bytes, stdout, stderr and wall seconds."""
    kind, base = available()
    if kind is None:
        raise RuntimeError(base)
    grp = os.path.join(base, f"asteria-cap-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(grp)
    try:
        if kind == "v1":
            _write(os.path.join(grp, "memory.limit_in_bytes"), str(cap_bytes))
            try:  # no swap to escape into (the file exists only with swap accounting)
                _write(os.path.join(grp, "memory.memsw.limit_in_bytes"), str(cap_bytes))
            except OSError:
                pass
        else:
            _write(os.path.join(grp, "memory.max"), str(cap_bytes))
            try:
                _write(os.path.join(grp, "memory.swap.max"), "0")
            except OSError:
                pass
        procs = os.path.join(grp, "cgroup.procs")

        def enter() -> None:  # in the child, before exec: every page it touches is charged
            _write(procs, str(os.getpid()))

        t0 = time.perf_counter()
        p = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, preexec_fn=enter)
        # The group's anonymous memory, sampled every 20 ms: what a cap really has to hold
        # (page cache the group brought in is reclaimed under a cap, so the group's own peak
        # overstates the need). A transient shorter than a sample can be missed.
        stat = os.path.join(grp, "memory.stat")
        anon_key = "rss" if kind == "v1" else "anon"
        anon_peak = 0
        out_chunks: list = []
        import threading

        def drain(stream, sink):
            sink.append(stream.read())

        t_out = threading.Thread(target=drain, args=(p.stdout, out_chunks))
        err_chunks: list = []
        t_err = threading.Thread(target=drain, args=(p.stderr, err_chunks))
        t_out.start()
        t_err.start()
        while p.poll() is None:
            anon_peak = max(anon_peak, _field(_read(stat), anon_key) or 0)
            if time.perf_counter() - t0 > timeout:
                p.kill()
                break
            time.sleep(0.02)
        p.wait()
        t_out.join()
        t_err.join()
        out, err = "".join(out_chunks), "".join(err_chunks)
        wall = time.perf_counter() - t0
        if kind == "v1":
            peak = _field("x " + (_read(os.path.join(grp, "memory.max_usage_in_bytes")) or ""),
                          "x")
            ooms = _field(_read(os.path.join(grp, "memory.oom_control")), "oom_kill")
            fails = _field("x " + (_read(os.path.join(grp, "memory.failcnt")) or ""), "x")
        else:
            peak = _field("x " + (_read(os.path.join(grp, "memory.peak")) or ""), "x")
            ooms = _field(_read(os.path.join(grp, "memory.events")), "oom_kill")
            fails = _field(_read(os.path.join(grp, "memory.events")), "max")
        killed = bool(ooms) or (p.returncode == -9 and peak is not None
                                and peak >= cap_bytes * 0.95)
        return {"cgroup": kind, "cap_bytes": cap_bytes, "returncode": p.returncode,
                "killed_by_oom": killed, "oom_kill_count": ooms, "limit_hits": fails,
                "cgroup_peak_bytes": peak, "anon_peak_bytes": anon_peak, "stdout": out,
                "stderr": err, "wall_s": wall}
    finally:
        for _ in range(50):  # the group can be removed once its last task has gone
            try:
                os.rmdir(grp)
                break
            except OSError:
                time.sleep(0.1)
