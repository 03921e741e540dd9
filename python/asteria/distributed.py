"""The distributed job as Asteria sees it: which ranks hold a copy of a parameter, the nodes
(``Topology``), and per replica set its process groups and host staging buffers (``_Link``).

Owns: the job's ``Topology`` (the node of every rank, a run id, the collective timeout); one
``_Link`` per replica set (its process groups: ``ctrl`` for the version exchange, ``node`` for
the node barriers, ``reps`` for the broadcast among node representatives) with its host staging
buffers (a file in /dev/shm shared by the replicas of one node, else private memory). The
executor that uses them, ``ReplicatedEngine``, is in ``asteria.refresh.replicated``
(DESIGN.md "Distributed", docs/coherence.md for the protocol, docs/distributed.md for this
layer). May call: torch, torch.distributed (gloo process groups only).
Threads: the links are made on the training thread; their groups and staging buffers are then
used by the replicated executor's protocol thread only.
"""

from __future__ import annotations

import dataclasses
import datetime
import mmap
import os
import tempfile
import uuid
import warnings
from typing import Iterable, Optional, Sequence

import torch


_ALIGN = 64             # payload offsets in a staging buffer
_MIN_STAGING = 1 << 16  # smallest shared staging file


def _dist():
    import torch.distributed as dist

    return dist


def _initialized() -> bool:
    try:
        dist = _dist()
    except Exception:
        return False
    return dist.is_available() and dist.is_initialized()


# ---- which ranks hold a copy of a parameter ---------------------------------------------------

def set_replicas(params: Iterable[torch.Tensor], ranks: Optional[Sequence[int]]) -> None:
    """Declare the ranks holding identical copies of these (non-DTensor) parameters, e.g. for DDP
    over a subgroup; ``None`` marks them rank-local (never synchronised). Call it before the
    optimizer is built, on every rank."""
    value = None if ranks is None else tuple(sorted(int(r) for r in ranks))
    for p in params:
        p._asteria_replicas = value


def replicas(p: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The global ranks holding an identical copy of ``p``'s local tensor (this rank included),
    or None when it is rank-local. A DTensor (FSDP2, HSDP) is replicated along the mesh
    dimensions where its placement is ``Replicate()``: the ranks sharing this rank's coordinates
    on every other dimension. A plain tensor in an initialised multi-rank job is taken as a DDP
    replica on every rank, unless ``set_replicas`` said otherwise."""
    if hasattr(p, "_asteria_replicas"):
        r = p._asteria_replicas
        return r if r is not None and len(r) > 1 else None
    if not _initialized():
        return None
    dist = _dist()
    if dist.get_world_size() == 1:
        return None
    import sys

    mod = sys.modules.get("torch.distributed.tensor")
    if mod is not None and isinstance(p, mod.DTensor):
        mesh = p.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:
            return None
        rep = [i for i, pl in enumerate(p.placements) if pl.is_replicate()]
        if not rep:
            return None
        index = tuple(slice(None) if i in rep else coord[i] for i in range(mesh.ndim))
        ranks = tuple(sorted(int(r) for r in mesh.mesh[index].flatten().tolist()))
        return ranks if len(ranks) > 1 else None
    return tuple(range(dist.get_world_size()))


# ---- topology ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Topology:
    """The job as the coherence layer sees it: ``nodes[r]`` is the node of rank r."""

    world: int
    rank: int
    nodes: tuple[int, ...]
    run_id: str
    timeout: datetime.timedelta

    @property
    def node(self) -> int:
        return self.nodes[self.rank]

    @property
    def ranks_per_node(self) -> int:
        return self.nodes.count(self.node)


def local_node_id(rank: int, ranks_per_node: Optional[int] = None) -> int:
    """This rank's node: rank // ``ranks_per_node`` (the runtime key; a simulation), else the
    launcher's GROUP_RANK (torchrun's node rank), else rank // LOCAL_WORLD_SIZE, else 0. The
    launcher's variables describe the job as the launcher started it, so they are read here,
    where the topology is made; no Asteria setting comes from the environment."""
    if ranks_per_node is not None:
        return rank // ranks_per_node
    if os.environ.get("GROUP_RANK"):
        return int(os.environ["GROUP_RANK"])
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return rank // int(os.environ["LOCAL_WORLD_SIZE"])
    return 0


def _world_timeout(timeout_s: Optional[float] = None) -> datetime.timedelta:
    """The collective timeout for our groups: ``timeout_s`` (the runtime key
    coherence_timeout_s), else the default group's (new_group would otherwise fall back to the
    30-minute default, not the value given to init_process_group)."""
    if timeout_s is not None:
        return datetime.timedelta(seconds=float(timeout_s))
    dist = _dist()
    try:
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        return dist.distributed_c10d.default_pg_timeout


# ---- process groups and staging of one replica set --------------------------------------------

class _Staging:
    """Host buffers for one replica set's transfers, double-buffered so that a fast rank can fill
    one while a slow one still reads the other. With other replicas on this node they are files
    in /dev/shm mapped by each of them (``torch.frombuffer`` over an mmap); every node member
    computes the same sizes, so all map the same generation of the same file, and its lowest rank
    unlinks it once every member has passed the first node barrier after mapping it."""

    def __init__(self, link: "_Link", topo: Topology):
        self._shared = link.node_group is not None
        self._unlinker = self._shared and topo.rank == min(link.node_members)
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self._prefix = os.path.join(base, f"asteria-{topo.run_id}-l{link.index}-n{topo.node}")
        self._bufs: list = [None, None]   # (tensor, capacity, generation) per parity
        self._gen = [0, 0]
        self._fresh: list[str] = []

    def get(self, nbytes: int, parity: int) -> torch.Tensor:
        cur = self._bufs[parity]
        if cur is not None and cur[1] >= nbytes:
            return cur[0]
        cap = max(_MIN_STAGING, 1 << max(nbytes - 1, 1).bit_length())
        if not self._shared:
            t = torch.empty(cap, dtype=torch.uint8)
        else:
            self._gen[parity] += 1
            path = f"{self._prefix}-p{parity}-g{self._gen[parity]}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < cap:
                    # reserve the pages: a full /dev/shm is an OSError here, not a SIGBUS later
                    if hasattr(os, "posix_fallocate"):
                        os.posix_fallocate(fd, 0, cap)
                    else:
                        os.ftruncate(fd, cap)
                mm = mmap.mmap(fd, cap)
            finally:
                os.close(fd)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.frombuffer(mm, dtype=torch.uint8)
            if self._unlinker:
                self._fresh.append(path)
        self._bufs[parity] = (t, cap, self._gen[parity])
        return t

    def mapped(self) -> None:
        """Every node member has passed a barrier after mapping: the names can go."""
        for path in self._fresh:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._fresh = []

    def close(self) -> None:
        self.mapped()
        self._bufs = [None, None]


class _Link:
    """The process groups of one replica set R (sorted global ranks) as seen by this rank."""

    def __init__(self, index: int, ranks: tuple[int, ...], topo: Topology, hierarchical: bool):
        self.index = index
        self.ranks = ranks
        self.hierarchical = hierarchical
        self.node_members = tuple(r for r in ranks if topo.nodes[r] == topo.node)
        by_node: dict = {}
        for r in ranks:
            by_node.setdefault(topo.nodes[r], []).append(r)
        self.reps = tuple(sorted(min(v) for v in by_node.values()))
        self.ctrl = None
        self.node_group = None
        self.reps_group = None
        self.staging: Optional[_Staging] = None
        self.units = 0  # units with traffic: the staging parity

    @staticmethod
    def create_all(sets: list[tuple[int, ...]], topo: Topology, hierarchical: bool,
                   first_index: int = 0) -> dict:
        """Create the groups of every replica set of the job, collectively: every rank calls
        new_group for every group in the same order (sets ascending), members or not."""
        dist = _dist()
        links = {}
        for index, ranks in enumerate(sets, start=first_index):
            mine = topo.rank in ranks
            link = _Link(index, ranks, topo, hierarchical) if mine else None

            def group(members):
                return dist.new_group(list(members), timeout=topo.timeout, backend="gloo")

            ctrl = group(ranks)
            if link is not None:
                link.ctrl = ctrl
            if hierarchical:
                nodes = sorted({topo.nodes[r] for r in ranks})
                for nd in nodes:
                    members = tuple(r for r in ranks if topo.nodes[r] == nd)
                    if len(members) < 2:
                        continue
                    g = ctrl if members == ranks else group(members)
                    if link is not None and topo.rank in members:
                        link.node_group = g
                if len(nodes) > 1:
                    reps = tuple(sorted(min(r for r in ranks if topo.nodes[r] == nd)
                                        for nd in nodes))
                    g = ctrl if reps == ranks else group(reps)
                    if link is not None and topo.rank in reps:
                        link.reps_group = g
            if link is not None:
                link.staging = _Staging(link, topo)
                links[ranks] = link
        return links


def make_topology(ranks_per_node: Optional[int] = None,
                  timeout_s: Optional[float] = None) -> Topology:
    """Collective over the default group: every rank's node and one run id. ``ranks_per_node``
    and ``timeout_s``: the validated runtime keys ranks_per_node and coherence_timeout_s
    (``local_node_id``, ``_world_timeout``)."""
    dist = _dist()
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = (local_node_id(rank, ranks_per_node), uuid.uuid4().hex[:12])
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    return Topology(world=world, rank=rank, nodes=tuple(int(g[0]) for g in gathered),
                    run_id=gathered[0][1], timeout=_world_timeout(timeout_s))
