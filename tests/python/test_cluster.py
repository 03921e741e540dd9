"""Multi-node tests on an emulated cluster (tests/python/cluster/netns.py; docs/distributed.md
"An emulated cluster"): 2 nodes x 2 ranks, each node a network namespace, gloo between nodes
over links shaped by a token bucket. Needs root, iproute2 and the veth / bridge / tbf kernel
modules; skips, saying which is missing, without them.

One torchrun launch per node runs tests/python/cluster/train.py (HSDP, then DDP hierarchical
and flat; per-rank results in JSON); the rank-death test launches its four processes itself
(dist/die.py says why). The fault tests (docs/distributed.md "Failures and timeouts") run
tests/python/cluster/faults.py, launched the same way: a straggler and a short link cut, each
beside its baseline (one launch); a long link cut; a rank SIGKILLed inside a version exchange
while checkpointing, then the resume from its last checkpoint on 1 node x 2 ranks. Every
namespace is gone after each launch (checked last). benchmarks/bench_cluster.py --quick runs
once, as a child process, on a cluster of its own.

Budget: about 4 minutes on 2 loaded cores, most of it processes importing torch (six, then
four six times, then two) and the faults' own seconds (sleeps, cuts, timeouts).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from test_distributed import _child_env, _tail

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "cluster"))
import netns  # noqa: E402

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
RATE = "50mbit"              # the inter-node links: slow, yet no wait in a test this small
LAUNCH_TIMEOUT = 240

pytestmark = [pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is needed"),
    # the harness and the protocol's faults: checked once, in the main environment
    # (scripts/run_tests.sh); the protocol under each torch is test_distributed.py's
    pytest.mark.main_env_only]


@pytest.fixture(scope="module")
def can_cluster():
    why = netns.unavailable()
    if why:
        pytest.skip(f"no emulated cluster here: {why}")


def _ours() -> list[str]:
    return [ns for ns in netns._namespaces() if ns.startswith(f"{netns.PREFIX}{os.getpid()}-")]


# ---- ranks started directly (no torchrun), the store apart --------------------------------------

def _start_ranks(c, argv, out: str, env=None, per_node: int = PER_NODE) -> list:
    """The job's store on node 0 (dist/store.py), then every rank of ``c`` running ``argv``
    with torchrun's environment (``rank_env``), rank r's output in OUT/rank<r>.log."""
    c.popen(0, [sys.executable, os.path.join(HERE, "dist", "store.py"), c.addr(0),
                str(netns.RDZV_PORT)], _child_env(), stdout=subprocess.DEVNULL)
    procs = []
    for r in range(c.nodes * per_node):
        with open(os.path.join(out, f"rank{r}.log"), "w") as fh:
            procs.append(c.popen(r // per_node, [sys.executable, *argv],
                                 c.rank_env(r, per_node, env or _child_env()), stdout=fh,
                                 stderr=subprocess.STDOUT))
    return procs


def _log(out: str, rank: int) -> str:
    with open(os.path.join(out, f"rank{rank}.log"), errors="replace") as fh:
        return fh.read()


def _wait_all(procs, limit: float, out: str, what: str, tick=None) -> list:
    """Every process's exit time (CLOCK_MONOTONIC), polling every 20 ms and calling ``tick()``
    meanwhile; past ``limit`` seconds the test fails with ``what`` and the ranks' logs."""
    t0, exits = time.monotonic(), [None] * len(procs)
    while None in exits:
        for i, p in enumerate(procs):
            if exits[i] is None and p.poll() is not None:
                exits[i] = time.monotonic()
        if time.monotonic() - t0 > limit:
            pytest.fail(f"{what} (> {limit:g} s):\n" + "\n".join(
                _tail(os.path.join(out, f"rank{r}.log")) for r in range(len(procs))))
        if tick is not None:
            tick()
        time.sleep(0.02)
    return exits


def _assert_names(msg: str, rank: int, lost: list, after_step: int) -> None:
    """A CoherenceError of ``rank`` naming the lost peers and a unit installed in the two steps
    after ``after_step``."""
    assert "CoherenceError" in msg and f"failed on rank {rank} " in msg, msg
    found = re.search(r"lost peers \[([0-9, ]*)\]", msg)
    assert found and found.group(1) == ", ".join(map(str, lost)), msg
    step = re.search(r"installed at step (\d+)", msg)
    assert step and after_step < int(step.group(1)) <= after_step + 2, msg


def test_link_rate_and_down_up(can_cluster, report):
    """The harness's link controls: 1 MB from node 0 to node 1 takes >= 1 s at 8 Mbit/s (the
    token bucket holds it back, less its first burst); set to 80, both ends' buckets run at
    80 Mbit/s and the transfer goes through; with node 1's link down a connection times out;
    up again, it works. How long the 80 Mbit/s transfers take (about 0.1 s; a loaded machine
    adds its own delays) goes to the report, not into a verdict."""
    server = ("import socket\n"
              "s = socket.socket(); s.bind(('0.0.0.0', 5000)); s.listen()\n"
              "while True:\n"
              "    a, _ = s.accept()\n"
              "    while a.recv(1 << 16): pass\n"
              "    a.close()\n")
    client = ("import socket, sys, time\n"
              "t = time.monotonic()\n"
              "try:\n"
              "    s = socket.create_connection(('%s', 5000), timeout=2)\n"
              "    s.sendall(b'x' * 1000000); s.shutdown(socket.SHUT_WR); s.recv(1)\n"
              "except OSError as e:\n"
              "    print('ERROR', type(e).__name__); sys.exit(0)\n"
              "print(time.monotonic() - t)\n")
    with netns.Cluster(NODES, "8mbit") as c:
        c.popen(1, [sys.executable, "-c", server])

        def send() -> str:
            out = subprocess.run(["ip", "netns", "exec", c.ns(0), sys.executable, "-c",
                                  client % c.addr(1)], capture_output=True, text=True, timeout=30)
            return out.stdout.strip()

        for _ in range(50):  # the server is listening once a connection succeeds
            slow = send()
            if not slow.startswith("ERROR"):
                break
            time.sleep(0.1)
        assert float(slow) >= 0.9, slow  # 8e6 bits at 8 Mbit/s, less the first burst
        for node in range(NODES):
            c.set_rate(node, "80mbit")
        for node in range(NODES):
            st = c.link_stats(node)
            assert st["tbf_out"]["rate_bits"] == st["tbf_in"]["rate_bits"] == 80e6, st
        fast = float(send())
        c.link_down(1)
        assert send() == "ERROR TimeoutError"
        c.link_up(1)
        again = float(send())
        stats = c.link_stats(0)
        assert stats["tx_bytes"] >= 3e6 and stats["tbf_out"]["sent_bytes"] >= 3e6, stats
    report["link_1MB_s"] = {"8mbit": round(float(slow), 3), "80mbit": round(fast, 3),
                            "80mbit_after_down_up": round(again, 3)}
    assert not _ours()


@pytest.fixture(scope="module")
def results(can_cluster, tmp_path_factory):
    """tests/python/cluster/train.py on 2 nodes x 2 ranks over torchrun: {rank: {check:
    result}}, and each node's link counters over the whole launch."""
    out = str(tmp_path_factory.mktemp("cluster"))
    script = [os.path.join(HERE, "cluster", "train.py"), "--out", out]
    logs = [os.path.join(out, f"node{i}.log") for i in range(NODES)]
    t0 = time.monotonic()
    with netns.Cluster(NODES, RATE) as c:
        procs = []
        for node in range(NODES):
            with open(logs[node], "w") as fh:
                procs.append(c.torchrun(node, script, PER_NODE, _child_env(), stdout=fh,
                                        stderr=subprocess.STDOUT))
        try:
            for p in procs:
                p.wait(timeout=max(1.0, LAUNCH_TIMEOUT - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the cluster launch hung (> {LAUNCH_TIMEOUT} s):\n" +
                        "\n".join(_tail(log) for log in logs))
        if any(p.returncode for p in procs):
            pytest.fail("the cluster launch failed:\n" + "\n".join(_tail(log) for log in logs))
        links = [c.link_stats(node) for node in range(NODES)]
    res = {}
    for r in range(WORLD):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            res[r] = json.load(fh)
    res["links"] = links
    res["elapsed_s"] = time.monotonic() - t0
    shutil.rmtree(out, ignore_errors=True)
    return res


def _per_node(results, check, key=None):
    """The node's link counters of a check, from each node's local rank 0."""
    out = []
    for node in range(NODES):
        r = results[node * PER_NODE][check]
        out.append((r[key] if key else r)["link"])
    return out


def test_hsdp_over_the_link(results):
    """HSDP (replicas {0, 2} and {1, 3}, one per node), SOAP async: replicas bitwise equal after
    the steps; every coherence transfer crossed the nodes, and each node received at least the
    coherence bytes its ranks counted over its link."""
    per_rank = [results[r]["hsdp"] for r in range(WORLD)]
    assert [r["partner"] for r in per_rank] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["replicas_equal"] for r in per_rank)
    assert all(r["bytes_intra_node"] == 0 and r["bytes_inter_node"] > 0 for r in per_rank)
    for node, link in enumerate(_per_node(results, "hsdp")):
        counted = sum(per_rank[r]["bytes_inter_node"]
                      for r in range(node * PER_NODE, (node + 1) * PER_NODE))
        assert link["rx_bytes"] >= counted, (node, link, counted)
    for link in results["links"]:  # the token buckets shaped that traffic without dropping it
        assert link["tbf_out"]["sent_bytes"] > 0 and link["tbf_out"]["dropped"] == 0, link


def test_hierarchy_sends_fewer_bytes_between_nodes(results):
    """The same DDP SOAP run, hierarchical and flat (same trajectory, replicas bitwise equal in
    both). On the wire, summed over the nodes' links: flat sends more between the nodes, by at
    least the payload the counters say it adds (per changed block: B hierarchical, 2 B by a
    direct flat delivery) and at most twice that (gloo's flat broadcast is a tree: from an owner
    on node 0 it crosses 2 B, from one on node 1 3 B) plus headers."""
    per_rank = {t: [results[r]["ddp_hier_flat"][t] for r in range(WORLD)]
                for t in ("hier", "flat")}
    assert all(results[r]["ddp_hier_flat"]["same_trajectory"] for r in range(WORLD))
    assert all(r["replicas_equal"] for t in per_rank for r in per_rank[t])
    inter = {t: sum(r["bytes_inter_node"] for r in per_rank[t]) for t in per_rank}
    assert 0 < inter["hier"] == inter["flat"] / PER_NODE, inter
    wire = {t: sum(link["tx_bytes"] for link in _per_node(results, "ddp_hier_flat", t))
            for t in per_rank}
    extra, payload = wire["flat"] - wire["hier"], inter["flat"] - inter["hier"]
    assert wire["hier"] < wire["flat"], wire
    assert payload <= extra <= 2.2 * payload, (wire, inter)


@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_bench_cluster_quick(can_cluster, tmp_path):
    """benchmarks/bench_cluster.py as a person runs it (--quick, DDP only, one rate): the JSON
    holds a result per (topology, S) with the link's bytes, the comm wait and the loss; hier and
    flat follow one trajectory (equal final losses) and hier's coherence payload between the
    nodes is 1/ranks-per-node of flat's."""
    script = os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks",
                          "bench_cluster.py")
    proc = subprocess.run([sys.executable, script, "--quick", "--layouts", "ddp", "--rates",
                           "1gbit", "--no-plot", "--out-dir", str(tmp_path)], env=_child_env(),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "bench_cluster.json") as fh:
        data = json.load(fh)
    assert "--quick" in data["command"] and data["machine"]["loadavg1"] is not None
    runs = {(r["topology"], r["staleness"]): r for r in data["results"]}
    assert set(runs) == {(t, s) for t in ("hier", "flat") for s in (1, 5)}
    for (t, s), r in runs.items():
        assert r["nodes"] == NODES and r["layout"] == "ddp" and r["units"] >= 2, r
        assert r["link_bytes"]["inter_node"] > 0 and 0 <= r["comm_wait_share"] < 1, r
        assert math.isfinite(r["final_loss"]) and r["step"]["median_ms"] > 0, r
        assert r["final_loss"] == runs[("flat", s)]["final_loss"], (t, s)
        assert (r["coherence_bytes"]["inter_node"] * (PER_NODE if t == "hier" else 1)
                == runs[("flat", s)]["coherence_bytes"]["inter_node"]), (t, s)
    left = [ns for ns in netns._namespaces() if ns.startswith(netns.PREFIX)
            and not netns._alive(int(ns[len(netns.PREFIX):].split("-")[0]))]
    assert not left, left  # the benchmark removed its cluster


def test_rank_sigkill_names_the_lost_peer_and_step(can_cluster, tmp_path):
    """Rank 3 (node 1) is SIGKILLed after step 4; ranks 0-2 (two on the other node) each fail
    within the coherence timeout (20 s) with a CoherenceError naming the lost peer, rank 3, and
    the unit's steps (installed at step 5 or 6: rank 3 may die before or after its part of the
    exchange of the unit installed at 5). Ranks started directly (dist/die.py says why), the
    store apart on node 0 (dist/store.py), as under torchrun."""
    die_step, timeout = 4, 20.0
    env = _child_env(DIE_RANK="3", DIE_STEP=str(die_step), DIE_TIMEOUT_S=str(timeout),
                     DIE_SIGKILL="1")
    with netns.Cluster(NODES, RATE) as c:
        procs = _start_ranks(c, [os.path.join(HERE, "dist", "die.py")], str(tmp_path), env)
        _wait_all(procs, 150, str(tmp_path), "a rank hung after its peer died")
    outputs = [_log(str(tmp_path), r) for r in range(WORLD)]
    assert procs[3].returncode == -9, outputs[3][-2000:]
    for r in range(3):
        lines = [ln for ln in outputs[r].splitlines() if ln.startswith(f"SURVIVOR {r} ")]
        assert lines and " FAILED " in lines[0], outputs[r][-3000:]
        assert procs[r].returncode == 1
        _, _, _, waited, msg = lines[0].split(" ", 4)
        assert float(waited) < timeout, lines[0]
        _assert_names(msg, r, [3], die_step)
    assert not _ours()


# ---- faults: a straggler, a link cut, a rank killed inside an exchange, a resume ----------------
# tests/python/cluster/faults.py is the per-rank body (its header says what each case does; its
# runs have 12 steps). Ranks are started directly, the store apart (dist/die.py says why):
# torchrun's agent would end the job as soon as one rank exits.

FAULTS = os.path.join(HERE, "cluster", "faults.py")
CUT_STEP = 4                # node 1's link goes down after this step
DIE_RANK, DIE_STEP = WORLD - 1, 7   # killed inside the first exchange after this step
SHORT_CUT_S, LONG_CUT_S, LONG_CUT_TIMEOUT_S = 4.0, 15.0, 6.0
# what the tests measured, not asserted (the links' transfer times, the faults' seconds): written
# as JSON to $ASTERIA_CLUSTER_FAULTS_JSON, else next to pytest's temporary directories, and
# printed (pytest -rP shows it)
REPORT: dict = {}


def _results(out: str, case: str, ranks) -> dict:
    res = {}
    for r in ranks:
        with open(os.path.join(out, f"{case}.rank{r}.json")) as fh:
            res[r] = json.load(fh)
    return res


def _faults(c, case: str, out: str, limit: float, *args, tick=None, per_node=PER_NODE):
    """faults.py's ``case`` on cluster ``c``: (processes, exit times)."""
    procs = _start_ranks(c, [FAULTS, "--out", out, "--case", case, *args], out,
                         per_node=per_node)
    return procs, _wait_all(procs, limit, out, f"the {case} launch hung", tick)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    yield REPORT
    if not REPORT:
        return
    import platform

    path = os.environ.get("ASTERIA_CLUSTER_FAULTS_JSON") or str(
        tmp_path_factory.getbasetemp() / "cluster_faults.json")
    doc = {"machine": {"node": platform.node(), "cpus": os.cpu_count(),
                       "affinity": len(os.sched_getaffinity(0)),
                       "load_avg": os.getloadavg()},
           "versions": {"python": platform.python_version(), "torch": torch.__version__},
           "command": "cd tests && python3 -m pytest python/test_cluster.py -p no:cacheprovider",
           "rate": RATE, **REPORT}
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"\ncluster tests measured ({path}):\n{json.dumps(REPORT, indent=1)}")


@pytest.fixture(scope="module")
def ckpt(can_cluster, tmp_path_factory):
    """Where the fault launches keep their checkpoints."""
    return str(tmp_path_factory.mktemp("ckpt"))


class _Cutter:
    """The driver's side of faults.py's cut handshake, run by ``_wait_all`` between polls: once
    rank 0 asks (OUT/cut.request), node ``node``'s link goes down and rank 0 is told
    (OUT/cut.down); it comes up again ``seconds`` later (None: never)."""

    def __init__(self, c, out: str, seconds=None, node: int = 1):
        self.c, self.out, self.seconds, self.node = c, out, seconds, node
        self.down = self.up = None

    def __call__(self) -> None:
        now = time.monotonic()
        if self.down is None:
            if os.path.exists(os.path.join(self.out, "cut.request")):
                self.c.link_down(self.node)
                self.down = time.monotonic()
                open(os.path.join(self.out, "cut.down"), "w").close()
        elif self.up is None and self.seconds is not None and now - self.down >= self.seconds:
            self.c.link_up(self.node)
            self.up = time.monotonic()


@pytest.fixture(scope="module")
def recovered(ckpt, tmp_path_factory):
    """faults.py recover: S = 1 and 5, each without and with rank 3 sleeping 2 s after steps 3
    and 7; node 1's link down for 4 s after step 4 of an S = 1 run (coherence timeout 20 s);
    the FSDP2 checkpoint of 4 ranks in CKPT/fsdp_local. The results per rank, and the cut's
    times."""
    out = str(tmp_path_factory.mktemp("recover"))
    with netns.Cluster(NODES, RATE) as c:
        cutter = _Cutter(c, out, SHORT_CUT_S)
        procs, _ = _faults(c, "recover", out, 180, "--ckpt", ckpt, "--timeout", "20",
                           "--at-step", str(CUT_STEP), tick=cutter)
    assert all(p.returncode == 0 for p in procs), [_tail(os.path.join(out, f"rank{r}.log"))
                                                   for r in range(WORLD)]
    res = _results(out, "recover", range(WORLD))
    res["cut"] = cutter
    return res


def test_straggler_costs_time_not_bits(recovered, report):
    """A rank 2 s late after two steps: at S = 1 and S = 5 (install="deterministic") every rank
    ends bitwise as without the straggler, replicas equal. The others wait at the install step
    of the first unit the straggler has not handed over (at S = 5, or in close(), up to S steps
    later); the time it cost the job is reported, not asserted. (Today's code did this
    already.)"""
    for s in (1, 5):
        base, slow = (f"S{s}_baseline", f"S{s}_straggler")
        for r in range(WORLD):
            got = recovered[r]
            assert got[slow]["replicas_equal"] and got[base]["replicas_equal"]
            assert got[slow]["state"] == got[base]["state"], (s, r)
            assert got[slow]["losses"] == got[base]["losses"], (s, r)
        job = {k: max(recovered[r][k]["job_s"] for r in range(WORLD)) for k in (base, slow)}
        waits = recovered[0][slow]["step_s"]
        report[f"straggler_S{s}"] = {
            "straggle": recovered[0]["straggle"],
            "job_s_without": round(job[base], 3), "job_s_with": round(job[slow], 3),
            "cost_s": round(job[slow] - job[base], 3),
            "rank0_steps_over_1s": [t + 1 for t, x in enumerate(waits) if x > 1.0]}


def test_short_link_cut_continues_bitwise(recovered, report):
    """Node 1's link down for 4 s after step 4 (coherence timeout 20 s): every rank finishes,
    bitwise as the run without the cut (the S = 1 baseline). The stall is longer than the cut:
    TCP retransmits on a doubling timeout, so traffic resumes at its first retransmission
    after the link is up. (Today's code did this already.)"""
    cutter = recovered["cut"]
    assert cutter.up is not None, "the run ended before the cut"
    for r in range(WORLD):
        assert recovered[r]["cut"]["state"] == recovered[r]["S1_baseline"]["state"], r
        assert recovered[r]["cut"]["losses"] == recovered[r]["S1_baseline"]["losses"], r
    report["short_cut"] = {"cut_s": round(cutter.up - cutter.down, 2), "timeout_s": 20,
                           "longest_step_s": round(max(max(recovered[r]["cut"]["step_s"])
                                                       for r in range(WORLD)), 2)}


def test_long_link_cut_fails_every_rank_in_time(can_cluster, tmp_path, report):
    """Node 1's link down for 15 s after step 4, coherence timeout 6 s: every rank fails within
    timeout + 6 s of the cut (the failure's own time, on the clock the cut's time is on: the
    code bounds the failure, a collective's timeout and a 5 s reading of the peers, not the
    process's exit after it, which the report keeps) with a CoherenceError naming the unit
    (installed at step 5 or 6).
    Node 0's ranks name the lost peers [2, 3] (their heartbeats stopped: the store is on node
    0); node 1's ranks cannot reach the store, so they name it and the peers beyond the cut,
    [0, 1] (before: "lost peers unknown (the store: no answer)", no peer named)."""
    out = str(tmp_path)
    with netns.Cluster(NODES, RATE) as c:
        cutter = _Cutter(c, out, LONG_CUT_S)
        procs, exits = _faults(c, "cut", out, 120, "--timeout", str(LONG_CUT_TIMEOUT_S),
                               "--at-step", str(CUT_STEP), tick=cutter)
    res = _results(out, "cut", range(WORLD))
    after = [x - cutter.down for x in exits]
    for r in range(WORLD):
        assert procs[r].returncode == 1 and "failed" in res[r], (r, _log(out, r)[-3000:])
        failed = res[r]["failed"]["at"] - cutter.down
        assert failed < LONG_CUT_TIMEOUT_S + 6.0, (r, failed, after)
        msg = res[r]["failed"]["error"]
        if r < PER_NODE:
            _assert_names(msg, r, [2, 3], CUT_STEP)
        else:
            assert "lost peers unknown (the store at 10.77.0.1:" in msg, msg
            assert "the peers on other nodes are [0, 1] (node 0)" in msg, msg
            step = re.search(r"installed at step (\d+)", msg)
            assert step and CUT_STEP < int(step.group(1)) <= CUT_STEP + 2, msg
    report["long_cut"] = {"cut_s": LONG_CUT_S, "timeout_s": LONG_CUT_TIMEOUT_S,
                          "failed_s_after_cut": [round(res[r]["failed"]["at"] - cutter.down, 2)
                                                 for r in range(WORLD)],
                          "exit_s_after_cut": [round(a, 2) for a in after]}


@pytest.fixture(scope="module")
def killed(ckpt, tmp_path_factory):
    """faults.py kill: a DCP checkpoint every 3 steps, rank 3 SIGKILLed inside the version
    exchange of the first unit after step 7. (processes, exit times after the death, results
    of the survivors, output folder)."""
    out = str(tmp_path_factory.mktemp("kill"))
    with netns.Cluster(NODES, RATE) as c:
        procs, exits = _faults(c, "kill", out, 150, "--timeout", "20", "--ckpt", ckpt,
                               "--at-step", str(DIE_STEP))
    with open(os.path.join(out, "died")) as fh:
        died = float(fh.read())
    res = _results(out, "kill", range(WORLD - 1))
    for r in res.values():
        if "failed" in r:
            r["failed"]["after_death_s"] = r["failed"]["at"] - died
    return procs, [x - died for x in exits], res, out


def test_rank_sigkill_inside_an_exchange(killed, ckpt, report):
    """Rank 3 SIGKILLed with its all_reduce of a version exchange started: as for a rank killed
    between steps, the survivors fail within the timeout (20 s: the failure's own time, not the
    process's exit after it) naming rank 3 and the unit.
    The checkpoints every survivor finished (steps 3 and 6) are whole (DCP's .metadata
    written); none was started after."""
    procs, after, res, out = killed
    assert procs[DIE_RANK].returncode == -9, _log(out, DIE_RANK)[-2000:]
    assert "DIES inside a version exchange" in _log(out, DIE_RANK)
    every = res[0]["ckpt_every"]
    saved = list(range(every, DIE_STEP + 1, every))
    for r in range(WORLD - 1):
        assert procs[r].returncode == 1 and "failed" in res[r], (r, _log(out, r)[-3000:])
        assert res[r]["failed"]["after_death_s"] < 20.0, (r, res[r]["failed"], after)
        _assert_names(res[r]["failed"]["error"], r, [DIE_RANK], DIE_STEP)
        assert res[r]["saved"] == saved, res[r]
    dirs = [f"step{t:03d}" for t in saved]
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("step")) == dirs
    for d in dirs:
        assert os.path.exists(os.path.join(ckpt, d, ".metadata")), d
    report["kill_inside_exchange"] = {"timeout_s": 20,
                                      "failed_s_after_death": [
                                          round(res[r]["failed"]["after_death_s"], 2)
                                          for r in range(WORLD - 1)],
                                      "exit_s_after_death": [round(a, 2) for a in after]}


@pytest.fixture(scope="module")
def resumed(killed, ckpt, tmp_path_factory):
    """faults.py resume on 1 node x 2 ranks from the last checkpoint of the kill launch."""
    out = str(tmp_path_factory.mktemp("resume"))
    last = max(d for d in os.listdir(ckpt) if d.startswith("step"))
    with netns.Cluster(1, RATE) as c:
        procs, _ = _faults(c, "resume", out, 120, "--timeout", "20", "--ckpt",
                           os.path.join(ckpt, last), per_node=PER_NODE)
    assert all(p.returncode == 0 for p in procs), [_tail(os.path.join(out, f"rank{r}.log"))
                                                   for r in range(PER_NODE)]
    return _results(out, "resume", range(PER_NODE))


def test_resume_on_one_node_is_the_uninterrupted_run(resumed, recovered):
    """The checkpoint of step 6 of the killed 4-rank job loads into a fresh job of 1 node x 2
    ranks, whose replicated blocks get new owners (each of the 2 ranks owns some and computes
    its share), and steps 7-12 are bit for bit those of the uninterrupted 4-rank run: losses,
    parameters and every optimizer-state tensor (every rank trains on the global batch, so the
    world size does not enter the arithmetic)."""
    base = recovered[0]["S1_baseline"]
    for r in range(PER_NODE):
        got = resumed[r]
        first = got["first"]
        assert first == 7 and got["replicated"] == PER_NODE, got
        assert got["owned"] > 0 and got["computed"] > 0 and got["received"] > 0, got
        assert got["losses"] == base["losses"][first - 1:], r
        assert got["params"] == base["params"] and got["state"] == base["state"], r


def test_fsdp_local_checkpoint_is_refused_on_fewer_nodes(resumed):
    """FSDP2 with per-shard blocking (fsdp_blocking="local", the default) saved on 4 ranks does
    not load on 2: torch.distributed.checkpoint's planner refuses on the keys, which carry the
    loading rank's shard (``@shard0of2``), before anything is loaded."""
    for r in range(PER_NODE):
        got = resumed[r]["fsdp_local"]
        assert not got["loaded"], got
        assert "Missing key in checkpoint state_dict: optim.state." in got["error"], got
        assert f"@shard{r}of2" in got["error"], got


def test_fsdp_local_refusal_names_the_mode_that_resumes(resumed):
    """The refusal says that the checkpoint is tied to its world size and names
    fsdp_blocking="global", as the optimizer's own refusal (checkpoint.py) does: the key DCP's
    planner names is the marker heading each per-shard state (``_layout.LOCAL_ONLY``)."""
    for r in range(PER_NODE):
        error = resumed[r]["fsdp_local"]["error"]
        assert "fsdp_blocking" in error and "global" in error, error


def test_nothing_left(results):
    """Every namespace this process made is gone (the launches above closed their clusters)."""
    assert not _ours(), _ours()
