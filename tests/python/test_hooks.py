"""asteria.attach / asteria.detach (asteria.hooks) on a plain nn.Module and on FSDP2.

 - attach registers one forward hook and one full-backward-pre hook per module that owns
   parameters of the optimizer; detach (by handle or by model) removes every one of them;
 - the forward hooks fire in module order, the backward-pre prefetches in REVERSE module
   order, and the step then finds the staged roots in the ring (prefetch hits);
 - results with and without attach are bitwise identical (install="deterministic"), for the
   three optimizers, and attach on a sync-mode optimizer changes nothing either;
 - FSDP2: fully_shard on a single-process gloo group (world size 1, CPU mesh); the optimizer
   works on the DTensors' local shards; attach and detach leave FSDP's own hooks alone; the
   trajectory is bitwise the plain model's.
"""

import pytest
import torch

from asteria import SOAP, attach, detach
from models import (loss_and_grad, make_model, optimizer_makers, require_c_extension,
                    train_hooked)

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

MAKERS = optimizer_makers(4)
# the host tier explicitly: the hooks' prefetches stage into the residency's ring, which a CPU
# parameter only has when asked for (placement "auto" keeps its blocks in optimizer.state)
RT = {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 2,
      "placement": {"roots": "host", "eigenbases": "host"}}
STEPS = 10


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def hook_counts(model):
    return {n: (len(m._forward_hooks), len(m._backward_pre_hooks))
            for n, m in model.named_modules()}


def train(model, opt, steps=STEPS, attached=False):
    return train_hooked(model, opt, steps, attached)


def test_attach_registers_and_detach_removes_every_hook():
    model = make_model("mlp")
    opt = SOAP(model.parameters(), runtime=RT)
    try:
        assert all(c == (0, 0) for c in hook_counts(model).values())
        h = attach(model, opt)
        counts = hook_counts(model)
        assert h.modules == ["layers.0", "layers.1", "layers.2"]
        assert counts == {"": (0, 0), "layers": (0, 0), "layers.0": (1, 1),
                          "layers.1": (1, 1), "layers.2": (1, 1)}
        assert detach(h) == 1 and detach(h) == 0
        assert all(c == (0, 0) for c in hook_counts(model).values())
        attach(model, opt)
        attach(model, opt)
        assert hook_counts(model)["layers.1"] == (2, 2)
        assert detach(model) == 2
        assert all(c == (0, 0) for c in hook_counts(model).values())
        assert detach(model) == 0
        with pytest.raises(TypeError, match="Asteria optimizer"):
            attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(ValueError, match="none of the model's parameters"):
            attach(make_model("mlp"), opt)
    finally:
        opt.close()


def spy_prefetch(monkeypatch, residency) -> list:
    """Record each ``residency.prefetch`` call as (reason, keys it stages from); the real
    method still runs."""
    log, real = [], residency.prefetch

    def prefetch(keys, reason=""):
        keys = list(keys)
        log.append((reason, [k for k in keys if residency.has(k)]))
        return real(keys, reason)

    monkeypatch.setattr(residency, "prefetch", prefetch)
    return log


def test_hook_order_forward_then_reverse_prefetch(monkeypatch):
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=4, runtime=RT)
    h = attach(model, opt)
    try:
        for t in (1, 2):
            h.log.clear()
            loss_and_grad(model, "mlp", t)
            fwd = [n for e, n in h.log if e == "forward"]
            pre = [n for e, n in h.log if e == "prefetch"]
            assert fwd == ["layers.0", "layers.1", "layers.2"]
            assert pre == fwd[::-1]  # backward reaches the last module first
            assert [e for e, _ in h.log] == ["forward"] * 3 + ["prefetch"] * 3
            opt.step()
        # step 2 found every eigenbasis the backward-pre hooks staged (the default ring holds
        # part of them: the last module's), and consumed them before anything else
        st = opt.asteria_stats()
        assert st["prefetches_ahead"] >= 2
        assert st["prefetch_hits"] >= st["prefetches_ahead"]
        assert st["ring_evictions"] == 0
        log = spy_prefetch(monkeypatch, opt.placement._residency)
        loss_and_grad(model, "mlp", 3)
        names = [opt.placement.describe_key(keys[0]) for reason, keys in log]
        assert [r for r, _ in log] == ["layers.2", "layers.1", "layers.0"]
        assert "(layers.2.weight)" in names[0] and "(layers.0.weight)" in names[-1]
    finally:
        detach(h)
        opt.close()


@pytest.mark.parametrize("name", list(MAKERS))
def test_results_with_and_without_attach_are_identical(name):
    m0 = make_model("mlp")
    plain, s0, _ = train(m0, MAKERS[name](m0.parameters(), RT))
    m1 = make_model("mlp")
    hooked, s1, h = train(m1, MAKERS[name](m1.parameters(), RT), attached=True)
    for t, (a, b) in enumerate(zip(plain, hooked), 1):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {t}"
    # with attach the backward-pre hooks staged the roots before step() (Shampoo has roots
    # only from its first refresh on)
    assert s0["prefetches_ahead"] == 0 and s1["prefetches_ahead"] > 0
    assert all(c == (0, 0) for c in hook_counts(m1).values())


def test_attach_on_sync_optimizer_is_harmless():
    m0, m1 = make_model("mlp"), make_model("mlp")
    a, _, _ = train(m0, SOAP(m0.parameters(), runtime={"mode": "sync"}))
    b, _, _ = train(m1, SOAP(m1.parameters(), runtime={"mode": "sync"}), attached=True)
    assert all(torch.equal(x, y) for s, t in zip(a, b) for x, y in zip(s, t))


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_fsdp2_fully_shard_single_process(gloo_group, name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    ref_model = make_model("mlp")
    ref, _, _ = train(ref_model, MAKERS[name](ref_model.parameters(), RT), attached=True)

    model = make_model("mlp")
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    before = {n: (dict(m._forward_hooks), dict(m._backward_pre_hooks))
              for n, m in model.named_modules()}
    opt = MAKERS[name](model.parameters(), RT)
    h = attach(model, opt)
    assert hook_counts(model)["layers.0"][1] == len(before["layers.0"][1]) + 1
    traj = []
    try:
        for t in range(1, STEPS + 1):
            loss_and_grad(model, "mlp", t)
            opt.step()
            traj.append([p.full_tensor().detach().clone() for p in model.parameters()])
        pre = [n for e, n in h.log if e == "prefetch"][-3:]
        assert pre == ["layers.2", "layers.1", "layers.0"]
    finally:
        detach(h)
        opt.close()
    after = {n: (dict(m._forward_hooks), dict(m._backward_pre_hooks))
             for n, m in model.named_modules()}
    assert {n: (set(f), set(b)) for n, (f, b) in after.items()} == \
        {n: (set(f), set(b)) for n, (f, b) in before.items()}  # FSDP's own hooks stay
    for t, (a, b) in enumerate(zip(traj, ref), 1):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {t}"
