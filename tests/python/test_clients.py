"""The optimizers inside the training frameworks that drive them: the real clients, not
imitations of them.

- Hugging Face ``transformers.Trainer`` (on ``accelerate``): ``optimizers=(opt, scheduler)``,
  checkpoints every few steps, and a new Trainer resuming with ``resume_from_checkpoint``
  ends bitwise where the uninterrupted run ends (accelerate's prepare loads the optimizer's
  own state dict first, then the resume loads the checkpoint's);
- Lightning: ``configure_optimizers`` returning an Asteria optimizer trains like the plain loop
  (Lightning wraps it in ``LightningOptimizer`` objects that take on its class without its
  ``__init__`` and forward attributes to it; dropping one must not close the optimizer), and
  the same with a proxy of a few lines and no Lightning;
- ``torch.compile``: a compiled function that calls ``opt.step()`` (torch's pattern for
  compiling optimizer steps) gives the eager result; the step runs eagerly, a graph break.

A test skips, saying why, only where its package cannot be imported (scripts/setup.sh installs
them with a torch in their range). Tiny models, a few steps: each test takes seconds.
"""

from __future__ import annotations

import gc

import pytest
import torch

from asteria.optim import KLShampoo, SOAP, Shampoo
from models import require_c_extension

torch.set_num_threads(1)

CLASSES = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}
# a refresh in flight at most steps (f = 2, S = 1): checkpoints and copies carry one
RUNTIME = {"mode": "async", "staleness": 1, "install": "deterministic", "workers": 1}


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def client(module: str, pip_name: str):
    """Import a client package, or skip naming it (scripts/setup.sh installs it where the
    torch in use is in its range)."""
    return pytest.importorskip(module, reason=f"{pip_name} is not installed (scripts/setup.sh "
                               f"installs it with a torch in its range; this is torch "
                               f"{torch.__version__})")


def make_opt(name, params):
    return CLASSES[name](params, lr=3e-3, precondition_frequency=2, runtime=RUNTIME)


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


class Net(torch.nn.Module):
    """8 -> 8 -> 1: square and rectangular weights (preconditioned), biases (the AdamW path)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        out = self.b(torch.tanh(self.a(x)))
        if labels is None:
            return out
        # the form transformers.Trainer takes from a plain nn.Module
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


# ---- Hugging Face Trainer / accelerate --------------------------------------------------------

def hf_train(name, out_dir, max_steps, resume=None):
    transformers = client("transformers", "transformers")
    model = Net()
    opt = make_opt(name, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 20)
    x, y = data()
    rows = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=8, max_steps=max_steps,
        save_strategy="steps", save_steps=3, report_to="none", use_cpu=True,
        logging_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    out = params(model)
    opt.close()
    return out


@pytest.mark.parametrize("name", CLASSES)
def test_hf_trainer_resume_is_bitwise(name, tmp_path, monkeypatch):
    client("accelerate", "accelerate")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    start = params(Net())
    whole = hf_train(name, tmp_path / "a", 6)  # checkpoints at steps 3 and 6
    assert (tmp_path / "a" / "checkpoint-3" / "optimizer.pt").exists()
    resumed = hf_train(name, tmp_path / "b", 6, resume=str(tmp_path / "a" / "checkpoint-3"))
    assert not torch.equal(whole[0], start[0])  # it trained
    assert_same(whole, resumed)


# ---- Lightning ----------------------------------------------------------------------------

def plain_loop(name, steps, batch=8):
    model = Net()
    opt = make_opt(name, model.parameters())
    x, y = data()
    for t in range(steps):
        xb, yb = x[t * batch:(t + 1) * batch], y[t * batch:(t + 1) * batch]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    out = params(model)
    opt.close()
    return out


@pytest.mark.parametrize("name", CLASSES)
def test_lightning_fit_trains_like_the_plain_loop(name):
    L = client("lightning", "lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, i):
            xb, yb = batch
            return torch.nn.functional.mse_loss(self.net(xb), yb)

        def configure_optimizers(self):
            self.opt = make_opt(name, self.parameters())
            return self.opt

    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    module = Module()
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    assert not module.opt.run.closed  # the wrappers Lightning dropped left it open
    assert_same(params(module.net), plain_loop(name, 6))
    module.opt.close()


def test_a_forwarding_proxy_dying_leaves_the_optimizer_open():
    """What LightningOptimizer does, in six lines: a subclass of the optimizer's class made
    without its __init__, forwarding the attributes it lacks."""
    w = torch.nn.Parameter(torch.randn(6, 4))
    opt = make_opt("soap", [w])

    class Proxy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, key):
            return getattr(self.inner, key)

    proxy = type("ProxySOAP", (Proxy, SOAP), {})(opt)
    assert isinstance(proxy, SOAP) and proxy.param_groups is opt.param_groups
    del proxy
    gc.collect()
    for t in range(4):
        w.grad = torch.randn_like(w)
        opt.step()  # was: RuntimeError: HostPoolEngine is closed
    # closing through a proxy closes the optimizer it stands for
    type("ProxySOAP", (Proxy, SOAP), {})(opt).close()
    assert opt.run.closed
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


# ---- torch.compile --------------------------------------------------------------------------

# a vector takes the AdamW path (dynamo failed in torch's functional AdamW), matrices alone the
# preconditioned one (dynamo failed at the optimizer's own attributes)
SHAPES = {"matrix+vector": [(6, 4), (4,)], "matrices": [(6, 4), (5, 5)]}


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("name", CLASSES)
def test_compiled_function_calling_step_gives_the_eager_result(name, shapes):
    torch._dynamo.reset()

    def run(compiled):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES[shapes]]
        opt = make_opt(name, ps)

        def step():
            opt.step()

        fn = torch.compile(step) if compiled else step
        for t in range(5):
            g = torch.Generator().manual_seed(t)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            fn()
        out = [p.detach().clone() for p in ps]
        opt.close()
        return out

    assert_same(run(True), run(False))
