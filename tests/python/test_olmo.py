"""asteria.olmo with OLMo-core: the configs and their ``_CLASS_`` / ``type`` resolution, the
parameter categorisation, runtime validation, and checkpoints through torch.distributed.checkpoint
(the flattened optimizer state dict and the empty-state fake step) and through OLMo-core's own
Trainer, plain and with FSDP2 over a single-process gloo group; and a few steps of
examples/olmo_train.py.

The model is OLMo-core's smallest OLMo-2 (``olmo2_1M``, d_model 12) with 2 blocks. Resumed
runs must continue bitwise like uninterrupted ones: one process, one engine (the C pool, async,
deterministic install), the same kernels. The checkpoints are taken with a REFRESH in flight
(f = 3, S = 2), which a plain flattened checkpoint of the Asteria optimizers would lose.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# ai2-olmo-core 3.0.0 requires torch>=2.10,<2.14: scripts/setup.sh leaves it out of environments
# with another torch (the oldest-torch run of scripts/run_tests.sh), where these tests skip.
pytest.importorskip("olmo_core", reason="OLMo-core (ai2-olmo-core) is not installed; ai2-olmo-core "
                    f"3.0.0 needs torch>=2.10,<2.14, this is torch {torch.__version__}")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions,  # noqa: E402
                                                     get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import asteria  # noqa: E402
from asteria.rank_exit import exit_rank  # noqa: E402
from asteria.olmo import (AsteriaKLShampooConfig, AsteriaOneSidedSOAPConfig,  # noqa: E402
                          AsteriaSOAPConfig, AsteriaShampooConfig, MatrixAwareAsteria)
from asteria.olmo import checkpoint as olmo_checkpoint  # noqa: E402
from models import require_c_extension  # noqa: E402
from olmo_core.nn.transformer import TransformerConfig  # noqa: E402
from olmo_core.optim import OptimConfig  # noqa: E402
from olmo_core.train.train_module import TransformerTrainModuleConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "olmo_train.py"
sys.path.insert(0, str(EXAMPLE.parent))
import olmo_train  # noqa: E402

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
RUNTIME = {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 1}
CONFIGS = {
    "soap": (AsteriaSOAPConfig, asteria.SOAP, "asteria_soap"),
    "one_sided_soap": (AsteriaOneSidedSOAPConfig, asteria.OneSidedSOAP, "asteria_one_sided_soap"),
    "shampoo": (AsteriaShampooConfig, asteria.Shampoo, "asteria_shampoo"),
    "kl_shampoo": (AsteriaKLShampooConfig, asteria.KLShampoo, "asteria_kl_shampoo"),
}
NAMES = list(CONFIGS)


def make_config(name: str, **kw):
    cls = CONFIGS[name][0]
    kw.setdefault("lr", 3e-3)
    kw.setdefault("precondition_frequency", 3)
    kw.setdefault("runtime", dict(RUNTIME))
    return cls(**kw)


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


@pytest.fixture(scope="module")
def gloo():
    """A single-process gloo group (FSDP2 and OLMo-core's world mesh need one)."""
    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def transformer(fsdp: bool = False):
    torch.manual_seed(0)
    model = TransformerConfig.olmo2_1M(vocab_size=256, n_layers=2).build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    if fsdp:
        fully_shard(model)
    return model


def batch(t: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(t))


def train(model, opt, steps) -> list[float]:
    losses = []
    for t in steps:
        x = batch(t)
        out = model(x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses


def params_of(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for p in model.parameters()]


# ---- configs ----------------------------------------------------------------------------------
def test_every_method_has_a_config_made_from_the_registry():
    """The configs are made from asteria.optim.METHODS: one per optimizer, registered by its
    method's name, and these tests cover each of them."""
    from asteria.optim import METHODS

    assert set(METHODS) == set(NAMES)
    for name, (cls, method, registered) in CONFIGS.items():
        assert cls.METHOD is METHODS[name] is method and cls.NAME == name
        assert registered == f"asteria_{name}"


@pytest.mark.parametrize("name", NAMES)
def test_class_entry_resolves_through_olmo_core(name):
    cls, _, registered = CONFIGS[name]
    data = {"_CLASS_": f"asteria.olmo.{cls.__name__}", "lr": 1e-3, "precondition_frequency": 8,
            "runtime": {"staleness": 7, "mode": "async"}}
    cfg = OptimConfig.from_dict(data)
    assert type(cfg) is cls
    assert (cfg.lr, cfg.precondition_frequency, cfg.runtime) == (1e-3, 8, data["runtime"])
    # nested in a train-module config, as in an OLMo-core experiment's config dict
    tm = TransformerTrainModuleConfig.from_dict(
        {"rank_microbatch_size": 256, "max_sequence_length": 64, "optim": data})
    assert type(tm.optim) is cls and tm.optim.runtime == data["runtime"]
    # a command-line style override of the staleness budget (OLMo-core's dotlist merge)
    tuned = tm.merge(["optim.runtime.staleness=2", "optim.runtime.workers=3"])
    assert type(tuned.optim) is cls
    assert tuned.optim.runtime == {"staleness": 2, "mode": "async", "workers": 3}
    # the registry name, and the round trip through OLMo-core's recorded config dict
    by_type = OptimConfig.from_dict({"type": registered, "runtime": {"staleness": 2}})
    assert type(by_type) is cls and by_type.runtime == {"staleness": 2}
    again = OptimConfig.from_dict(cfg.as_config_dict())
    assert type(again) is cls and again.as_dict() == cfg.as_dict()


@pytest.mark.parametrize("name", NAMES)
def test_config_fields_are_the_optimizer_keywords(name):
    """Each hyperparameter field has the method's keyword name and default."""
    cls, method, _ = CONFIGS[name]
    sig = inspect.signature(method).parameters
    base = {f.name for f in dataclasses.fields(OptimConfig)} | {"runtime"}
    for f in dataclasses.fields(cls):
        if f.name in base:
            continue
        assert f.name in sig, f"{cls.__name__}.{f.name} is not a keyword of {method.__name__}"
        want = sig[f.name].default
        got = f.default
        if f.name == "compute_dtype":
            got = getattr(torch, got)
        if isinstance(want, tuple):
            got = tuple(got)
        assert got == want, f"{cls.__name__}.{f.name}: default {got!r}, {method.__name__} {want!r}"


@pytest.mark.parametrize("name", NAMES)
def test_bad_runtime_key_raises_at_build(name):
    model = transformer()
    cfg = OptimConfig.from_dict({"_CLASS_": f"asteria.olmo.{CONFIGS[name][0].__name__}",
                                 "runtime": {"stalenes": 5}})
    with pytest.raises(ValueError, match="stalenes"):
        cfg.build(model)
    with pytest.raises(ValueError, match="'mode'"):
        make_config(name, runtime={"mode": "fast"}).build(model)
    with pytest.raises(ValueError, match="'staleness'"):  # S must not exceed f
        make_config(name, runtime={"staleness": 5}).build(model)


# ---- categorisation ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_categorisation(name):
    model = transformer()
    cfg = make_config(name)
    opt = cfg.build(model)
    assert isinstance(opt, MatrixAwareAsteria)
    names = {p: n for n, p in model.named_parameters()}
    group_of = {names[p]: g for g in opt.param_groups for p in g["params"]}
    assert set(group_of) == set(names.values())
    matrices = {n for n in group_of if n.startswith("blocks.") and n.endswith(
        ("w_q.weight", "w_k.weight", "w_v.weight", "w_out.weight", "w1.weight", "w2.weight",
         "w3.weight"))}
    assert len(matrices) == 2 * 7
    for n, g in group_of.items():
        want = cfg.NAME if n in matrices else "adamw"
        assert g["algorithm"] == want, f"{n} is in a {g['algorithm']} group"
    assert group_of["embeddings.weight"]["weight_decay"] == 0.0
    assert group_of["lm_head.w_out.weight"]["algorithm"] == "adamw"
    assert group_of["blocks.0.attention_norm.weight"]["algorithm"] == "adamw"
    by_algo = opt.params_by_algorithm()
    assert {names[p] for p in by_algo[cfg.NAME]} == matrices
    # the inner optimizers step exactly those parameters
    assert {id(p) for g in opt.second_order.param_groups for p in g["params"]} == {
        id(p) for p in by_algo[cfg.NAME]}
    assert {id(p) for g in opt.adamw.param_groups for p in g["params"]} == {
        id(p) for p in by_algo["adamw"]}
    adamw = group_of["lm_head.norm.weight"]
    if name == "shampoo":  # Shampoo's own 1-D treatment: (betas[0], grafting_beta2), grafting_eps
        assert adamw["betas"] == (cfg.betas[0], cfg.grafting_beta2)
        assert adamw["eps"] == cfg.grafting_epsilon
    else:
        assert adamw["betas"] == tuple(cfg.betas) and adamw["eps"] == cfg.eps
    opt.close()


def test_categorisation_of_other_models():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4),
                                torch.nn.LayerNorm(4))
    opt = AsteriaSOAPConfig(runtime=dict(RUNTIME)).build(model)
    names = {p: n for n, p in model.named_parameters()}
    by_algo = {a: sorted(names[p] for p in ps) for a, ps in opt.params_by_algorithm().items()}
    assert by_algo == {"soap": ["1.weight"], "adamw": ["0.weight", "1.bias", "2.bias",
                                                       "2.weight"]}
    opt.close()


# ---- torch.distributed.checkpoint -------------------------------------------------------------
# f = 3, S = 2. SOAP and KL-Shampoo spend step 1 on the eigenbasis, so their k is the step - 1:
# refreshes are snapshotted at steps 4, 7 (Shampoo: 3, 6) and installed two steps later. At the
# split (after step 7) one is in flight for every method, and Shampoo has installed roots.
STEPS, SPLIT = range(1, 10), 7
_REFERENCE: dict = {}


def reference(name: str) -> tuple[list[float], list[torch.Tensor]]:
    """Losses and final parameters of the uninterrupted run without FSDP (computed once)."""
    if name not in _REFERENCE:
        model = transformer()
        opt = make_config(name).build(model)
        _REFERENCE[name] = (train(model, opt, STEPS), params_of(model))
        opt.close()
    return _REFERENCE[name]


def dcp_save(model, opt, folder) -> dict:
    """Save model and optimizer as OLMo-core does (the flattened optimizer state dict)."""
    sd = {"model": get_model_state_dict(model, options=FLAT),
          "optim": get_optimizer_state_dict(model, opt, options=FLAT)}
    dcp.save(sd, checkpoint_id=str(folder))
    return sd["optim"]


def dcp_load(model, opt, folder) -> None:
    """Load as OLMo-core resumes: the template is the fresh optimizer's state dict after its
    fake step."""
    template = {"model": get_model_state_dict(model, options=FLAT),
                "optim": get_optimizer_state_dict(model, opt, options=FLAT)}
    dcp.load(template, checkpoint_id=str(folder))
    set_model_state_dict(model, template["model"], options=FLAT)
    set_optimizer_state_dict(model, opt, template["optim"], options=FLAT)


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_form_has_the_same_keys_at_every_step(name):
    """The state dict after step 2 (no refresh in flight, Shampoo without roots) and after step
    7 (a refresh in flight, roots installed) have the same keys, shapes and dtypes: what a
    flattened load into the fake-step template needs."""
    def layout(sd):
        return {i: {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v)
                    for k, v in olmo_checkpoint.join_nested(st).items()}
                for i, st in sd["state"].items()}

    model = transformer()
    opt = make_config(name).build(model)
    train(model, opt, range(1, 3))
    early = opt.state_dict()
    train(model, opt, range(3, SPLIT + 1))
    late = opt.state_dict()
    opt.close()
    assert layout(early) == layout(late)
    flags = [st["asteria"]["pending.install_in"] for st in late["state"].values()
             if "asteria" in st]
    assert flags and all(f >= 0 for f in flags)
    assert all(st["asteria"]["pending.install_in"] == -1 for st in early["state"].values()
               if "asteria" in st)


@pytest.mark.parametrize("name", NAMES)
def test_fsdp2_single_rank_matches_plain(name, gloo):
    """On one rank a shard is the whole matrix: FSDP2 changes nothing."""
    want_losses, want_params = reference(name)
    model = transformer(fsdp=True)
    opt = make_config(name).build(model)
    assert train(model, opt, STEPS) == want_losses
    for a, b in zip(params_of(model), want_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    opt.close()


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp2"])
@pytest.mark.parametrize("name", NAMES)
def test_flattened_checkpoint_resumes_bitwise(name, fsdp, gloo, tmp_path):
    model = transformer(fsdp)
    opt = make_config(name).build(model)
    got = train(model, opt, STEPS[:SPLIT])
    flat = dcp_save(model, opt, tmp_path)
    opt.close()
    assert any(k.endswith("pending.install_in") and v >= 0 for k, v in flat.items()), \
        "no refresh was in flight at the checkpoint"
    if name == "shampoo":
        assert any(k.endswith("Linv0_set") and v == 1 for k, v in flat.items())

    model = transformer(fsdp)
    opt = make_config(name).build(model)
    dcp_load(model, opt, tmp_path)
    got += train(model, opt, STEPS[SPLIT:])
    opt.close()
    assert got == reference(name)[0]


@pytest.mark.parametrize("name", NAMES)
def test_fake_step_leaves_the_trajectory_alone(name, gloo):
    """torch.distributed.checkpoint steps an optimizer without state once with zero gradients
    and lr 0 before saving it (OLMo-core's step-0 checkpoint); the run then goes on as if it had
    not: SOAP / KL-Shampoo still start with the eigenbasis step, AdamW and Shampoo at step 1."""
    model = transformer()
    opt = make_config(name).build(model)
    flat = get_optimizer_state_dict(model, opt, options=FLAT)
    assert any(k.endswith("pending.install_in") for k in flat)  # the fixed keys exist already
    got = train(model, opt, STEPS)
    opt.close()
    assert got == reference(name)[0]


def test_torch_save_round_trip(tmp_path):
    """The unflattened state dict (torch.save / torch.load) resumes bitwise too."""
    model = transformer()
    opt = make_config("soap").build(model)
    got = train(model, opt, STEPS[:SPLIT])
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck.pt")
    opt.close()
    saved = torch.load(tmp_path / "ck.pt")
    model = transformer()
    model.load_state_dict(saved["model"])
    opt = make_config("soap").build(model)
    opt.load_state_dict(saved["optim"])
    got += train(model, opt, STEPS[SPLIT:])
    opt.close()
    assert got == reference("soap")[0]


# ---- OLMo-core's Trainer ----------------------------------------------------------------------
def trainer_losses(optim, steps, folder, data_dir, save_interval=0):
    trainer, rec = olmo_train.build_trainer(optim, steps=steps, save_folder=str(folder),
                                            data_dir=str(data_dir), dp="fsdp", batch=2, seq=32,
                                            save_interval=save_interval, n_layers=2)
    trainer.fit()
    trainer.train_module.optim.close()
    return rec.losses


def test_trainer_checkpoint_resume(gloo, tmp_path):
    """OLMo-core's Trainer with FSDP2: train 7 steps; or train 5 (the checkpoint holds the
    refresh snapshotted at step 4, due at step 6), then a new trainer on the same save folder
    resumes and trains to 7."""
    data = tmp_path / "data"
    want = trainer_losses(make_config("soap"), 7, tmp_path / "a", data)
    first = trainer_losses(make_config("soap"), 5, tmp_path / "b", data, save_interval=5)
    assert (tmp_path / "b" / "step5").is_dir()
    rest = trainer_losses(make_config("soap"), 7, tmp_path / "b", data)
    assert sorted(first) == list(range(1, 6)) and sorted(rest) == [6, 7]
    assert {**first, **rest} == want


def test_example_runs(tmp_path):
    out = tmp_path / "olmo_train.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--optim", "adamw,soap", "--steps", "3",
         "--batch", "2", "--seq", "32",
         "--layers", "2", "--out", str(out), "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["runs"]) == ["adamw", "soap"]
    for name, run in result["runs"].items():
        assert run["steps"] == [1, 2, 3], name
        assert all(0.0 < x < 10.0 for x in run["losses"]), name
        assert run["step_median_ms"] > 0 and run["step_p99_ms"] >= run["step_median_ms"]
    assert result["runs"]["soap"]["asteria_stats"]["installs"] > 0
    assert "loss@end" in proc.stdout and "soap" in proc.stdout


def _two_rank_worker(rank: int, port: int, folder: str, name: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        def run(model, opt, steps):
            losses = []
            for t in steps:
                x = torch.randint(0, 256, (2, 32),
                                  generator=torch.Generator().manual_seed(100 * t + rank))
                loss = model(x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            return losses

        model = transformer(fsdp=True)
        opt = make_config(name).build(model)
        want = run(model, opt, STEPS)
        keys = sorted({k for st in opt.state_dict()["state"].values() for k in st
                       if k.startswith("asteria")})
        opt.close()
        model = transformer(fsdp=True)
        opt = make_config(name).build(model)
        got = run(model, opt, STEPS[:SPLIT])
        dcp_save(model, opt, folder)
        opt.close()
        model = transformer(fsdp=True)
        opt = make_config(name).build(model)
        dcp_load(model, opt, folder)
        got += run(model, opt, STEPS[SPLIT:])
        opt.close()
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"want": want, "got": got, "keys": keys}, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_rank(0)


@pytest.mark.skipif(not os.environ.get("ASTERIA_OLMO_MULTIRANK"),
                    reason="2-rank FSDP2 over gloo (two fresh processes, ~45 s): set "
                           "ASTERIA_OLMO_MULTIRANK=1")
@pytest.mark.parametrize("name", NAMES)
def test_fsdp2_two_ranks_flattened_resume(name, tmp_path):
    """Two ranks, each preconditioning its own shard: the per-shard state keys keep one rank's
    state from replacing the other's in the checkpoint, and the resumed run is bitwise."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "result")
    mp.spawn(_two_rank_worker, args=(port, str(tmp_path / "ck"), name, out), nprocs=2)
    for rank in (0, 1):
        r = json.loads(Path(f"{out}.{rank}").read_text())
        assert r["keys"] == [f"asteria_shard{rank}of2"]
        assert r["got"] == r["want"], f"rank {rank}"
