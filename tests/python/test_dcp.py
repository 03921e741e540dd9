"""The three optimizers through torch.distributed.checkpoint (DCP), single process.

 - Flattened optimizer state dicts (``StateDictOptions(flatten_optimizer_state_dict=True)``)
   are loaded into the live state of a freshly built optimizer after DCP's fake step, keeping
   only the keys it has. Every preconditioned parameter therefore has one fixed key set from
   its state's creation on: a REFRESH in flight (``pending.*``, ``b{j}.pending{dim}.{i}``) and
   Shampoo's roots before their first install (``b{j}.Linv{i}``) are placeholders with flags.
   Saved mid-run with a refresh in flight (S = 3), through files or in memory, the resumed run
   continues bitwise.
 - DCP's fake step (``step()`` with zero gradients and lr 0 on an optimizer without state)
   launches no engine job and leaves the trajectory alone: the next real step starts afresh.
 - A param group with ``"algorithm": "adamw"`` sends its 2-D parameters to AdamW.
 - KL-Shampoo's ``compute_dtype`` is kept by name, so ``cpu_offload=True`` works.
 - FSDP2 with fsdp_blocking="local" (2 and 4 ranks, spawned): per-shard keys, and the refusals
   at another world size, DCP's naming the marker that heads each per-shard state
   (``_layout.LOCAL_ONLY``: the cause and fsdp_blocking=global).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, _init_optim_state,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from asteria.optim import KLShampoo, SOAP, Shampoo
from asteria.rank_exit import exit_rank
from tolerance import adamw_tol
from models import (assert_params_close, loss_and_grad, make_model, params_of,
                    require_c_extension, train_mlp)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
F64 = dict(compute_dtype=torch.float64)
OPTIMIZERS = {
    "soap": lambda p, **kw: SOAP(p, **{"precondition_frequency": 5, **kw}),
    "shampoo": lambda p, **kw: Shampoo(p, **{"lr": 3e-3, "precondition_frequency": 5, **kw}),
    "kl_shampoo": lambda p, **kw: KLShampoo(p, **{"lr": 3e-3, "precondition_frequency": 5,
                                                  **F64, **kw}),
}
NAMES = list(OPTIMIZERS)
ASYNC = {"mode": "async", "staleness": 3, "install": "deterministic", "workers": 2}
# the host tier explicitly (the residency's blocks go through the checkpoint too): "auto"
# keeps a CPU parameter's roots / eigenbases in optimizer.state
ASYNC_HOST = dict(ASYNC, placement={"roots": "host", "eigenbases": "host"})
SYNC = {"mode": "sync"}
STEPS = 20


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()




_WANT: dict = {}


def uninterrupted(name, runtime=ASYNC):
    key = (name, tuple(sorted(runtime.items())))
    if key not in _WANT:
        model = make_model("mlp")
        opt = OPTIMIZERS[name](model.parameters(), runtime=runtime)
        _WANT[key] = train_mlp(model, opt, range(1, STEPS + 1))
        opt.close()
    return _WANT[key]


def assert_same(got, want, first_step):
    assert len(got) == len(want)
    for t, (a, b) in enumerate(zip(got, want), first_step):
        assert_params_close(a, b, rtol=0, atol=0, what=f"step {t}")


def copied(flat: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in flat.items()}


# ---- flattened save / load mid-run ------------------------------------------------------------
# f = 5, S = 3. SOAP and KL-Shampoo spend step 1 on the eigenbasis (k = t - 1): refreshes are
# snapshotted at steps 6, 11 and installed at 9, 14; Shampoo's at 5, 10, installed at 8, 13.
# After step 7 and after step 12 one is in flight for every method; Shampoo has no root yet
# after step 7 and has one after step 12. Split 0 is the checkpoint of an optimizer that never
# stepped: DCP's fake step creates its state.
@pytest.mark.parametrize("runtime", [ASYNC, ASYNC_HOST], ids=["async", "async-host"])
@pytest.mark.parametrize("through", ["files", "memory"])
@pytest.mark.parametrize("split", [0, 7, 12])
@pytest.mark.parametrize("name", NAMES)
def test_flattened_checkpoint_resumes_bitwise(name, split, through, runtime, tmp_path):
    make_opt = OPTIMIZERS[name]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=runtime)
    train_mlp(model, opt, range(1, split + 1))
    flat = get_optimizer_state_dict(model, opt, options=FLAT)
    if through == "files":
        dcp.save({"optim": flat}, storage_writer=FileSystemWriter(str(tmp_path)))
    else:
        flat = copied(flat)
    msd = copy.deepcopy(model.state_dict())
    opt.close()
    installs = [v for k, v in flat.items() if k.endswith("pending.install_in")]
    assert len(installs) == 3  # the three weight matrices; biases are AdamW
    if split:
        assert all(v > 0 for v in installs), "no refresh in flight at the checkpoint"
        roots = [v for k, v in flat.items() if k.endswith("Linv0_set")]
        if name == "shampoo":
            assert roots and all(v == int(split > 10) for v in roots)
    else:
        assert all(v == -1 for v in installs)

    fresh = make_model("mlp", seed=123)
    fresh.load_state_dict(msd)
    opt2 = make_opt(fresh.parameters(), runtime=runtime)
    if through == "files":  # as OLMo-core resumes: the template is the fresh optimizer's state
        template = {"optim": get_optimizer_state_dict(fresh, opt2, options=FLAT)}
        assert set(template["optim"]) == set(flat)
        dcp.load(template, storage_reader=FileSystemReader(str(tmp_path)))
        flat = template["optim"]
    set_optimizer_state_dict(fresh, opt2, flat, options=FLAT)
    got = train_mlp(fresh, opt2, range(split + 1, STEPS + 1))
    opt2.close()
    assert_same(got, uninterrupted(name)[split:], split + 1)


@pytest.mark.parametrize("runtime", [SYNC, ASYNC, ASYNC_HOST], ids=["sync", "async", "async-host"])
@pytest.mark.parametrize("name", NAMES)
def test_live_state_has_its_keys_from_the_start(name, runtime):
    """The live state (what DCP's flattened load keeps), the state dict and the fake-step
    state have the same keys, shapes and dtypes at every step."""
    def layout(states):
        return {i: {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v)
                    for k, v in st.items()}
                for i, st in states.items()}

    model = make_model("mlp")
    opt = OPTIMIZERS[name](model.parameters(), runtime=runtime)
    params = [p for g in opt.param_groups for p in g["params"]]
    _init_optim_state(opt)
    first = layout(opt.state_dict()["state"])
    for t in range(1, 14):
        live = {i: dict(opt.state[p].items()) for i, p in enumerate(params)}
        assert set(layout(live)) == set(first)
        for i in first:
            assert set(live[i]) == set(first[i]), f"step {t}"
        assert layout(opt.state_dict()["state"]) == first, f"step {t}"
        loss_and_grad(model, "mlp", t)
        opt.step()
    opt.close()


# ---- the fake step ----------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["init_optim_state", "get_optimizer_state_dict"])
@pytest.mark.parametrize("runtime", [SYNC, ASYNC], ids=["sync", "async"])
@pytest.mark.parametrize("name", NAMES)
def test_fake_step_leaves_the_trajectory_alone(name, runtime, how):
    model = make_model("mlp")
    before = params_of(model)
    opt = OPTIMIZERS[name](model.parameters(), runtime=runtime)
    if how == "init_optim_state":
        _init_optim_state(opt)
    else:
        get_optimizer_state_dict(model, opt, options=FLAT)
    assert opt.state and opt.asteria_stats()["jobs_submitted"] == 0
    assert_same([params_of(model)], [before], 0)
    got = train_mlp(model, opt, range(1, STEPS + 1))
    assert opt.asteria_stats()["jobs_submitted"] > 0
    opt.close()
    assert_same(got, uninterrupted(name, runtime), 1)


@pytest.mark.parametrize("name", NAMES)
def test_fake_step_launches_no_job_when_every_step_refreshes(name):
    """f = 1 (Shampoo's fake step counts k = 1, a refresh step): still no engine job."""
    rt = {"mode": "async", "staleness": 1, "install": "deterministic", "workers": 1}

    def run(fake):
        model = make_model("mlp")
        opt = OPTIMIZERS[name](model.parameters(), precondition_frequency=1, runtime=rt)
        if fake:
            _init_optim_state(opt)
            assert opt.asteria_stats()["jobs_submitted"] == 0
        traj = train_mlp(model, opt, range(1, 6))
        opt.close()
        return traj

    assert_same(run(True), run(False), 1)


# ---- "algorithm": "adamw" ---------------------------------------------------------------------
@pytest.mark.parametrize("runtime", [SYNC, ASYNC], ids=["sync", "async"])
@pytest.mark.parametrize("name", NAMES)
def test_adamw_group_takes_a_matrix_to_adamw(name, runtime):
    """A 2-D weight in an "algorithm": "adamw" group is exactly torch.optim.AdamW with the
    group's hyperparameters (Shampoo: betas (betas[0], grafting_beta2), eps grafting_epsilon),
    has AdamW's state and nothing planned for it; the other matrices stay preconditioned."""
    model = make_model("mlp")
    w = model.layers[0].weight
    twin = torch.nn.Parameter(w.detach().clone())
    others = [p for p in model.parameters() if p is not w]
    group = {"params": [w], "algorithm": "adamw", "lr": 1e-2, "weight_decay": 0.1}
    if name == "shampoo":
        opt = Shampoo([group, {"params": others}], betas=(0.8, 0.999), grafting_beta2=0.95,
                      grafting_epsilon=1e-6, precondition_frequency=5, runtime=runtime)
        adamw = torch.optim.AdamW([twin], lr=1e-2, betas=(0.8, 0.95), eps=1e-6,
                                  weight_decay=0.1)
    else:
        opt = OPTIMIZERS[name]([group, {"params": others}], betas=(0.8, 0.95), eps=1e-6,
                               runtime=runtime)
        adamw = torch.optim.AdamW([twin], lr=1e-2, betas=(0.8, 0.95), eps=1e-6,
                                  weight_decay=0.1)
    for t in range(1, 13):
        loss_and_grad(model, "mlp", t)
        twin.grad = w.grad.detach().clone()
        opt.step()
        adamw.step()
        tol = adamw_tol(torch.float64, t)  # ~10 roundings an element a step, over t steps
        torch.testing.assert_close(w.detach(), twin.detach(), rtol=tol, atol=tol)
    assert set(opt.state[w]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[model.layers[1].weight]["step"] > 0
    assert any(k.startswith("b0.") for k in opt.state[model.layers[1].weight])
    pidx = opt.run.pindex[w]
    assert not opt.placement.tkeys.get(pidx)
    assert opt.asteria_stats()["jobs_submitted"] > 0  # the others were preconditioned
    opt.close()


# ---- compute_dtype by name ----------------------------------------------------------------------
def test_kl_shampoo_compute_dtype_by_name_and_cpu_offload():
    model = make_model("mlp")
    opt = KLShampoo(model.parameters(), lr=3e-3, precondition_frequency=5, runtime=ASYNC)
    assert opt.param_groups[0]["compute_dtype"] == "float32"
    train_mlp(model, opt, range(1, 8))
    for options in (StateDictOptions(cpu_offload=True),
                    StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)):
        sd = get_optimizer_state_dict(model, opt, options=options)
        assert sd
    opt.close()
    # a string and a torch.dtype build the same optimizer; the group keeps the name
    a = KLShampoo(make_model("mlp").parameters(), compute_dtype="float64", runtime=SYNC)
    b = KLShampoo(make_model("mlp").parameters(), compute_dtype=torch.float64, runtime=SYNC)
    assert a.param_groups[0]["compute_dtype"] == b.param_groups[0]["compute_dtype"] == "float64"
    a.close()
    b.close()
    want = uninterrupted("kl_shampoo", SYNC)
    model = make_model("mlp")
    opt = KLShampoo(model.parameters(), lr=3e-3, precondition_frequency=5,
                    compute_dtype="float64", runtime=SYNC)
    traj = train_mlp(model, opt, range(1, STEPS + 1))
    opt.close()
    assert_same(traj, want, 1)
    with pytest.raises(ValueError, match="compute_dtype"):
        KLShampoo(make_model("mlp").parameters(), compute_dtype="int32", runtime=SYNC)
    with pytest.raises(ValueError, match="compute_dtype"):
        KLShampoo(make_model("mlp").parameters(), compute_dtype="nonsense", runtime=SYNC)


def test_kl_shampoo_loads_a_group_with_a_torch_dtype():
    """A state dict saved before compute_dtype went by name still loads."""
    model = make_model("mlp")
    opt = KLShampoo(model.parameters(), lr=3e-3, precondition_frequency=5, **F64, runtime=SYNC)
    train_mlp(model, opt, range(1, 4))
    sd = opt.state_dict()
    sd["param_groups"][0]["compute_dtype"] = torch.float64
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["compute_dtype"] == "float64"
    train_mlp(model, opt, range(4, 6))
    opt.close()


# ---- FSDP2 over two ranks -----------------------------------------------------------------------
def _fsdp_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(torch.float64)
    from torch.distributed.fsdp import fully_shard
    fully_shard(model)  # the 3-row layer shards unevenly: 2 rows on rank 0, 1 on rank 1
    return model


def _two_rank_worker(rank: int, port: int, folder: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         set_model_state_dict)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        def run(model, opt, steps):
            losses = []
            for t in steps:
                gen = torch.Generator().manual_seed(100 * t + rank)
                x = torch.randn(32, 8, generator=gen, dtype=torch.float64)
                loss = ((model(x) - torch.sin(x[:, :3])) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            return losses

        results = {}
        for name in NAMES:
            ck = f"{folder}/{name}"
            model = _fsdp_model()
            opt = OPTIMIZERS[name](model.parameters(), runtime=ASYNC)
            want = run(model, opt, range(1, STEPS + 1))
            opt.close()
            model = _fsdp_model()
            opt = OPTIMIZERS[name](model.parameters(), runtime=ASYNC)
            got = run(model, opt, range(1, 8))
            flat = get_optimizer_state_dict(model, opt, options=FLAT)
            dcp.save({"model": get_model_state_dict(model), "optim": flat},
                     storage_writer=FileSystemWriter(ck))
            opt.close()
            model = _fsdp_model()
            opt = OPTIMIZERS[name](model.parameters(), runtime=ASYNC)
            template = {"model": get_model_state_dict(model),
                        "optim": get_optimizer_state_dict(model, opt, options=FLAT)}
            dcp.load(template, storage_reader=FileSystemReader(ck))
            set_model_state_dict(model, template["model"])
            set_optimizer_state_dict(model, opt, template["optim"], options=FLAT)
            got += run(model, opt, range(8, STEPS + 1))
            opt.close()
            results[name] = {"want": want, "got": got,
                             "steps": sorted(k for k in flat if k.startswith("state.")
                                             and (k.endswith(".step") or ".step@" in k))}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(results, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_rank(0)


def test_fsdp2_two_ranks_flattened_resume(tmp_path):
    """Two ranks, each preconditioning its own shards (one layer sharded unevenly): every
    rank's per-shard state keeps its own keys in the checkpoint, and the resumed run is
    bitwise that of the uninterrupted one on every rank."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "result")
    mp.spawn(_two_rank_worker, args=(port, str(tmp_path / "ck"), out), nprocs=2)
    for rank in (0, 1):
        with open(f"{out}.{rank}") as f:
            results = json.load(f)
        for name, r in results.items():
            assert r["steps"] and all(k.endswith(f"@shard{rank}of2") for k in r["steps"]), \
                (name, r["steps"])
            assert r["got"] == r["want"], f"{name}, rank {rank}"


# ---- fsdp_blocking="local" at another world size ---------------------------------------------

LOCAL_REFUSAL = (r"was saved for {saved}, this rank has {here}\. With fsdp_blocking='local' each "
                 r"rank's state is that of the blocks cut from its own shard, so a checkpoint is "
                 r"tied to the shard layout.*To resume on another world size, train with "
                 r"runtime=\{{'fsdp_blocking': 'global'\}}")


#: what DCP's load planner names at another world size: the marker heading a per-shard state
DCP_REFUSAL = ("fsdp_blocking=local(resumes_only_at_the_saved_world_size;"
               "use_fsdp_blocking=global_to_resume_at_another)")


def _try_load(load, errors) -> str:
    """"loaded", or the message of the refusal ``load()`` raised as one of ``errors``."""
    try:
        load()
        return "loaded"
    except errors as exc:
        return str(exc)


def _other_world_worker(rank: int, port: int, folder: str, out: str) -> None:
    """Save on 2 ranks (fsdp_blocking="local"), and load the checkpoints of one unsharded
    process: the refusals' messages go to out.{rank} (the optimizer's) and out.{rank}.dcp
    (torch.distributed.checkpoint's)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        model = _fsdp_model()
        opt = OPTIMIZERS["soap"](model.parameters(), runtime=ASYNC)
        for t in range(1, 4):
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(100 * t + rank),
                            dtype=torch.float64)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt, options=FLAT)},
                 storage_writer=FileSystemWriter(f"{folder}/ck"))
        torch.save(opt.state_dict(), f"{folder}/rank{rank}.pt")
        message = _try_load(lambda: opt.load_state_dict(torch.load(f"{folder}/single.pt")),
                            ValueError)
        opt.close()
        with open(f"{out}.{rank}", "w") as f:
            f.write(message)
        model = _fsdp_model()
        opt = OPTIMIZERS["soap"](model.parameters(), runtime=ASYNC)
        message = _try_load(lambda: dcp.load(
            {"optim": get_optimizer_state_dict(model, opt, options=FLAT)},
            storage_reader=FileSystemReader(f"{folder}/single_ck")), CheckpointException)
        opt.close()
        with open(f"{out}.{rank}.dcp", "w") as f:
            f.write(message)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_rank(0)


def test_local_blocking_refuses_another_world_size_naming_the_remedy(tmp_path):
    """A checkpoint of fsdp_blocking="local" is tied to the shard layout: saved on 2 ranks it
    does not load into 1, nor one of 1 into 2. torch.distributed.checkpoint's planner refuses
    first, on the keys (a rank's keys carry its shard, ``@shard0of2``): into 2 it names the
    marker heading the loading rank's state, the cause and fsdp_blocking=global; into 1, a
    plain key (one rank has no marker). Where the state dict reaches the optimizer, its
    refusal names the cause and the remedy, fsdp_blocking="global"
    (before: "belongs to shard shard0of2, ...: a sharded checkpoint resumes on the same mesh
    and sharding only")."""
    import socket

    import torch.multiprocessing as mp

    from torch.distributed.checkpoint.api import CheckpointException

    model = _plain_model()
    single = OPTIMIZERS["soap"](model.parameters(), runtime=ASYNC)
    train_steps(model, single, 3)
    torch.save(single.state_dict(), tmp_path / "single.pt")
    dcp.save({"optim": get_optimizer_state_dict(model, single, options=FLAT)},
             storage_writer=FileSystemWriter(str(tmp_path / "single_ck")))
    single.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "refusal")
    mp.spawn(_other_world_worker, args=(port, str(tmp_path), out), nprocs=2)
    for rank in (0, 1):  # 1 rank's state into 2
        with open(f"{out}.{rank}") as f:
            message = f.read()
        assert re.search(LOCAL_REFUSAL.format(
            saved=r"an unsharded parameter \(one rank, or no FSDP\)",
            here=rf"shard {rank} of 2 \(fsdp_blocking='local'\)"), message), message
        with open(f"{out}.{rank}.dcp") as f:  # through DCP: its planner names the marker
            message = f.read()
        assert re.search(r"Missing key in checkpoint state_dict: optim\.state\.[\w.]+\."
                         + re.escape(f"{DCP_REFUSAL}@shard{rank}of2."), message), message
        assert "fsdp_blocking=global" in message, message
    # 2 ranks' state into 1: DCP's planner refuses on the keys, before the optimizer sees them
    model = _plain_model()
    opt = OPTIMIZERS["soap"](model.parameters(), runtime=ASYNC)
    template = {"optim": get_optimizer_state_dict(model, opt, options=FLAT)}
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict"):
        dcp.load(template, storage_reader=FileSystemReader(str(tmp_path / "ck")))
    # the optimizer's own refusal, where the state dict reaches it
    with pytest.raises(ValueError, match=LOCAL_REFUSAL.format(
            saved=r"shard 0 of 2 \(fsdp_blocking='local'\)",
            here=r"an unsharded parameter \(one rank, or no FSDP\)")):
        opt.load_state_dict(torch.load(tmp_path / "rank0.pt"))
    opt.close()


def _spawn(worker, nprocs: int, *args) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, nprocs, *args), nprocs=nprocs)


def _marker_worker(rank: int, port: int, world: int, folder: str, out: str) -> None:
    """On 4 ranks: a step of SOAP with fsdp_blocking="local", the marker checked, a DCP
    checkpoint. On 2: that checkpoint loaded. What each rank saw goes to out.{world}.{rank}."""
    import json

    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from asteria.optim import _layout as K

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model = _fsdp_model()
        opt = OPTIMIZERS["soap"](model.parameters(), runtime=SYNC)
        res = {}
        if world == 4:
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank),
                            dtype=torch.float64)
            model(x).square().mean().backward()
            opt.step()
            mark = K.tagged(K.LOCAL_ONLY, f"shard{rank}of4")
            sd = opt.state_dict()
            stored = sum(v.numel() * v.element_size() for st in opt.state.values()
                         for v in dict.values(st) if isinstance(v, torch.Tensor))
            res = {"live_heads": [next(iter(st)) for st in opt.state.values()],
                   "saved_heads": [next(iter(st)) for st in sd["state"].values()],
                   "values": [int(st[mark]) for st in opt.state.values()],
                   "stored": [mark in dict.keys(st) for st in opt.state.values()],
                   "bytes": opt.asteria_stats()["bytes_state_device"] == stored}
            bad = copy.deepcopy(sd)
            bad["state"][0][mark] = torch.tensor(2)
            res["bad_value"] = _try_load(lambda: opt.load_state_dict(bad), ValueError)
            opt.load_state_dict(sd)
            res["reloaded_heads"] = [next(iter(st)) for st in opt.state.values()]
            dcp.save({"optim": get_optimizer_state_dict(model, opt, options=FLAT)},
                     storage_writer=FileSystemWriter(folder))
        else:
            res["error"] = _try_load(lambda: dcp.load(
                {"optim": get_optimizer_state_dict(model, opt, options=FLAT)},
                storage_reader=FileSystemReader(folder)), CheckpointException)
        opt.close()
        with open(f"{out}.{world}.{rank}", "w") as f:
            json.dump(res, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_rank(0)


def test_local_blocking_dcp_refusal_at_fewer_ranks_names_global(tmp_path):
    """A checkpoint of fsdp_blocking="local" saved on 4 ranks, loaded through DCP on 2: the
    planner refuses before the optimizer sees anything, naming the first key of the loading
    state the checkpoint lacks. That is the marker heading every per-shard state, so the
    message says that the state resumes at the saved world size only and names
    fsdp_blocking=global. The marker is shown and saved first, is the shard count (another
    value is refused), and is no stored state (nor counted in the state's bytes)."""
    import json

    ck, out = str(tmp_path / "ck"), str(tmp_path / "res")
    _spawn(_marker_worker, 4, ck, out)
    _spawn(_marker_worker, 2, ck, out)
    for rank in range(4):
        with open(f"{out}.4.{rank}") as f:
            res = json.load(f)
        mark = f"{DCP_REFUSAL}@shard{rank}of4"
        assert len(res["live_heads"]) == 6, res  # every parameter is sharded over 4 ranks
        for what in ("live_heads", "saved_heads", "reloaded_heads"):
            assert res[what] == [mark] * 6, (what, res)
        assert res["values"] == [4] * 6 and not any(res["stored"]) and res["bytes"], res
        assert re.search(LOCAL_REFUSAL.format(
            saved="a layout of 2 shards", here=rf"shard {rank} of 4 \(fsdp_blocking='local'\)"),
            res["bad_value"]), res
    for rank in range(2):
        with open(f"{out}.2.{rank}") as f:
            error = json.load(f)["error"]
        assert re.search(r"Missing key in checkpoint state_dict: optim\.state\.[\w.]+\."
                         + re.escape(f"{DCP_REFUSAL}@shard{rank}of2."), error), error
        assert "fsdp_blocking" in error and "global" in error, error


def _plain_model():
    """_fsdp_model's network, unsharded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(torch.float64)


def train_steps(model, opt, steps):
    for t in range(1, steps + 1):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(100 * t),
                        dtype=torch.float64)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
