"""asteria._C.Coherence, the binding of the CoherenceRegistry (include/asteria/coherence.h), in
one process: 4 registries stand for 4 ranks on 2 nodes, and the version exchange is an
element-wise max of their vectors, as dist.all_reduce(MAX) computes it. Covers owners (LPT, also
incremental with extend), the full step protocol, hierarchical plans and byte counts, the
exchange buffers, the exception mapping and close."""

import pytest
import torch

from asteria import _C

W, RPN, S = 4, 2, 2


def world(staleness=S, **kw):
    return [_C.Coherence(W, r, ranks_per_node=RPN, staleness=staleness, **kw) for r in range(W)]


def exchange(regs, step):
    vecs = [torch.frombuffer(reg.versions_export(step), dtype=torch.int64) for reg in regs]
    combined = torch.stack(vecs).amax(0)
    for reg in regs:
        reg.versions_import(step, combined.numpy())


def test_owners_lpt_and_queries():
    regs = world()
    costs = {b: _C.coherence_dim_cost(n) for b, n in zip(range(1, 9), (64, 8, 32, 16, 64, 8, 8, 4))}
    for r, reg in enumerate(regs):
        order = list(costs.items())[r:] + list(costs.items())[:r]  # registration order differs
        for b, c in order:
            reg.register_block(b, c)
        reg.plan()
    owners = [regs[0].owner(b) for b in costs]
    assert all([reg.owner(b) for b in costs] == owners for reg in regs)
    # LPT by hand: 64^3 (ids 1, 5) to ranks 0, 1; 32^3 to rank 2; 16^3 to rank 3, which stays
    # the least loaded and so also takes the three 8^3 blocks and the 4^3 one
    assert owners == [0, 3, 2, 3, 1, 3, 3, 3]
    assert sum(regs[0].load(r) for r in range(W)) == sum(costs.values())
    assert regs[1].is_owner(5) and not regs[1].is_owner(1)
    assert regs[0].replicas(1) == (0, 1, 2, 3)
    assert regs[0].representatives(1) == (0, 2)
    info = regs[2].block_info(3)
    assert info["owner"] == 2 and info["nreplicas"] == 4 and info["is_replica"] is True
    assert info["version"] == 0 and info["snapshot_step"] == -1
    assert _C.coherence_dim_cost(2 ** 30) == 2 ** 64 - 1  # saturates


def test_extend_continues_lpt():
    regs = world()
    for reg in regs:
        reg.extend([1, 2, 3, 4], [8, 8, 8, 8])
    assert [regs[0].owner(b) for b in (1, 2, 3, 4)] == [0, 1, 2, 3]
    for r, reg in enumerate(regs):  # batch order does not matter
        reg.extend(*(([10, 11], [27, 1]) if r % 2 else ([11, 10], [1, 27])))
    assert all(reg.owner(10) == 0 and reg.owner(11) == 1 for reg in regs)
    assert regs[0].nblocks() == 6
    with pytest.raises(ValueError, match="already registered"):
        regs[0].extend([12, 4], [1, 1])
    with pytest.raises(ValueError, match="listed twice"):
        regs[0].extend([12, 12], [1, 1])
    with pytest.raises(ValueError, match="2 blocks but 1 costs"):
        regs[0].extend([12, 13], [1])
    assert regs[0].nblocks() == 6  # atomic
    with pytest.raises(_C.AsteriaError, match="plan is fixed") as ei:
        regs[0].register_block(20, 1)
    assert ei.value.name == "AST_ESTATE"


def test_protocol_installs_the_same_version_everywhere():
    regs = world()
    for reg in regs:
        reg.extend([1, 2, 3, 4], [8, 8, 8, 8])
    # refreshes snapshotted at step 10: owners publish (block b is owned by rank b - 1)
    for b in (1, 2, 3, 4):
        regs[b - 1].publish(b, 1, 10)
    for step in (11, 12):
        exchange(regs, step)
        due = [reg.due(step) for reg in regs]
        assert due == [()] * W if step == 11 else due == [(1, 2, 3, 4)] * W
        for r, reg in enumerate(regs):
            for b in due[r]:
                if not reg.is_owner(b):
                    with pytest.raises(_C.BusyError, match="sync first"):
                        reg.install_version(b, step)
                    reg.received(b, 1, step)
                reg.mark_synced(b, 1, step)
        versions = [[reg.install_version(b, step) for b in (1, 2, 3, 4)] for reg in regs]
        assert versions == ([[0] * 4] if step == 11 else [[1] * 4]) * W
    for reg in regs:
        st = reg.stats()
        assert st["max_lag_steps"] == S and st["installs"] == 4 and st["evaluated_step"] == 12
    assert regs[0].stats()["published"] == 1 and regs[0].stats()["received"] == 3
    # a late announcement is refused: step 20 evaluated, a snapshot of step 11 was due at 13
    regs[0].due(20)
    with pytest.raises(_C.AsteriaError, match="late"):
        regs[0].publish(1, 2, 11)


def test_hier_plan_and_byte_levels():
    regs = world()
    for reg in regs:
        reg.extend([7], [8])  # owned by rank 0 (node 0)
    plans = [reg.hier_plan(7) for reg in regs]
    assert [p["write_shm"] for p in plans] == [True, False, True, False]
    assert [p["read_shm"] for p in plans] == [False, True, False, True]
    assert [p["inter"] for p in plans] == ["send", "none", "recv", "none"]
    assert [p["recv_level"] for p in plans] == [None, "intra_node", "inter_node", "intra_node"]
    assert [p["flat_recv_inter"] for p in plans] == [False, False, True, True]
    B = 1000
    for reg, p in zip(regs, plans):
        if p["recv_level"]:
            reg.count_bytes(p["recv_level"], B)
        if p["flat_recv"]:
            reg.count_bytes("flat", B)
        if p["flat_recv_inter"]:
            reg.count_bytes("flat_inter_node", B)
    tot = {lv: sum(reg.stats()[f"bytes_{lv}"] for reg in regs)
           for lv in ("intra_node", "inter_node", "flat", "flat_inter_node")}
    assert tot == {"intra_node": 2 * B, "inter_node": B, "flat": 3 * B, "flat_inter_node": 2 * B}
    with pytest.raises(ValueError, match="unknown level"):
        regs[0].count_bytes("wire", 1)


def test_hsdp_replica_groups():
    groups = [0, 1, 0, 1]  # shard index per rank: replicas {0, 2} and {1, 3}
    regs = [_C.Coherence(W, r, ranks_per_node=RPN, staleness=0, replica_group=groups)
            for r in range(W)]
    regs[0].extend([1, 2], [8, 8])
    assert regs[0].replicas(1) == (0, 2) and regs[0].representatives(1) == (0, 2)
    p = regs[0].hier_plan(2)
    assert p["owner"] == 2 and p["inter"] == "recv" and not p["write_shm"]
    regs[1].register_block(9, 5, replicas=[3, 1])
    regs[1].plan()
    assert regs[1].replicas(9) == (1, 3)
    with pytest.raises(ValueError, match="one per rank"):
        _C.Coherence(W, 0, replica_group=[0, 1])


def test_exchange_buffers_and_bad_input():
    reg = _C.Coherence(2, 0, staleness=1)
    reg.extend([5, 6], [1, 1])
    assert _C.COH_XCHG_STRIDE == 3
    out = torch.zeros(6, dtype=torch.int64)
    assert reg.versions_export(3, out.numpy()) is not None
    with pytest.raises(ValueError, match="48 bytes"):
        reg.versions_export(3, torch.zeros(5, dtype=torch.int64).numpy())
    with pytest.raises(ValueError, match="48 bytes"):
        reg.versions_import(3, b"\0" * 40)
    with pytest.raises(ValueError, match="negative"):
        reg.versions_import(3, torch.tensor([-1, 0, 0, 0, 0, 0]).numpy())
    reg.due(3)
    with pytest.raises(ValueError, match="older than step"):
        reg.due(2)
    with pytest.raises(ValueError, match="rank 5 outside"):
        _C.Coherence(2, 5)
    with pytest.raises(FileNotFoundError, match="not registered"):
        reg.owner(99)
    with pytest.raises(ValueError, match="not the owner"):
        reg.publish(6, 1, 3)
    reg.barrier_begin(4)
    with pytest.raises(_C.AsteriaError, match="still open"):
        reg.barrier_begin(4)
    reg.barrier_end(4)
    assert reg.stats()["barrier_waits"] == 1
    assert "still open" in reg.last_error()


def test_close():
    with _C.Coherence(1, 0) as reg:
        reg.extend([1], [1])
        assert reg.owner(1) == 0 and not reg.closed
    assert reg.closed
    with pytest.raises(_C.AsteriaError, match="closed") as ei:
        reg.stats()
    assert ei.value.name == "AST_ESHUTDOWN"
    reg.close()  # idempotent
