"""The runtime's Chrome trace through asteria._C: a Runtime with {"trace": path} records job
queued / started / done, refresh spans on worker lanes, barrier waits and installs; Python adds
copy events (and lanes of its own) with Runtime.trace_event; close() writes JSON that json.load
parses. Jobs are real eigh REFRESHes on torch tensors (addresses by data_ptr)."""

import json
import time

import pytest
import torch

from asteria import _C
from job_delay import set_job_delay

N = 96


def spd(seed, n=N):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, n, dtype=torch.float64, generator=g)
    return (b @ b.T + n * torch.eye(n, dtype=torch.float64)).contiguous()


def submit_eigh(rt, f, block, keep):
    q = torch.zeros_like(f)
    w = torch.zeros(f.shape[0], dtype=torch.float64)
    for t in (f, q, w):
        rt.register(t.data_ptr(), t.nbytes)
    keep += [f, q, w]
    return rt.submit("eigh", "float64", f.shape[0], 1, f.data_ptr(), None, q.data_ptr(),
                     w.data_ptr(), block=block, version=1, deadline=block), q, w


def load(path):
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    events = doc["traceEvents"]
    real = [e for e in events if e["ph"] != "M"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    return doc, real, lanes


def one(events, name, block=None, **match):
    hits = [e for e in events if e["name"] == name
            and (block is None or e["args"].get("block") == block)
            and all(e["args"].get(k) == v for k, v in match.items())]
    assert len(hits) == 1, (name, block, hits)
    return hits[0]


def test_three_jobs_copy_events_and_order(tmp_path):
    path = tmp_path / "trace.json"
    rt = _C.Runtime({"workers": 2, "pin": False, "trace": str(path)})
    assert rt.tracing
    keep = []
    t_before = time.monotonic_ns()
    jobs = [submit_eigh(rt, spd(i), 10 + i, keep) for i in range(3)]
    results = [rt.wait(t) for t, _, _ in jobs]
    assert [r.status for r in results] == [0, 0, 0]
    for (t, q, w), i in zip(jobs, range(3)):  # the jobs computed: A Q = Q diag(w)
        f = keep[3 * i]
        assert torch.allclose(f @ q, q * w, atol=1e-8 * float(w.max()))
    rt.note_install(4, 9)

    # Copy events as the Python shadow layer adds them: issued / done instants and the span.
    t0 = time.monotonic_ns()
    rt.trace_event("copy_issued", "shadow", block=10, bytes=N * N * 8, direction="d2h", ts_ns=t0)
    rt.trace_event("copy_done", "shadow", block=10, bytes=N * N * 8, direction="d2h",
                   ts_ns=t0 + 30_000)
    rt.trace_event("copy", "shadow", block=10, bytes=N * N * 8, direction="d2h", ts_ns=t0,
                   dur_ns=30_000)
    rt.trace_event("copy", "shadow", block=11, bytes=4096, direction="h2d", ts_ns=t_before,
                   dur_ns=1000)
    rt.trace_name_lane(-7, "rank 0 sync")
    rt.trace_event("span", -7, "allreduce", cat="coherence", dur_ns=5000, step=9)
    rt.trace_event("instant", "train", "step end", step=9)  # ts None: now
    rt.close()
    assert rt.closed

    doc, ev, lanes = load(path)
    assert doc["otherData"]["dropped_events"] == 0
    for i in range(3):
        b = 10 + i
        q = one(ev, "job queued", b)
        s = one(ev, "job started", b)
        d = one(ev, "job done", b)
        run = one(ev, "refresh", b)
        assert q["ts"] < s["ts"] < d["ts"], (q, s, d)
        assert q["tid"] == 1 and lanes[1] == "train"  # queued on the submitter's lane
        assert s["tid"] == d["tid"] == run["tid"] >= 1000  # a worker lane (1000 + index)
        assert lanes[s["tid"]] == f"worker {s['tid'] - 1000}"
        assert run["ph"] == "X" and run["ts"] == s["ts"]
        assert run["dur"] == pytest.approx(d["ts"] - s["ts"], abs=1e-3)
        assert run["args"]["status"] == d["args"]["status"] == "AST_OK"
        assert run["args"]["version"] == 1 and run["args"]["worker"] == s["tid"] - 1000
        # Python's monotonic clock and the runtime's stamps share one time base.
        assert (results[i].done_ns - t_before) / 1e3 == pytest.approx(
            d["ts"] - one(ev, "copy", 11)["ts"], abs=1.0)

    inst = one(ev, "install")
    assert inst["args"]["step"] == 9 and inst["args"]["version"] == 4 and inst["tid"] == 1

    issued = one(ev, "copy issued", 10)
    done = one(ev, "copy done", 10)
    span = one(ev, "copy", 10)
    assert issued["args"] == {"block": 10, "bytes": N * N * 8, "dir": "d2h"}
    assert done["ts"] - issued["ts"] == pytest.approx(30.0, abs=1e-3)
    assert span["ph"] == "X" and span["dur"] == pytest.approx(30.0, abs=1e-3)
    assert issued["tid"] == 2 and lanes[2] == "shadow stream"
    early = one(ev, "copy", 11)
    assert early["args"]["dir"] == "h2d"
    assert early["ts"] <= min(one(ev, "job queued", b)["ts"] for b in (10, 11, 12))
    assert issued["ts"] >= max(one(ev, "job done", b)["ts"] for b in (10, 11, 12))
    sync = one(ev, "allreduce")
    assert sync["cat"] == "coherence" and sync["tid"] == 7 and lanes[7] == "rank 0 sync"
    assert sync["args"]["step"] == 9 and sync["dur"] == pytest.approx(5.0)
    assert one(ev, "step end")["ts"] >= issued["ts"]
    assert [e["ts"] for e in ev] == sorted(e["ts"] for e in ev)


def test_barrier_span_uncollected_jobs_and_explicit_write(tmp_path):
    path, early = tmp_path / "t.json", tmp_path / "early.json"
    rt = _C.Runtime({"workers": 1, "pin": False, "trace": str(path)})
    keep = []
    # the job delay orders the events whatever the machine's load: job 1 sleeps 0.5 s, so the
    # wait below blocks; job 2 sleeps 2 s after it, so the snapshot is written before it ends
    set_job_delay(rt, 500)
    t1, _, _ = submit_eigh(rt, spd(5, 384), 1, keep)
    set_job_delay(rt, 2000)
    t2, _, _ = submit_eigh(rt, spd(6), 2, keep)
    r1 = rt.wait(t1)
    stats = rt.stats()
    assert r1.status == 0 and stats["barrier_waits"] == 1 and stats["barrier_wait_ns"] > 0
    rt.trace_write(early)  # a snapshot of the trace so far; recording goes on
    deadline = time.monotonic() + 30
    while rt.stats()["jobs_queued"] or rt.stats()["jobs_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    rt.close()  # job 2 was never collected: close drains it into the trace

    _, ev, _ = load(early)
    assert one(ev, "job done", 1) and not [e for e in ev if e["args"].get("block") == 2
                                          and e["name"] == "job done"]
    _, ev, _ = load(path)
    wait = one(ev, "barrier wait")
    assert wait["ph"] == "X" and wait["args"] == {"block": 1, "version": 1, "status": "AST_OK"}
    assert round(wait["dur"] * 1e3) == stats["barrier_wait_ns"]  # the span is the stat
    done1 = one(ev, "job done", 1)
    assert wait["ts"] <= done1["ts"] <= wait["ts"] + wait["dur"] + 1.0
    q2, d2 = one(ev, "job queued", 2), one(ev, "job done", 2)
    assert q2["ts"] < one(ev, "job started", 2)["ts"] < d2["ts"]


def test_trace_errors(tmp_path):
    bad = tmp_path / "missing" / "t.json"
    with pytest.raises(ValueError, match="'trace'.*in an existing directory"):
        _C.Runtime({"workers": 1, "pin": False, "trace": str(bad)})  # refused up front
    bad.parent.mkdir()
    rt = _C.Runtime({"workers": 1, "pin": False, "trace": str(bad)})
    bad.parent.rmdir()  # gone by the time the trace is written
    with pytest.raises(ValueError, match="unknown trace kind 'bogus'"):
        rt.trace_event("bogus", "train")
    with pytest.raises(ValueError, match="unknown trace lane") as ei:
        rt.trace_event("copy", -1000)
    with pytest.raises(ValueError, match="trace_event") as ei:  # a custom kind needs a name
        rt.trace_event("instant", "train")
    assert ei.value.code == _C.AST_EINVAL
    with pytest.raises(ValueError, match="direction"):
        rt.trace_event("copy", "shadow", direction="sideways")
    with pytest.raises(FileNotFoundError) as ei:
        rt.trace_write()
    assert str(bad) in str(ei.value) and ei.value.errno == 2
    with pytest.raises(FileNotFoundError) as ei:  # the write at close fails: still closed
        rt.close()
    assert str(bad) in str(ei.value)
    assert rt.closed and not bad.exists()
    rt.close()  # idempotent, no second error

    with _C.Runtime({"workers": 1, "pin": False}) as plain:
        assert not plain.tracing
        plain.trace_event("copy", "shadow", bytes=1)  # discarded without a trace
        with pytest.raises(_C.AsteriaError, match="records no trace") as ei:
            plain.trace_write(tmp_path / "x.json")
        assert ei.value.code == _C.AST_ESTATE
    assert not (tmp_path / "x.json").exists()
