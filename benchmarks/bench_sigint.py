"""How soon does a thread waiting on a REFRESH job see a signal? The latencies behind
tests/python/test_sigint.py, measured here, not asserted there.

``Runtime.wait`` (asteria._C) waits in slices of 100 ms with the GIL released and runs the
signal handlers between them, so a signal is seen within one slice plus whatever the machine's
scheduler adds to it; a loaded machine adds more. Per repeat, on a one-worker HostPoolEngine
whose job sleeps first (the test-only job delay, tests/python/job_delay.py), so that the wait
outlasts what is measured:

* ``interrupt``: SIGINT from a timer thread while the main thread waits: seconds from
  ``os.kill`` to the KeyboardInterrupt in the main thread;
* ``handler``: SIGUSR1 with a handler that does not raise: seconds from ``os.kill`` to the
  handler's run (the wait goes on);
* ``timed_overshoot``: a wait with a 0.25 s timeout on a job that outlasts it: seconds past
  0.25 at which TimeoutError is raised (the last slice is what is left, not 100 ms).

Reports median / p99 / max per kind, and the load averages before and after.

    python3 benchmarks/bench_sigint.py --repeats 50          # about a minute
    python3 benchmarks/bench_sigint.py --repeats 3 --out-dir /tmp/x   # a smoke run

Writes benchmarks/results/bench_sigint.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python"))
import common  # noqa: E402

NAME = "bench_sigint"
KINDS = ("interrupt", "handler", "timed_overshoot")
JOB_DELAY_MS = 1500   # every job sleeps this long first: the waits outlast what is measured
SEND_AFTER_S = 0.15   # the signal's timer, from the start of the wait
TIMEOUT_S = 0.25      # the timed wait's timeout


def _engine():
    import torch
    from job_delay import set_job_delay

    from asteria.refresh.host_pool import HostPoolEngine

    eng = HostPoolEngine({"workers": 1})
    set_job_delay(eng.runtime, JOB_DELAY_MS)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g, dtype=torch.float64)
    f = (a @ a.T / 16 + torch.eye(16, dtype=torch.float64))[None]
    return eng, eng.submit("eigh", f, block=1, version=1, deadline=1, snapshot_step=0)


def _send_later(sig: int, sent: list) -> threading.Timer:
    def send() -> None:
        sent.append(time.monotonic())
        os.kill(os.getpid(), sig)

    timer = threading.Timer(SEND_AFTER_S, send)
    timer.start()
    return timer


def interrupt_s() -> float:
    """Seconds from SIGINT to the KeyboardInterrupt of a wait."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    eng, ticket = _engine()
    sent: list = []
    timer = _send_later(signal.SIGINT, sent)
    try:
        try:
            eng.wait(ticket)
        except KeyboardInterrupt:
            lag = time.monotonic() - sent[0]
        else:
            raise RuntimeError(f"the job ({JOB_DELAY_MS} ms) ended before the SIGINT of "
                               f"{SEND_AFTER_S} s reached the wait")
        eng.wait(ticket)
        return lag
    finally:
        timer.cancel()
        timer.join()
        eng.close()
        signal.signal(signal.SIGINT, old)


def handler_s() -> float:
    """Seconds from SIGUSR1 to its (non-raising) handler's run during a wait."""
    ran: list = []
    old = signal.signal(signal.SIGUSR1, lambda *a: ran.append(time.monotonic()))
    eng, ticket = _engine()
    sent: list = []
    timer = _send_later(signal.SIGUSR1, sent)
    try:
        eng.wait(ticket)
        return ran[0] - sent[0]
    finally:
        timer.cancel()
        timer.join()
        eng.close()
        signal.signal(signal.SIGUSR1, old)


def timed_overshoot_s() -> float:
    """Seconds past its timeout at which a timed wait raises TimeoutError."""
    eng, ticket = _engine()
    try:
        t0 = time.monotonic()
        try:
            eng.wait(ticket, timeout=TIMEOUT_S)
        except TimeoutError:
            over = time.monotonic() - t0 - TIMEOUT_S
        else:
            raise RuntimeError(f"the job ({JOB_DELAY_MS} ms) ended within the timeout")
        eng.wait(ticket)
        return over
    finally:
        eng.close()


def run(args, argv) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    log, meta = common.start_run(NAME, __file__, argv)
    samples: dict = {k: [] for k in KINDS}
    for i in range(args.repeats):
        samples["interrupt"].append(interrupt_s())
        samples["handler"].append(handler_s())
        samples["timed_overshoot"].append(timed_overshoot_s())
        log(f"repeat {i + 1}/{args.repeats}: " + ", ".join(
            f"{k} {1e3 * samples[k][-1]:.1f} ms" for k in KINDS))
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    data = {**meta,
            "settings": {"repeats": args.repeats, "job_delay_ms": JOB_DELAY_MS,
                         "send_after_s": SEND_AFTER_S, "timeout_s": TIMEOUT_S,
                         "wait_slice_ms": 100},
            "summary": {k: common.summarize_ms(v) for k, v in samples.items()},
            "samples_s": samples}
    return common.finish(data, NAME, args.out_dir, True, print_table, None, log)


def print_table(data: dict) -> None:
    common.print_header(f"{'kind':16s} {'median ms':>10s} {'p99 ms':>10s} {'max ms':>10s}")
    for k, s in data["summary"].items():
        print(f"{k:16s} {s['median_ms']:10.1f} {s['p99_ms']:10.1f} {s['max_ms']:10.1f}")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out-dir", default=None,
                    help="where the JSON goes (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


main = common.make_main(run, parse_args)

if __name__ == "__main__":
    main()
