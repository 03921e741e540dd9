"""The optimizer's parts are composed (docs/architecture.md, "The parts"): each gets what it uses
at construction (the ``Run`` record and its collaborators), none reads the optimizer's private
fields, and the Residency is the placement's own. Checked on the source, as
test_state_layout.py checks the one home of the state key grammar."""

import re
from pathlib import Path

import asteria

PKG = Path(asteria.__file__).parent

# An optimizer's private attribute read through any name that holds the optimizer: ``opt._t``,
# ``self._opt()._engine``, ``optimizer._cfg``, ``owner()._tags``. Not matched: torch.optim's own
# hook registries (``_optimizer_state_dict_post_hooks`` ...: torch's state-dict code runs them,
# and the checkpoint part sets them aside to run them where they belong), and the optimizer's
# hook protocol for ``asteria.attach`` (``_asteria_drain``, ``_asteria_prefetch`` ...: methods
# hooks.py calls).
PRIVATE = re.compile(r"\b(?:opt|optimizer|owner|_opt|_owner)(?:\(\))?\._(?!optimizer_|asteria_)"
                     r"[A-Za-z]")


def sources(skip=()):
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel not in skip:
            yield rel, path.read_text()


def test_the_pattern_finds_what_it_is_for():
    hits = ["opt._t", "self._opt()._engine", "optimizer._cfg", "owner()._tags", "opt._layout(p)"]
    misses = ["opt.run.t", "opt._optimizer_load_state_dict_pre_hooks", "opt._asteria_drain()",
              "self._opt = weakref.ref(opt)", "adopt._x"]
    assert all(PRIVATE.search(s) for s in hits)
    assert not any(PRIVATE.search(s) for s in misses)


def test_no_part_reads_the_optimizers_private_fields():
    offenders = [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
                 for rel, text in sources(skip={"optim/optimizer.py"})
                 for m in PRIVATE.finditer(text)]
    assert not offenders


def test_the_residency_is_the_placements_own():
    """Only the placement (and the tiers package that defines it) names the Residency or the
    placement's handle on it; the others use the placement's calls."""
    pattern = re.compile(r"(?m)^\s*(?:from asteria\.tiers\.residency |from asteria\.tiers import"
                         r" .*\bresidency\b|import asteria\.tiers\.residency)|\bResidency\("
                         r"|\._residency\b|\bplacement\.tiered\b")
    offenders = [rel for rel, text in sources(skip={"optim/placement.py"})
                 if not rel.startswith("tiers/") and pattern.search(text)]
    assert not offenders


def test_parts_are_built_from_the_record_not_the_optimizer():
    """Each part's constructor takes the run record and its collaborators; none keeps a
    reference to the optimizer."""
    import inspect

    from asteria.optim.checkpoint import Checkpoint
    from asteria.optim.placement import Placement
    from asteria.optim.schedule import Schedule

    assert list(inspect.signature(Schedule).parameters) == ["run", "method", "placement",
                                                            "writes"]
    assert list(inspect.signature(Placement).parameters) == ["run", "method", "writes"]
    assert list(inspect.signature(Checkpoint).parameters) == ["run", "method", "schedule",
                                                              "placement"]
    for name in ("schedule.py", "placement.py", "checkpoint.py", "method.py", "_writes.py"):
        assert "weakref.ref(opt)" not in (PKG / "optim" / name).read_text(), name


def test_every_engine_declares_submit_in_full():
    """``Engine.submit`` is the whole seam: every executor takes the same keywords, ends with
    the one options argument (``SubmitOptions``, defaults accepted everywhere) and takes no
    ``**extra``; the staleness budget is not passed again beside the deadline."""
    import inspect

    from asteria.refresh.device import DeviceEngine
    from asteria.refresh.engine import NO_OPTIONS, Engine, SubmitOptions
    from asteria.refresh.host_pool import HostPoolEngine
    from asteria.refresh.inline_torch import InlineTorchEngine
    from asteria.refresh.replicated import ReplicatedEngine
    from asteria.refresh.split import SplitEngine

    declared = list(inspect.signature(Engine.submit).parameters)
    assert declared[-1] == "opts" and "staleness" not in declared
    for cls in (InlineTorchEngine, HostPoolEngine, DeviceEngine, SplitEngine, ReplicatedEngine):
        params = inspect.signature(cls.submit).parameters
        assert list(params) == declared, cls.__name__
        assert params["opts"].default is NO_OPTIONS, cls.__name__
        assert all(p.kind != p.VAR_KEYWORD for p in params.values()), cls.__name__
    assert SubmitOptions() == NO_OPTIONS and SubmitOptions(donate="q").donate == ("q",)
    assert SubmitOptions(replicas=[3, 1]).replicas == (1, 3)


def test_the_package_exports_every_optimizer_by_name():
    """``asteria`` imports its optimizers explicitly (IDEs and type checkers resolve
    ``asteria.SOAP``): every one of ``asteria.optim.__all__``, each the same class."""
    import ast

    from asteria import optim

    tree = ast.parse((PKG / "__init__.py").read_text())
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for a in node.names}
    assert set(optim.__all__) <= imported and set(optim.__all__) <= set(asteria.__all__)
    assert all(getattr(asteria, n) is getattr(optim, n) for n in optim.__all__)
    assert "globals()" not in (PKG / "__init__.py").read_text()


def test_state_hooks_follow_from_each_methods_state():
    """A method declares its state once (``Method.STATE``); the hooks that restate it are the
    base's, derived from it, in the order the state has always had."""
    import torch

    from asteria.optim._blocking import make_layout
    from asteria.optim.method import METHODS, Method

    derived = ("state_spec", "create_state", "fixed_state", "flag_keys", "output_specs",
               "output_name", "fake_step_tensors")
    for cls in METHODS.values():
        for klass in cls.METHOD.__mro__:
            if klass is Method:
                break
            assert not set(derived) & set(vars(klass)), klass.__name__
    p = torch.zeros(4, 6)
    layout = make_layout((4, 6), None, False, 100)
    want = {"soap": ["b0.exp_avg", "b0.exp_avg_sq", "b0.GG0", "b0.Q0", "b0.GG1", "b0.Q1"],
            "shampoo": ["b0.momentum", "b0.grafting_v", "b0.L0", "b0.Linv0", "b0.L1",
                        "b0.Linv1"],
            "kl_shampoo": ["b0.exp_avg", "b0.S0", "b0.s0", "b0.Q0", "b0.S1", "b0.s1", "b0.Q1"]}
    for name, keys in want.items():
        cls = METHODS[name]
        method = cls.METHOD()
        group = dict(cls([torch.nn.Parameter(p.clone())], runtime={"mode": "sync"}).defaults)
        assert [e[0] for e in method.state_spec(p, group, layout)] == keys, name
    shampoo = METHODS["shampoo"].METHOD()
    assert shampoo.flag_keys(p, {"max_preconditioner_dim": 100}, layout) == ["b0.Linv0_set",
                                                                             "b0.Linv1_set"]
    assert shampoo.output_name(p, 0, 1) == "b0.Linv1" and shampoo.factor_field == "L"
    soap = METHODS["soap"].METHOD()
    assert soap.output_specs(p, {}, 4) == [((4, 4), torch.float32), ((4,), torch.int64)]
