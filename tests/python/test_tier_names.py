"""The memory tiers' names have one home, libasteria's (src/store.c, ``_C.tiers()``): the
package's tier list (``config.TIERS``), the optimizer's per-tier stats keys (``STATS_KEYS``) and
the residency's stats are made from it, in its order, and ``config`` refuses to import when C's
tiers are not the ones its tier code is written for. No module of the package lists the tiers
again."""

import ast
import os

import pytest

from asteria import _C, RuntimeConfig, config
from asteria.optim.optimizer import STATS_KEYS

PKG = os.path.dirname(os.path.abspath(config.__file__))  # .../asteria


def test_tiers_are_libasterias_in_its_order():
    assert config.TIERS == _C.tiers()
    assert config.TIERS[0] == "device" and config.TIERS[-1] == "nvme"  # the order users read
    assert set(_C.Store().stats()["bytes"]) == set(config.TIERS)


def test_stats_keys_follow_the_tiers():
    assert STATS_KEYS[:len(config.TIERS)] == tuple(f"bytes_{t}" for t in config.TIERS)
    assert len(set(STATS_KEYS)) == len(STATS_KEYS)


def test_messages_list_the_tiers_in_their_order():
    with pytest.raises(ValueError, match="allowed: " + ", ".join(config.TIERS)):
        RuntimeConfig.from_user({"placement": {"roots": "ssd"}})


def test_a_disagreement_with_c_refuses_to_import(monkeypatch):
    """C's answer replaced, as a tier added to libasteria only would change it (the real table
    cannot disagree with itself): the error names both sides."""
    monkeypatch.setattr(_C, "tiers", lambda: config.TIERS + ("cxl",))
    with pytest.raises(ImportError, match=r"C has \[.*'cxl'\], the Python tier code is written "
                                          r"for \['device', .*\]"):
        config._tiers()
    monkeypatch.setattr(_C, "tiers", lambda: config.TIERS[:-1])
    with pytest.raises(ImportError, match="disagree"):
        config._tiers()


def _tier_literals(tree, names):
    """(line, how many tier names) of each tuple, list or set literal of the module that holds
    4 or more of them, bare or as a stats key (``bytes_<tier>``)."""
    keys = names | {f"bytes_{t}" for t in names}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            hits = {e.value.removeprefix("bytes_") for e in node.elts
                    if isinstance(e, ast.Constant) and e.value in keys}
            if len(hits) >= 4:
                yield node.lineno, len(hits)


def test_no_module_lists_the_tiers():
    """A list of (nearly) every tier is libasteria's; the one Python literal allowed is
    config's import-time check, which compares and is never read as the list. Subsets that say
    something of their own (plan.HOST_TIERS: the host-addressable tiers) are not lists of the
    tiers."""
    names = set(config.TIERS)
    found = []
    for root, _, files in os.walk(PKG):
        for fname in sorted(files):
            if not fname.endswith(".py"):
                continue
            path = os.path.join(root, fname)
            with open(path) as fh:
                tree = ast.parse(fh.read())
            for line, n in _tier_literals(tree, names):
                found.append((os.path.relpath(path, PKG), line, n))
    assert [f for f, _, _ in found] == ["config.py"], found
