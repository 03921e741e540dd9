"""Multi-node tests on an emulated cluster (tests/python/cluster/netns.py; docs/distributed.md
"An emulated cluster"): 2 nodes x 2 ranks, each node a network namespace, gloo between nodes
over links shaped by a token bucket. Needs root, iproute2 and the veth / bridge / tbf kernel
modules; skips, saying which is missing, without them.

One torchrun launch per node runs tests/python/cluster/train.py (HSDP, then DDP hierarchical
and flat; per-rank results in JSON); the rank-death test launches its four processes itself
(dist/die.py says why). Every namespace is gone after each launch (checked last).

Budget: about a minute on 2 cores, most of it six processes importing torch, then four.
"""

from __future__ import annotations

import json
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

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is needed")


@pytest.fixture(scope="module")
def can_cluster():
    why = netns.unavailable()
    if why:
        pytest.skip(f"no emulated cluster here: {why}")


def _ours() -> list[str]:
    return [ns for ns in netns._namespaces() if ns.startswith(f"{netns.PREFIX}{os.getpid()}-")]


def test_link_rate_and_down_up(can_cluster):
    """The harness's link controls: 1 MB from node 0 to node 1 takes >= 1 s at 8 Mbit/s and
    < 0.5 s at 80; with node 1's link down a connection times out; up again, it works."""
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
        fast = float(send())
        assert fast < 0.5, fast
        c.link_down(1)
        assert send() == "ERROR TimeoutError"
        c.link_up(1)
        assert float(send()) < 0.5
        stats = c.link_stats(0)
        assert stats["tx_bytes"] >= 3e6 and stats["tbf_out"]["sent_bytes"] >= 3e6, stats
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


def test_rank_sigkill_names_the_lost_peer_and_step(can_cluster):
    """Rank 3 (node 1) is SIGKILLed after step 4; ranks 0-2 (two on the other node) each fail
    within the coherence timeout (20 s) with a CoherenceError naming the lost peer, rank 3, and
    the unit's steps (installed at step 5 or 6: rank 3 may die before or after its part of the
    exchange of the unit installed at 5). Ranks started directly (dist/die.py says why), the
    store apart on node 0 (dist/store.py), as under torchrun."""
    die_step, timeout = 4, 20.0
    outputs, procs = [], []
    t0 = time.monotonic()
    with netns.Cluster(NODES, RATE) as c:
        c.popen(0, [sys.executable, os.path.join(HERE, "dist", "store.py"), c.addr(0),
                    str(netns.RDZV_PORT)], _child_env(), stdout=subprocess.DEVNULL)
        for r in range(WORLD):
            env = c.rank_env(r, PER_NODE, _child_env(DIE_RANK="3", DIE_STEP=str(die_step),
                                                      DIE_TIMEOUT_S=str(timeout),
                                                      DIE_SIGKILL="1"))
            procs.append(c.popen(r // PER_NODE, [sys.executable, os.path.join(HERE, "dist",
                                                                             "die.py")],
                                 env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True))
        try:
            for p in procs:
                out, _ = p.communicate(timeout=max(1.0, 150 - (time.monotonic() - t0)))
                outputs.append(out)
        except subprocess.TimeoutExpired:
            pytest.fail("a rank hung after its peer died")
    assert procs[3].returncode == -9, outputs[3][-2000:]
    for r in range(3):
        lines = [ln for ln in outputs[r].splitlines() if ln.startswith(f"SURVIVOR {r} ")]
        assert lines and " FAILED " in lines[0], outputs[r][-3000:]
        assert procs[r].returncode == 1
        _, _, _, waited, msg = lines[0].split(" ", 4)
        assert float(waited) < timeout, lines[0]
        assert "CoherenceError" in msg and f"failed on rank {r} " in msg, msg
        lost = re.search(r"lost peers \[([0-9, ]*)\]", msg)
        assert lost and lost.group(1) == "3", msg
        step = re.search(r"installed at step (\d+)", msg)
        assert step and die_step < int(step.group(1)) <= die_step + 2, msg
    assert not _ours()


def test_nothing_left(results):
    """Every namespace this process made is gone (the launches above closed their clusters)."""
    assert not _ours(), _ours()
