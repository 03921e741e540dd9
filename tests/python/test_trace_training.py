"""The ``trace`` runtime key in training: a Chrome-trace JSON (Perfetto's format) of the C
runtime's job events plus the Python layer's copy events, written at optimizer.close(), when
the optimizer is collected, and at interpreter exit (weakref finalizer).

For one SOAP refresh the test checks the order snapshot copy (d2h, shadow stream) -> job
queued -> job started -> job done -> install S steps after the snapshot, and that the
prefetch (h2d) and NVMe read/write copies are there with their bytes.
"""

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import asteria
from asteria import SOAP, attach, detach
from models import loss_and_grad, make_model, require_c_extension

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

S = 2


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def rt(path, **kw):
    base = {"mode": "async", "staleness": S, "install": "deterministic", "workers": 2,
            "trace": str(path)}
    base.update(kw)
    return base


def events(path):
    with open(path) as f:
        doc = json.load(f)
    evs = doc["traceEvents"]
    for e in evs:
        assert {"ph", "pid", "tid"} <= set(e) and (e["ph"] == "M" or "ts" in e)
        if e["ph"] == "X":
            assert e["dur"] >= 0
    lanes = {e["tid"]: e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    return [e for e in evs if e["ph"] != "M"], lanes


def test_trace_orders_one_refresh(tmp_path):
    path = tmp_path / "trace.json"
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=4,
               runtime=rt(path, nvme_dir=str(tmp_path), host_budget_bytes=1024))
    h = attach(model, opt)
    for t in range(1, 9):
        loss_and_grad(model, "mlp", t)
        opt.step()
    detach(h)
    assert not path.exists()  # written at close
    opt.close()
    evs, lanes = events(path)
    assert {"train", "shadow stream", "nvme tier"} <= set(lanes.values())
    assert any(name.startswith("worker") for name in lanes.values())

    installs = [e for e in evs if e["name"] == "install"]
    init = next(e for e in installs if e["args"]["step"] == e["args"]["version"] == 1)
    # SOAP's first refresh: k = 4 at step 5 (step 1 was the initial eigendecomposition)
    refresh = next(e for e in installs if e["args"]["version"] == 5)
    assert refresh["args"]["step"] == 5 + S
    # the first REFRESH job queued after the init: the one whose inputs the shadow snapshotted
    # (SOAP's factor EMA jobs, queued from step 2 on, have no snapshot copies)
    d2h = {e["args"].get("block") for e in evs
           if e["cat"] == "copy" and e["args"].get("dir") == "d2h"}
    queued = next(e for e in evs if e["name"] == "job queued" and e["ts"] > init["ts"]
                  and e["args"]["block"] in d2h)
    block, version = queued["args"]["block"], queued["args"]["version"]

    def one(name):
        found = [e for e in evs if e["name"] == name and e["args"].get("block") == block
                 and e["args"].get("version") == version]
        assert len(found) == 1, (name, found)
        return found[0]

    started, done = one("job started"), one("job done")
    assert lanes[started["tid"]].startswith("worker") and lanes[queued["tid"]] == "train"
    assert done["args"]["status"] == "AST_OK"
    snaps = [e for e in evs if e["cat"] == "copy" and e["args"].get("dir") == "d2h"
             and e["args"].get("block") == block]
    issued = [e for e in snaps if e["name"] == "copy issued"]
    landed = [e for e in snaps if e["name"] == "copy done"]
    # soap_qr's factors, given as parts and gathered into one slot; its basis stack was made
    # for the job and given to it (donated)
    assert len(issued) == len(landed) == 1
    assert all(lanes[e["tid"]] == "shadow stream" and e["args"]["bytes"] > 0 for e in snaps)
    assert max(e["ts"] for e in issued) <= max(e["ts"] for e in landed) <= queued["ts"]
    assert queued["ts"] <= started["ts"] < done["ts"] < refresh["ts"]
    assert lanes[refresh["tid"]] == "train"

    prefetches = [e for e in evs if e["name"] == "prefetch"]
    assert prefetches and all(e["args"]["dir"] == "h2d" and e["args"]["bytes"] == 512
                              for e in prefetches)
    nvme = {e["name"] for e in evs if lanes[e["tid"]] == "nvme tier"}
    assert {"nvme read", "nvme write", "nvme write issued", "nvme write done"} <= nvme
    assert all(e["args"]["bytes"] > 0 for e in evs
               if e["name"] in ("nvme read", "nvme write"))


FINALIZER_SCRIPT = textwrap.dedent('''
    import sys
    sys.path[:0] = [{tests!r}, {python!r}]
    from asteria import SOAP
    from models import loss_and_grad, make_model
    m = make_model("mlp")
    opt = SOAP(m.parameters(), precondition_frequency=4,
               runtime={{"mode": "async", "staleness": 2, "workers": 1, "trace": {path!r}}})
    for t in range(1, 7):
        loss_and_grad(m, "mlp", t); opt.step()
    _keep = opt  # never closed: the weakref finalizer writes the trace at exit
''')


def test_trace_written_when_collected_and_at_exit(tmp_path):
    path = tmp_path / "gc.json"
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=4, runtime=rt(path))
    for t in range(1, 3):
        loss_and_grad(model, "mlp", t)
        opt.step()
    del opt
    gc.collect()
    evs, _ = events(path)
    assert any(e["name"] == "job queued" for e in evs)

    path = tmp_path / "exit.json"
    here = os.path.dirname(os.path.abspath(__file__))
    python = os.path.dirname(os.path.dirname(asteria.__file__))  # the package under test
    script = tmp_path / "exit.py"
    script.write_text(FINALIZER_SCRIPT.format(tests=here, python=python, path=str(path)))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    evs, _ = events(path)
    assert any(e["name"] == "install" for e in evs)


def test_one_tracer_built_by_the_pool_and_handed_on(tmp_path):
    """The C pool builds the optimizer's one tracer over its runtime; the wrapping executors
    get that object (no forwarding), sync mode has none, and it records nothing once closed."""
    from asteria.optim import SOAP
    from asteria.refresh.engine import NO_TRACE
    from asteria.refresh.split import SplitEngine

    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = SOAP([w], runtime={"mode": "async", "staleness": 1, "workers": 1,
                             "trace": str(tmp_path / "t.json")})
    tracer = opt.run.engine.tracer
    assert tracer.active and tracer is not NO_TRACE
    split = SplitEngine(opt.run.engine, None, tracer=tracer)
    assert split.tracer is tracer
    opt.close()
    assert not tracer.active  # the runtime wrote its file; nothing is recorded after
    tracer("copy", "shadow", bytes=1)  # a no-op, not an error
    sync = SOAP([w], runtime={"mode": "sync"})
    assert sync.run.engine.tracer is NO_TRACE
    sync.close()
