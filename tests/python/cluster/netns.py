"""An emulated cluster on one machine: N nodes, each a network namespace holding that node's
ranks, joined through a shaped link each to a switch (docs/distributed.md "An emulated
cluster"). Shared by the tests (tests/python/test_cluster.py) and the benchmarks, which put
this directory on sys.path.

Owns: the namespaces, links and addresses of one ``Cluster`` (created on entry, removed on exit,
with every process still inside them), the launches into them (torchrun per node, or ranks
started directly), and the link controls (rate, down / up, byte counters). May call: ``ip`` and
``tc`` (iproute2), torch's launcher as a subprocess. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)
and the veth, bridge and tbf kernel modules; ``unavailable()`` says why not, for a skip.

Layout (``P`` = ``asteria-cluster-<pid>-<k>``, unique per process and cluster; interface names
live inside the namespaces, so they never collide with the host's or another cluster's):

    namespace P-sw      bridge br0, ports n0 .. n{N-1}
    namespace P-n{i}    lo (up), eth0 = 10.77.0.{i+1}/24, the veth peer of n{i}

The commands: ``ip netns add``; ``ip -n P-sw link add n{i} type veth peer name eth0 netns
P-n{i}``; ``ip ... master br0``, ``addr add``, ``link set up``; then a token bucket on each end of
each link, ``tc qdisc add dev eth0 root tbf rate R burst B latency L`` in P-n{i} (what the node
sends) and the same on n{i} in P-sw (what it receives). Nothing is created in the host's own
namespace, so the address range may repeat across clusters.

Traffic between two ranks of one node goes to the node's own address, which the kernel routes
over the namespace's loopback: it never crosses eth0, so eth0's counters are the node's
inter-node traffic and lo's its intra-node traffic (shared-memory copies count nowhere).
Ranks talk over gloo on eth0 (GLOO_SOCKET_IFNAME); the rendezvous store listens on node 0.

Not emulated: latency. The kernel has tbf but not netem, so a link has a rate and a queue and
the round trip is the host's (microseconds): a slow link here is a narrow one, not a far one.
Nor are a real NIC's offloads, other tenants' traffic, or separate CPUs and memory: all ranks
share this machine's cores, and the nodes share /dev/shm (the protocol's shared-memory names
carry the node, so they do not collide).

Removal: ``ip netns del`` of every namespace after killing (SIGKILL, by pid) every process
``ip netns pids`` lists in it; deleting P-sw removes the veth pairs. It runs on exit of the
``with`` block, at interpreter exit for a cluster left open, and for the namespaces of dead
processes (a run killed by SIGKILL) when the next cluster is made.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

PREFIX = "asteria-cluster-"
SUBNET = "10.77.0"      # node i is SUBNET.{i+1}/24
IFNAME = "eth0"         # a node's end of its link, inside its namespace
RDZV_PORT = 29400       # free: every node namespace is new
DEFAULT_RATE = "100mbit"
# tbf: a burst above the largest GSO segment (64 KiB) so big segments pass whole, and a queue
# long enough that a burst of gloo traffic waits instead of being dropped (a drop costs a
# retransmission, which adds bytes to the counters and time to the step)
BURST = "128kb"
QUEUE_LATENCY = "2s"

_open: list["Cluster"] = []
_seq = 0


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (ours: only we could enter it) and wait for
    them to go, so that the namespace really disappears with ``ip netns del``."""
    deadline = time.monotonic() + 10.0
    while True:
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _remove(ns: str) -> None:
    _kill_inside(ns)
    _run("ip", "netns", "del", ns, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces of clusters whose process is gone; returns their names."""
    stale = []
    for ns in _namespaces():
        m = re.match(re.escape(PREFIX) + r"(\d+)-", ns)
        if m and not _alive(int(m.group(1))):
            _remove(ns)
            stale.append(ns)
    return stale


def unavailable() -> Optional[str]:
    """Why a cluster cannot be made here (for a skip), or None: root, iproute2, and a probe
    namespace with a veth pair and a tbf qdisc."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    ns = f"{PREFIX}{os.getpid()}-probe"
    try:
        for argv in (("ip", "netns", "add", ns),
                     ("ip", "-n", ns, "link", "add", "probe0", "type", "veth", "peer", "name",
                      "probe1"),
                     ("tc", "-n", ns, "qdisc", "add", "dev", "probe0", "root", "tbf", "rate",
                      "1mbit", "burst", BURST, "latency", "50ms")):
            proc = _run(*argv, check=False)
            if proc.returncode != 0:
                return f"cannot {' '.join(argv[:5])}...: {proc.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", ns, check=False)
    return None


class Cluster:
    """``nodes`` emulated nodes joined by links shaped to ``rate`` (tc's syntax: "100mbit").
    Use as a context manager; everything it made is gone after the ``with`` block."""

    def __init__(self, nodes: int = 2, rate: str = DEFAULT_RATE):
        global _seq
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be in 1..250, got {nodes}")
        _seq += 1
        self.nodes = nodes
        self.rate = rate
        self.name = f"{PREFIX}{os.getpid()}-{_seq}"
        self.switch = f"{self.name}-sw"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    # ---- life ---------------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        remove_stale()
        _open.append(self)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns_add(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _create(self) -> None:
        sw = self.switch
        self._ns_add(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, port = self.ns(i), f"n{i}"
            self._ns_add(ns)
            _run("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", IFNAME,
                 "netns", ns)
            _run("ip", "-n", sw, "link", "set", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            for where, dev in ((ns, IFNAME), (sw, port)):
                _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", *self._tbf(self.rate))

    def close(self) -> None:
        """Kill what was launched, then remove the namespaces (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            _remove(ns)
        self._made = []
        if self in _open:
            _open.remove(self)

    # ---- names --------------------------------------------------------------------------------

    def ns(self, node: int) -> str:
        return f"{self.name}-n{node}"

    def addr(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @staticmethod
    def _tbf(rate: str) -> list[str]:
        return ["tbf", "rate", rate, "burst", BURST, "latency", QUEUE_LATENCY]

    # ---- launching ----------------------------------------------------------------------------

    def popen(self, node: int, argv: Sequence[str], env: Optional[dict] = None,
              **kw) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace (its own session, so it and its
        children can be killed together); gloo uses the node's link."""
        env = dict(os.environ if env is None else env)
        env["GLOO_SOCKET_IFNAME"] = IFNAME
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=env,
                             start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def torchrun(self, node: int, script_argv: Sequence[str], nproc_per_node: int,
                 env: Optional[dict] = None, **kw) -> subprocess.Popen:
        """torchrun for node ``node`` of the job: c10d rendezvous on node 0's address, whose
        agent hosts the store (said outright: torchrun's guess compares the endpoint with the
        host name's address, which is not the namespace's)."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
                "--node-rank", str(node), "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.addr(0)}:{RDZV_PORT}",
                "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", self.addr(node),
                "--max-restarts", "0", *script_argv]
        return self.popen(node, argv, env, **kw)

    def rank_env(self, rank: int, nproc_per_node: int, env: Optional[dict] = None) -> dict:
        """The environment torchrun would give ``rank`` (nodes of ``nproc_per_node`` ranks in
        rank order), for launching a rank without torchrun's agent. As under torchrun, every
        rank is a client of a store that outlives them, which the caller hosts on node 0 at
        ``addr(0)``:RDZV_PORT (tests/python/dist/store.py)."""
        env = dict(os.environ if env is None else env)
        env.update(RANK=str(rank), WORLD_SIZE=str(self.nodes * nproc_per_node),
                   LOCAL_RANK=str(rank % nproc_per_node),
                   LOCAL_WORLD_SIZE=str(nproc_per_node),
                   GROUP_RANK=str(rank // nproc_per_node), MASTER_ADDR=self.addr(0),
                   MASTER_PORT=str(RDZV_PORT), TORCHELASTIC_USE_AGENT_STORE="True")
        return env

    # ---- links --------------------------------------------------------------------------------

    def link_down(self, node: int) -> None:
        """Cut node ``node`` off: its switch port goes down (its eth0 loses carrier)."""
        _run("ip", "-n", self.switch, "link", "set", f"n{node}", "down")

    def link_up(self, node: int) -> None:
        _run("ip", "-n", self.switch, "link", "set", f"n{node}", "up")

    def set_rate(self, node: int, rate: str) -> None:
        """Reshape both directions of node ``node``'s link to ``rate``."""
        for where, dev in ((self.ns(node), IFNAME), (self.switch, f"n{node}")):
            _run("tc", "-n", where, "qdisc", "change", "dev", dev, "root", *self._tbf(rate))

    def link_stats(self, node: int) -> dict:
        """Node ``node``'s counters: eth0's tx / rx bytes (inter-node), lo's tx bytes
        (intra-node), and per direction what its token bucket sent and dropped and its rate in
        bit/s (``tc -s``)."""
        def dev_bytes(ns, dev):
            info = json.loads(_run("ip", "-n", ns, "-j", "-s", "link", "show", "dev",
                                   dev).stdout)[0]["stats64"]
            return info["tx"]["bytes"], info["rx"]["bytes"]

        def tbf(ns, dev):
            q = json.loads(_run("tc", "-n", ns, "-j", "-s", "qdisc", "show", "dev",
                                dev).stdout)[0]
            return {"sent_bytes": q["bytes"], "dropped": q["drops"],
                    "overlimits": q["overlimits"], "rate_bits": 8 * q["options"]["rate"]}

        tx, rx = dev_bytes(self.ns(node), IFNAME)
        lo_tx, _ = dev_bytes(self.ns(node), "lo")
        return {"tx_bytes": tx, "rx_bytes": rx, "lo_bytes": lo_tx,
                "tbf_out": tbf(self.ns(node), IFNAME), "tbf_in": tbf(self.switch, f"n{node}")}


def read_counters(ifname: str = IFNAME) -> dict:
    """From inside a node (a rank): this namespace's eth0 and lo byte counters, from
    /sys/class/net (``ip netns exec`` mounts the namespace's own sysfs)."""
    def read(dev, what):
        with open(f"/sys/class/net/{dev}/statistics/{what}") as fh:
            return int(fh.read())

    return {"tx_bytes": read(ifname, "tx_bytes"), "rx_bytes": read(ifname, "rx_bytes"),
            "lo_bytes": read("lo", "tx_bytes")}


@atexit.register
def _close_all() -> None:
    for c in list(_open):
        c.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run a per-rank script over an emulated cluster: torchrun on every node, then each node's
    link counters. ``--remove-stale`` only removes the namespaces of dead runs."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--rate", default=DEFAULT_RATE)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--remove-stale", action="store_true")
    ap.add_argument("script", nargs="*", help="script and its arguments (after --)")
    args = ap.parse_args(argv)
    if args.remove_stale:
        print("\n".join(remove_stale()) or "nothing stale")
        return 0
    why = unavailable()
    if why:
        print(f"cannot make a cluster: {why}", file=sys.stderr)
        return 77
    with Cluster(args.nodes, args.rate) as c:
        procs = [c.torchrun(i, args.script, args.nproc_per_node) for i in range(args.nodes)]
        t0, rc = time.monotonic(), 0
        for p in procs:
            try:
                rc = rc or p.wait(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                rc = 124
        for i in range(args.nodes):
            print(json.dumps({"node": i, **c.link_stats(i)}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
