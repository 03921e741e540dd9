"""A param group's ``num_experts`` (python/asteria/optim/_blocking.py, "Experts") under FSDP2,
on gloo (per-rank body: tests/python/dist/experts.py). The model holds E = 2 experts in an
(E * d_in, d_out) weight (OLMo-core's layout) and in an (E, d_in, d_out) one (torchtitan's),
each expert blocked whole, beside an ordinary weight; SOAP and Shampoo, 12 steps in float64,
sync and async (S = 2, deterministic installs):

- ``fsdp_blocking="global"`` on 1, 2 and 4 ranks (4 = 2 nodes x 2, two torchrun invocations
  that rendezvous): the parameters agree with the single-process run to rounding (float64 eps
  x 12 steps x cond 2e4 x the distance moved: tests/python/tolerance.py); every
  expert is one block, owned by one rank, also where a shard boundary splits it (4 ranks);
- ``fsdp_blocking="local"`` (the default) on 2 ranks, each rank holding one expert of each
  weight: the single-process optimizer again; on 4 ranks each rank holds half an expert of the
  flattened weight and preconditions it on its own (its factors are the half's), or an empty
  shard of the 3-D one;
- a DCP checkpoint saved on 4 ranks (global blocks, a refresh in flight) resumes on 2 and
  continues on the single-process trajectory.

Budget: about a minute on 2 shared cores (three launches, seven torchrun processes).
"""

from __future__ import annotations

import os

import pytest
import torch

from test_fsdp_global import launch
from tolerance import rounding_tol

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dist", "experts.py")
STEPS = 12  # dist/experts.py's, in float64
COND = 2e4  # its factors: ||F|| / gap <= 1.7e4 (measured over the 12 steps)
NAMES = ("soap", "shampoo")
D = 8  # dist/experts.py's width: an expert is D x D

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is needed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Training on 2 x 2, 2 and 1 ranks; a checkpoint saved on 2 x 2 after step 9, resumed on
    2."""
    base = tmp_path_factory.mktemp("experts_fsdp")
    ck = str(base / "ck4")
    return {4: launch(str(base / "w4"), "sync,async,local,save", 2, 2, ck, SCRIPT),
            2: launch(str(base / "w2"), "sync,async,local,resume", 1, 2, ck, SCRIPT),
            1: launch(str(base / "w1"), "sync,async", 1, 1, ck, SCRIPT)}


def _agree(res: dict, what) -> None:
    assert res["max_moved"] > 1e-2, (what, res)
    # rounding of each update in float64, over STEPS steps, times cond
    tol = rounding_tol(torch.float64, steps=STEPS, cond=COND) * res["max_moved"]
    assert res["max_abs_diff"] < tol, (what, tol, res)


def test_launch_layout(runs):
    assert [runs[4][r]["env"]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_global_blocking_matches_single_process(runs, world, mode):
    for name in NAMES:
        _agree(runs[world][0][mode][name], (world, mode, name))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_blocking_is_another_optimizer(runs, world):
    """The control: the same single-process run with the expert weights taken as plain
    tensors (one block each, no num_experts) is far away, so the agreement above is the
    experts'."""
    assert runs[world][0]["sync"]["soap"]["plain_control"]["max_rel_diff"] > 1e-3


@pytest.mark.parametrize("world", [1, 2, 4])
def test_global_blocks_are_whole_experts(runs, world):
    """Every expert is one block, kept by one rank with its D x D factors, also on 4 ranks
    where its rows are split between two shards. On 2 and 4 ranks 8 global blocks (2 experts of
    each expert weight, 4 blocks of the ordinary weight), each owned once; a one-rank mesh is
    not sharded, so its parameters take the ordinary path (no global blocks)."""
    for mode in ("sync", "async"):
        for name in NAMES:
            rs = [runs[world][r][mode][name] for r in range(world)]
            assert all(r["finite"] for r in rs), (mode, name)
            assert all(r["blocks"] == (8 if world > 1 else 0) for r in rs), (mode, name)
            assert sum(r["owned"] for r in rs) == rs[0]["blocks"], (mode, name)
            for w in ("w1", "w2"):
                owned = [b for r in rs for b in r[f"factors_{w}"]]
                assert sorted(owned) == ["b0", "b1"], (mode, name, w, owned)
                assert all(s == [[D, D], [D, D]] for r in rs
                           for s in r[f"factors_{w}"].values()), (mode, name, w)
    if world == 4:
        assert [runs[4][r]["sync"]["soap"]["local_rows"]["w1"] for r in range(4)] == [D // 2] * 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_local_blocking_one_expert_per_rank_matches_single_process(runs, mode):
    """2 ranks: each shard is one expert of each weight, blocked as one process blocks it."""
    for name in NAMES:
        _agree(runs[2][0]["local"][mode][name], ("local", mode, name))
        for r in range(2):
            res = runs[2][r]["local"][mode][name]
            assert res["local_rows"] == {"w1": D, "w2": 1}
            assert res["factors_w1"] == res["factors_w2"] == {"b0": [[D, D], [D, D]]}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_local_blocking_half_an_expert_per_rank(runs, mode):
    """4 ranks: each rank's D / 2 rows of the flattened weight are one block of their own
    (a left factor of D / 2); of the 3-D weight ranks 0, 1 hold one expert, ranks 2, 3 none
    (their shards are empty: a block of no rows, if any). Finite, and another optimizer than
    the single process (the half-expert blocks)."""
    for name in NAMES:
        for r in range(4):
            res = runs[4][r]["local"][mode][name]
            assert res["finite"], (mode, name, r)
            assert res["local_rows"] == {"w1": D // 2, "w2": 1 if r < 2 else 0}
            assert res["factors_w1"] == {"b0": [[D // 2, D // 2], [D, D]]}, (mode, name, r)
            if r < 2:
                assert res["factors_w2"] == {"b0": [[D, D], [D, D]]}, (mode, name, r)
            else:  # an empty shard: at most a block of no rows
                assert all(f[0] == [0, 0] for f in res["factors_w2"].values()), (mode, name, r)
        assert runs[4][0]["local"][mode][name]["max_rel_diff"] > 1e-4, (mode, name)


def test_checkpoint_saved_on_four_ranks_resumes_on_two(runs):
    """Saved with a refresh in flight (every rank saves the same install step), resumed on 2
    ranks: the trajectory continues (against the uninterrupted single process)."""
    for name in NAMES:
        flights = [runs[4][r]["save"][name]["in_flight"] for r in range(4)]
        assert all(f == flights[0] and f and min(f) > 0 for f in flights), (name, flights)
        _agree(runs[2][0]["resume"][name], ("resume", name))
