"""``python3 -m asteria.plan`` with replicas (``--nodes``, ``--gpus-per-node``, ``--parallel``)
and ``asteria.plan.replica_round``: the owners are the coherence registry's (asteria._C), fed
as the optimizer's replicated engine feeds it; work is conserved over owners (DDP), divided by
the nodes (HSDP), a shard's own (FSDP); the table's new columns; errors name the option.

No timing: the cost model is given (10 GFLOP/s per core), so rounds are FLOPs / rate.
"""

from __future__ import annotations

import pytest
import torch

from asteria import RuntimeConfig, plan
from asteria.distributed import set_replicas
from asteria.optim import SOAP
from asteria.refresh import cost as C
from asteria.refresh.inline_torch import InlineTorchEngine
from models import require_c_extension

MLP = [(128, 128)] * 4          # benchmarks/bench_cluster.py's model: 4 Linear 128 x 128
MIXED = [(8, 64), (64, 96), (200, 64), (32, 64)]  # factors of 8, then 64, then 32


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def given(gflops: float = 10.0) -> C.CostModel:
    return C.CostModel({"host": gflops}, "given")


def soap_seconds(n: int, entries: int = 1, gflops: float = 10.0) -> float:
    return entries * C.flops("soap_qr", n) / (gflops * 1e9)


# ---- owners: the registry's ----------------------------------------------------------------------

def test_owners_follow_the_registrys_lpt():
    # one batch of 5 equal entries over 3 ranks, then one of 2 larger ones: LPT continues from
    # the loads (cost n^3), ties to the lowest rank, entries in id order
    batches = [(64, 5), (128, 2)]
    assert plan.owners(batches, [1, 3, 5], 6) == [[1, 3, 5, 1, 3], [5, 1]]
    # a rank-local job (one replica) never reaches the registry: its rank computes everything
    assert plan.owners(batches, [2], 6) == [[2] * 5, [2] * 2]


class Recording(InlineTorchEngine):
    """The inline engine, declared replicated so the optimizer passes ``opts.replicas``: it
    records every submit as ``ReplicatedEngine.submit`` would see it (S: the job's deadline -
    snapshot step)."""

    replicated = True
    takes_parts = False

    def __init__(self):
        super().__init__()
        self.submits = []

    def submit(self, op, f, q=None, **kw):
        self.submits.append((kw["block"], int(f.shape[0]), int(f.shape[-1]),
                             tuple(kw["opts"].replicas), kw["deadline"] - kw["snapshot_step"]))
        return super().submit(op, f, q, **kw)


def test_owners_match_a_replicated_optimizer_feeding_the_registry(monkeypatch):
    """SOAP's own REFRESH batches (order, sizes, block keys), fed to a registry exactly as
    ReplicatedEngine.submit does, give the owners replica_round predicts."""
    from asteria import _C
    from asteria.refresh import select

    ranks, staleness = (0, 1, 2, 3), 2
    eng = Recording()
    monkeypatch.setattr(select, "make_engine", lambda *a, **k: eng)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in MIXED]
    set_replicas(params, ranks)
    opt = SOAP(params, block_size=64, precondition_frequency=2,
               runtime=RuntimeConfig(mode="async", staleness=staleness))
    try:
        for _ in range(6):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
    finally:
        opt.close()
    # the INIT round (S = 0) has a channel of its own; the REFRESH rounds share (ranks, S)'s
    refresh = [s for s in eng.submits if s[4] == staleness]
    assert refresh and all(s[3] == ranks for s in refresh)
    assert {s[4] for s in eng.submits} == {0, staleness}
    reg = _C.Coherence(len(ranks), 0)
    owned = [dict() for _ in ranks]
    known, batches = set(), []
    for block, batch, n, _, _ in refresh:
        ids = [(block << 20) | i for i in range(batch)]
        new = [b for b in ids if b not in known]
        if new:
            reg.extend(new, [_C.coherence_dim_cost(n)] * len(new), replicas=list(ranks))
            known.update(new)
            batches.append((n, len(new)))
            for b in new:
                r = reg.owner(b)
                owned[r][n] = owned[r].get(n, 0) + 1
    reg.close()
    assert len(refresh) > len(batches)  # later rounds: the same blocks, no new owners
    # the planner's batches: the same sizes, entries and order (parameters, blocks, dimensions)
    assert batches == list(plan.factors(MIXED, 2048, 64).items()) == [(8, 2), (64, 12), (32, 2)]
    got = plan.replica_round(MIXED, "soap", 2, 2, "ddp", 2, given(), 2048, 64)
    assert got["owner_factors"] == owned


# ---- the layouts -------------------------------------------------------------------------------

def test_ddp_round_no_longer_than_one_rank_and_work_conserved():
    one = plan.replica_round(MLP, "soap", 1, 1, "ddp", 2, given(), 2048, 64)
    four = plan.replica_round(MLP, "soap", 2, 2, "ddp", 2, given(), 2048, 64)
    assert one["round_s"] == pytest.approx(one["single_rank_s"])
    assert four["replica_sets"] == [(0, 1, 2, 3)] and four["replica_set_size"] == 4
    assert four["round_s"] <= one["round_s"] and four["speedup"] >= 1.0
    assert four["single_rank_s"] == pytest.approx(one["round_s"])
    # 4 layers x 4 blocks of 64 x 64 x 2 factors: 32 entries, 8 per rank, 4 rounds of 2 cores
    assert sum(four["owner_gflop"]) == pytest.approx(one["single_rank_gflop"])
    assert four["gflop"] == pytest.approx(one["gflop"])
    assert four["owner_factors"] == [{64: 8}] * 4
    assert four["owner_seconds"] == pytest.approx([soap_seconds(64, 4)] * 4)
    assert four["busy_seconds"] == pytest.approx([soap_seconds(64, 8)] * 4)
    assert one["round_s"] == pytest.approx(soap_seconds(64, 16))
    assert four["speedup"] == pytest.approx(4.0)
    assert four["round_s"] == max(four["owner_seconds"])


def test_hsdp_divides_a_shard_over_the_nodes():
    for nodes in (1, 2, 4):
        r = plan.replica_round(MLP, "soap", nodes, 2, "hsdp", 2, given(), 2048, 64)
        assert r["replica_sets"] == [tuple(g + 2 * k for k in range(nodes)) for g in (0, 1)]
        # a rank's shard: 64 rows of each layer, 2 blocks of 64 x 64: 16 factors per shard
        shard = plan.factors([(64, 128)] * 4, 2048, 64)
        for ranks in r["replica_sets"]:
            assert sum(r["owner_gflop"][k] for k in ranks) == pytest.approx(
                sum(j.flops for j in plan.round_jobs(shard, "soap")) / 1e9)
            assert [r["owner_factors"][k] for k in ranks] == [{64: 16 // nodes}] * nodes
        assert r["round_s"] == pytest.approx(soap_seconds(64, 16 // nodes // 2))


def test_fsdp_a_rank_computes_its_shards_factors():
    shapes = [(130, 64), (5, 64)]
    r = plan.replica_round(shapes, "soap", 2, 2, "fsdp", 1, given(), 2048, 64)
    assert r["replica_sets"] == [(0,), (1,), (2,), (3,)] and r["replica_set_size"] == 1
    for k in range(4):
        local = [plan.shard_shape(s, 4, k) for s in shapes]
        want = plan.factors([s for s in local if s[0]], 2048, 64)
        assert r["owner_factors"][k] == dict(want)
    # 5 rows in 4 shards as torch.chunk cuts them: 2, 2, 1 and an empty one
    assert [plan.shard_shape((5, 64), 4, k)[0] for k in range(4)] == [
        c.shape[0] for c in torch.empty(5, 64).chunk(4)] + [0]
    assert [plan.shard_shape((130, 64), 4, k)[0] for k in range(4)] == [33, 33, 33, 31]


def test_shards_match_dtensor_shard0():
    placement = pytest.importorskip("torch.distributed.tensor.placement_types")
    shard = placement.Shard(0)
    if not hasattr(shard, "_local_shard_size_and_offset"):
        pytest.skip("this torch's Shard has no _local_shard_size_and_offset")
    for rows in (1, 5, 7, 128, 130, 4095):
        for parts in (1, 2, 3, 4, 8):
            assert [plan.shard_shape((rows, 8), parts, k)[0] for k in range(parts)] == [
                shard._local_shard_size_and_offset(rows, parts, k)[0] for k in range(parts)]


def test_bad_arguments_name_the_option_and_the_allowed_values():
    for kw, msg in [({"nodes": 0}, "nodes=0: allowed: an integer >= 1"),
                    ({"gpus_per_node": -1}, "gpus_per_node=-1: allowed: an integer >= 1"),
                    ({"cores": 0}, "cores=0: allowed: an integer >= 1"),
                    ({"parallel": "zero"}, "parallel='zero': allowed: ddp, hsdp, fsdp"),
                    ({"optimizer": "adam"}, "optimizer='adam': allowed:")]:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            plan.replica_round(MLP, **{"cost_model": given(), **kw})


# ---- the CLI -----------------------------------------------------------------------------------

def test_cli_prints_the_replica_columns(capsys):
    base = ["--shape", "128x128", "--shape", "128x128", "--shape", "128x128", "--shape",
            "128x128", "--block-size", "64", "--step-time", "0.01", "--gflops-per-core", "10",
            "--cores", "2"]
    assert plan.main(base) == 0
    alone = capsys.readouterr().out
    assert plan.main(base + ["--nodes", "1", "--gpus-per-node", "1", "--parallel", "ddp"]) == 0
    assert capsys.readouterr().out == alone          # one rank: today's table, unchanged
    assert "replica set" not in alone
    assert plan.main(base + ["--nodes", "2", "--gpus-per-node", "2", "--parallel", "ddp"]) == 0
    out = capsys.readouterr().out
    head, line = out.splitlines()[:2]
    for col in ("ranks", "replica set", "round s/set", "speed-up", "smallest S/set"):
        assert col in head
    assert line.split()[-5:-2] == ["4", "4", f"{soap_seconds(64, 4):.2f}"]
    assert line.split()[-2] == "4.00x"
    assert "ddp on 2 node(s) x 2 GPU(s): 1 replica set(s) of 4 rank(s)" in out
    assert "not modelled" in out


@pytest.mark.parametrize("args,msg", [
    (["--nodes", "0"], "argument --nodes: '0': allowed: an integer >= 1"),
    (["--gpus-per-node", "x"], "argument --gpus-per-node: 'x': allowed: an integer >= 1"),
    (["--parallel", "zero"], "argument --parallel: invalid choice: 'zero'"),
])
def test_cli_bad_input_names_the_option(capsys, args, msg):
    with pytest.raises(SystemExit):
        plan.main(["--shape", "128x128", "--step-time", "1", "--gflops-per-core", "10"]
                  + args)
    err = capsys.readouterr().err
    assert msg in err
    if "--parallel" in args:
        assert "ddp" in err and "hsdp" in err and "fsdp" in err
