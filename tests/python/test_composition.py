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

    from asteria.optim.background import BackgroundJobs
    from asteria.optim.cadence import Cadence
    from asteria.optim.checkpoint import Checkpoint
    from asteria.optim.placement import Placement
    from asteria.optim.schedule import Schedule

    assert list(inspect.signature(Schedule).parameters) == ["run", "method", "placement",
                                                            "writes", "cadence"]
    assert list(inspect.signature(Placement).parameters) == ["run", "method", "writes"]
    assert list(inspect.signature(Cadence).parameters) == ["run", "method"]
    assert list(inspect.signature(Checkpoint).parameters) == ["run", "method", "schedule",
                                                              "placement", "cadence"]
    assert list(inspect.signature(BackgroundJobs).parameters) == ["run"]
    for name in ("schedule.py", "placement.py", "packing.py", "checkpoint.py", "method.py",
                 "background.py", "cadence.py"):
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


# The parts of the interface table in docs/architecture.md: the names a part is reached through
# from the package's other files, its class, and the files that are the part itself.
DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
PARTS = {
    "run": (r"_?run", "asteria.optim.run:Run", {"optim/run.py"}),
    "method": (r"_?method", "asteria.optim.method:Method",
               {"optim/method.py", "optim/soap.py", "optim/one_sided_soap.py",
                "optim/shampoo.py", "optim/kl_shampoo.py"}),
    "schedule": (r"_?schedule|sched|runner", "asteria.optim.schedule:Schedule",
                 {"optim/schedule.py"}),
    "cadence": (r"_?cadence", "asteria.optim.cadence:Cadence", {"optim/cadence.py"}),
    "placement": (r"_?placement|place", "asteria.optim.placement:Placement",
                  {"optim/placement.py"}),
    "checkpoint": (r"_?checkpoint|codec", "asteria.optim.checkpoint:Checkpoint",
                   {"optim/checkpoint.py"}),
    # the placement and the schedule hold it as what still writes state
    "background": (r"background|writes", "asteria.optim.background:BackgroundJobs",
                   {"optim/background.py"}),
}
# What a method declares for the base to read (method.py derives the hooks from them): offered
# by every method and read by the base, not by the other parts.
DECLARED = {"STATE", "EXTRA_OUTPUTS"}


def interface_table():
    """{part: names} from the table's third column: every backticked identifier but class names
    (``BackgroundJobs``, ``LocalBlocking``: what a name holds, not a name of the part)."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\|\s*`opt\.(\w+)`[^|]*\|[^|]*\|(.*)\|\s*$", line)
        if m:
            names = set(re.findall(r"`([A-Za-z_]\w*)`", m.group(2)))
            rows[m.group(1)] = {n for n in names if not n[0].isupper() or n.isupper()}
    return rows


def imported_names(text):
    import ast

    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def code_only(text):
    """The source with its comments and strings blanked (line numbers kept): "run.py" in a
    docstring is prose, not a use."""
    import io
    import tokenize

    lines = text.splitlines(keepends=True)
    for tok in reversed(list(tokenize.generate_tokens(io.StringIO(text).readline))):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                line = lines[r - 1]
                a = c0 if r == r0 else 0
                b = c1 if r == r1 else len(line.rstrip("\n"))
                lines[r - 1] = line[:a] + " " * (b - a) + line[b:]
    return "".join(lines)


def used_from_outside(part):
    """The names the package's other files reach the part through: ``<ref>.<name>`` where
    <ref> is what they call the part (``self.schedule``, ``sched``, ``run``); a module of that
    name imported there (``from asteria.optim import placement``) is not the part."""
    ref, _, own = PARTS[part]
    pattern = re.compile(rf"(?<![\w])(?:(?:self|opt|own|o)\.)?({ref})\.([A-Za-z_]\w*)")
    used = {}
    for rel, text in sources(skip=own):
        modules, text = imported_names(text), code_only(text)
        for m in pattern.finditer(text):
            if m.group(1) not in modules:
                used.setdefault(m.group(2), f"{rel}:{text.count(chr(10), 0, m.start()) + 1}")
    return used


def offered(part):
    """Names the part's class has, or its own files assign as ``self.<name>``."""
    import importlib

    _, target, own = PARTS[part]
    module, cls = target.split(":")
    klass = getattr(importlib.import_module(module), cls)
    names = {n for k in [klass, *klass.__subclasses__()] for n in dir(k)}
    for rel in own:
        names |= set(re.findall(r"\bself\.([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=)",
                                (PKG / rel).read_text()))
    return names


def test_the_pattern_of_a_use_finds_what_it_is_for():
    ref = re.compile(rf"(?<![\w])(?:(?:self|opt|own|o)\.)?({PARTS['schedule'][0]})\.(\w+)")
    hits = ["self.schedule.settle()", "sched.capacity", "opt.schedule.delay",
            "schedule.frequency("]
    misses = ["self.reschedule.x", "schedule_x.y", "my_sched.y"]
    assert [ref.search(s).group(2) for s in hits] == ["settle", "capacity", "delay",
                                                      "frequency"]
    assert not any(ref.search(s) for s in misses)
    assert imported_names("from asteria.optim import placement\nimport a.b as c") == {
        "placement", "c"}


def test_the_interface_table_lists_exactly_what_each_part_offers_and_is_used_through():
    """docs/architecture.md's table of the parts is the interface: every name another file of
    the package uses a part through is listed, every listed name exists on the part, and every
    listed name is used by another file (a method's declarations are read by the base)."""
    table = interface_table()
    assert set(table) == set(PARTS), set(table) ^ set(PARTS)
    for part, listed in table.items():
        used = used_from_outside(part)
        missing = {n: where for n, where in used.items() if n not in listed}
        assert not missing, f"{part}: used but not in docs/architecture.md's table: {missing}"
        absent = listed - offered(part)
        assert not absent, f"{part}: listed in the table but not offered: {sorted(absent)}"
        unused = listed - set(used) - DECLARED
        assert not unused, f"{part}: listed but no other file uses it: {sorted(unused)}"


def test_a_method_reaches_its_blocks_through_the_declared_protocol():
    """A method's view of its blocks is ``placement.BlockAccess``: every name a method's file
    calls on its placement is one of the protocol's, every one of them is the placement's own
    call with the protocol's signature, and every one is used by some method."""
    import inspect

    from asteria.optim.placement import BlockAccess, Placement

    protocol = {n for n in vars(BlockAccess) if not n.startswith("_")}
    assert protocol
    ref = re.compile(rf"(?<![\w])(?:self\.)?({PARTS['placement'][0]})\.([A-Za-z_]\w*)")
    used = {}
    for rel in sorted(PARTS["method"][2]):
        text = (PKG / rel).read_text()
        modules, text = imported_names(text), code_only(text)
        for m in ref.finditer(text):
            if m.group(1) not in modules:
                used.setdefault(m.group(2), f"{rel}:{text.count(chr(10), 0, m.start()) + 1}")
    outside = {n: where for n, where in used.items() if n not in protocol}
    assert not outside, f"a method calls its placement outside BlockAccess: {outside}"
    for name in protocol:
        mine = getattr(Placement, name, None)
        assert callable(mine), name
        assert inspect.signature(mine) == inspect.signature(getattr(BlockAccess, name)), name
    assert not protocol - set(used), sorted(protocol - set(used))


def test_the_kernels_call_nothing_back():
    """``functional`` is pure math (torch's ``adam()``: lists of tensors in, nothing called
    back): no kernel takes a callable, so none waits on a scheduler in disguise. A method that
    must wait for a tensor (SOAP's m, re-expressed on a worker) waits between two kernels."""
    import inspect

    from asteria.optim import functional

    text = (PKG / "optim" / "functional.py").read_text()
    assert "Callable" not in text and "callable(" not in text
    for name, fn in inspect.getmembers(functional, inspect.isfunction):
        if fn.__module__ == functional.__name__:
            for param in inspect.signature(fn).parameters.values():
                assert "Callable" not in str(param.annotation), (name, param.name)
