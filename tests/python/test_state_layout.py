"""The state key grammar (asteria.optim._layout): one format, one parse, the names exactly as
checkpoints hold them, and no other module of the optimizer layer building or parsing them."""

import pathlib
import re

import pytest

from asteria.optim import _layout as K

PKG = pathlib.Path(K.__file__).resolve().parents[1]

NAMES = {
    "b0.exp_avg": K.Key(0, "exp_avg"),
    "b12.exp_avg_sq": K.Key(12, "exp_avg_sq"),
    "b0.momentum": K.Key(0, "momentum"),
    "b1.grafting_v": K.Key(1, "grafting_v"),
    "b0.GG1": K.Key(0, "GG", 1),
    "b2.Q0": K.Key(2, "Q", 0),
    "b0.Linv10": K.Key(0, "Linv", 10),
    "b3.Linv1_set": K.Key(3, "Linv", 1, flag=K.SET),
    "b0.S1": K.Key(0, "S", 1),
    "b0.s1": K.Key(0, "s", 1),
    "b0.pending1.0": K.Key(0, "pending", 1, output=0),
    "b4.pending0.1": K.Key(4, "pending", 0, output=1),
    "b2.pending0_ok": K.Key(2, "pending", 0, flag=K.OK),
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_format_and_parse_are_inverse(name):
    assert K.Key.parse(name) == NAMES[name]
    assert NAMES[name].format() == name


@pytest.mark.parametrize("name", ["step", "exp_avg", "exp_avg_sq", "pending.install_in",
                                  "pending.age", "staleness.auto", "b.x", "bx.GG0", 3, None])
def test_names_that_are_not_block_entries(name):
    assert K.Key.parse(name) is None
    assert K.block_of(name) is None


def test_the_builders_give_the_checkpoint_names():
    assert K.key(0, "exp_avg") == "b0.exp_avg"
    assert K.key(3, "GG", 1) == "b3.GG1"
    assert K.pending_output(1, 0, 1) == "b1.pending0.1"
    assert K.pending_ok(1, 0) == "b1.pending0_ok"
    assert K.set_flag(2, "Linv", 1) == "b2.Linv1_set"
    assert (K.PENDING_IN, K.PENDING_AGE, K.AUTO_S) == (
        "pending.install_in", "pending.age", "staleness.auto")


def test_predicates():
    assert K.is_factor("b0.GG1", "GG") and not K.is_factor("b0.GG1", "S")
    assert not K.is_factor("b0.Q1", "GG") and not K.is_factor("b0.pending1.0", "pending")
    assert K.is_moment("b0.momentum", "momentum") and not K.is_moment("b0.L0", "L")
    assert K.is_pending_output("b0.pending1.0") and not K.is_pending_output("b0.pending1_ok")
    assert not K.is_pending_output("pending.age")
    assert K.is_pending_ok("b0.pending1_ok") and not K.is_pending_ok("b0.Linv1_set")
    assert K.block_of("b7.Q0") == 7


def test_renumber_and_shard_tags():
    assert K.renumber("b1.GG0", {1: 5}.get) == "b5.GG0"
    assert K.renumber("b2.pending0_ok", {1: 5}.get) is None
    assert K.renumber("step", {1: 5}.get) == "step"
    assert K.shard_tag([(1, 2)]) == "shard1of2"
    assert K.shard_tag([(1, 2), (0, 4)]) == "shard1of2_0of4"
    assert K.shard_tag([]) is None
    assert K.tagged("b0.exp_avg", "shard1of2") == "b0.exp_avg@shard1of2"
    assert K.split_tag("b0.exp_avg@shard1of2") == ("b0.exp_avg", "shard1of2")
    assert K.split_tag("step@shard1of2_0of4") == ("step", "shard1of2_0of4")
    assert K.split_tag("b0.exp_avg") == ("b0.exp_avg", None)
    assert K.untagged("b0.Q1@shard0of2", "shard0of2") == "b0.Q1"
    assert K.shard_count("shard1of2") == 2 and K.shard_count("shard1of2_0of4") == 8


def test_local_only_marker_is_no_block_entry_and_no_nesting():
    """The marker heading a per-shard state: its name names the mode that resumes elsewhere,
    is no block entry (nothing that iterates blocks takes it), has no "." (DCP's unflattening
    would nest it) and takes a shard tag like every key."""
    assert "fsdp_blocking=global" in K.LOCAL_ONLY and "." not in K.LOCAL_ONLY
    assert K.Key.parse(K.LOCAL_ONLY) is None and K.block_of(K.LOCAL_ONLY) is None
    assert K.split_tag(K.tagged(K.LOCAL_ONLY, "shard1of2")) == (K.LOCAL_ONLY, "shard1of2")


def test_no_other_module_builds_or_parses_state_keys():
    """The grammar has one home: no compiled regular expression, no pattern of a block key
    (``b\\d+``, ``b(\\d+)``) and no ``b{j}.`` f-string in the optimizer layer and the tiers
    outside _layout.py (residency.py reads a block number out of a C error message: not a
    state key)."""
    offenders = []
    for path in sorted([*(PKG / "optim").glob("*.py"), *(PKG / "tiers").glob("*.py")]):
        if path.name == "_layout.py":
            continue
        text = path.read_text()
        if (re.search(r"\bre\.compile\b", text) or re.search(r"f[\"']b\{", text)
                or re.search(r"b\(?\\d", text) or "@shard\\d" in text):
            offenders.append(path.name)
    assert not offenders
