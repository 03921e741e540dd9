"""asteria.RuntimeConfig: one validator per key, C handed only its keys, once.

The optimizer's keys (mode, staleness, install, placement, budgets, nvme_dir, max_failures,
on_failure) are checked in Python; these are the checks tests/c/test_config.c made while C kept
them. The keys libasteria reads (workers, cpuset, pin, trace) are checked by C's ast_config_set
(tests/c/test_config.c, tests/python/test_c_ext.py); here only that they reach it, once.
"""

import copy
import dataclasses
import pickle

import pytest

from asteria import _C, RuntimeConfig


def test_defaults_match_design():
    c = RuntimeConfig()
    assert c.mode == "async" and c.staleness == 5 and c.install == "deterministic"
    assert c.workers is None and c.placement == "auto" and c.device_budget_bytes is None
    assert c.host_budget_bytes is None and c.nvme_dir is None and c.trace is None
    assert c.pin is True and c.max_failures == 3 and c.on_failure == "raise"
    assert c.c_config.as_dict() == _C.default_config()


def test_good_values_are_kept(tmp_path):
    c = RuntimeConfig.from_user({
        "mode": "sync", "staleness": 0, "install": "eager", "workers": 4,
        "placement": {"factors": "device", "roots": "host_pinned"},
        "device_budget_bytes": 1048576, "host_budget_bytes": None, "nvme_dir": str(tmp_path),
        "pin": False, "max_failures": 4, "trace": str(tmp_path / "t.json"),
        "factor_emas": "workers"})
    assert c.factor_emas == "workers" and RuntimeConfig().factor_emas == "thread"
    assert c.mode == "sync" and c.staleness == 0 and c.install == "eager"
    assert c.placement == {"factors": "device", "roots": "host_pinned"}
    assert c.placement.get("roots") == "host_pinned" and c.placement.get("moments") is None
    assert c.device_budget_bytes == 1048576 and c.nvme_dir == str(tmp_path)
    assert c.max_failures == 4
    assert c.c_config.as_dict() == {"workers": 4, "cpuset": None, "pin": False,
                                    "trace": str(tmp_path / "t.json")}


@pytest.mark.parametrize("key,value,allowed", [
    ("mode", "fast", ['"sync"', '"async"']),
    ("install", "lazy", ['"deterministic"', '"eager"']),
    ("staleness", -1, ["0 <= S"]),
    ("staleness", 1.5, ["integer", "0 <= S"]),
    ("staleness", "", ["0 <= S"]),
    ("device_budget_bytes", "lots", [">= 0"]),
    ("device_budget_bytes", -5, [">= 0"]),
    ("host_budget_bytes", -1, [">= 0"]),
    ("placement", {"factors": "tape"}, ["device", "host_pinned", "nvme"]),
    ("placement", {"roots": "gpu"}, ["host_pinned"]),
    ("placement", {"weights": "host"}, ["factors", "roots"]),
    ("placement", "nonsense", ['"auto"', "kind: tier"]),
    ("nvme_dir", "a" * 5000, ["an existing directory"]),
    ("max_failures", 0, ["an integer >= 1"]),
    ("max_failures", -2, ["an integer >= 1"]),
    ("max_failures", 1.5, ["an integer >= 1"]),
    ("max_failures", "4", ["an integer >= 1"]),
    ("max_failures", True, ["an integer >= 1"]),
    ("max_failures", None, ["an integer >= 1"]),
    ("on_failure", "ignore", ['"raise", "keep"']),
    ("factor_emas", "gpu", ['"thread", "workers"']),
    ("refresh_device", "0", ["True, False"]),
    ("refresh_device", 0, ["True, False"]),
    ("ranks_per_node", 0, ["None or an integer >= 1"]),
    ("ranks_per_node", "2", ["None or an integer >= 1"]),
    ("ranks_per_node", True, ["None or an integer >= 1"]),
    ("coherence_timeout_s", 0, ["None or a finite number of seconds > 0"]),
    ("coherence_timeout_s", -1.5, ["seconds > 0"]),
    ("coherence_timeout_s", float("inf"), ["finite"]),
    ("coherence_timeout_s", float("nan"), ["finite"]),
    ("coherence_timeout_s", "30", ["None or a finite number of seconds > 0"]),
    ("coherence_topology", "hierarchical", ['"hier", "flat"']),
    ("coherence_topology", None, ['"hier", "flat"']),
    # C's keys: the message is libasteria's, raised unchanged
    ("workers", 0, ["1..1024"]),
    ("pin", "maybe", ["true", "false"]),
])
def test_bad_value_names_key_and_allowed_values(key, value, allowed):
    with pytest.raises(ValueError) as ei:
        RuntimeConfig.from_user({key: value})
    msg = str(ei.value)
    assert f"runtime key '{key}'" in msg
    for a in allowed:
        assert a in msg, msg


def test_distributed_and_device_keys(monkeypatch):
    """The keys that were environment variables: defaults, good values kept as given, and no
    environment variable read in their place."""
    for name, value in (("ASTERIA_REFRESH_DEVICE", "0"), ("ASTERIA_RANKS_PER_NODE", "3"),
                        ("ASTERIA_COHERENCE_TIMEOUT_S", "7"), ("ASTERIA_COHERENCE", "flat")):
        monkeypatch.setenv(name, value)
    d = RuntimeConfig()
    assert (d.refresh_device, d.ranks_per_node, d.coherence_timeout_s,
            d.coherence_topology) == (True, None, None, "hier")
    c = RuntimeConfig.from_user({"refresh_device": False, "ranks_per_node": 2,
                                 "coherence_timeout_s": 2.5, "coherence_topology": "flat"})
    assert (c.refresh_device, c.ranks_per_node, c.coherence_timeout_s,
            c.coherence_topology) == (False, 2, 2.5, "flat")
    assert RuntimeConfig(coherence_timeout_s=30).coherence_timeout_s == 30
    assert pickle.loads(pickle.dumps(c)) == c


def test_unknown_key_lists_keys():
    with pytest.raises(ValueError) as ei:
        RuntimeConfig.from_user({"stalenes": 5})
    msg = str(ei.value)
    assert "'stalenes'" in msg
    for key in RuntimeConfig.keys():
        assert key in msg
    assert "debug_job_delay_ms" not in RuntimeConfig.keys()


def test_edits_are_validated_too():
    """A RuntimeConfig is valid from construction: direct construction and replace() check it
    as from_user does (the struct edits tests/c/test_config.c used to catch)."""
    with pytest.raises(ValueError, match="'staleness'"):
        RuntimeConfig(staleness=-3)
    with pytest.raises(ValueError, match="'mode'"):
        dataclasses.replace(RuntimeConfig(), mode=7)
    with pytest.raises(ValueError, match="'workers'"):
        dataclasses.replace(RuntimeConfig(), workers=2000)


def test_c_gets_only_its_keys_once(monkeypatch):
    """One validation: at construction, of exactly the C keys; a RuntimeConfig passed on is not
    validated again, and _C.Runtime gets the validated _C.Config."""
    calls = []
    real = _C.validate_config

    def counting(items):
        calls.append(dict(items))
        return real(items)

    monkeypatch.setattr(_C, "validate_config", counting)
    cfg = RuntimeConfig.from_user({"mode": "async", "staleness": 2, "workers": 1, "pin": False})
    assert len(calls) == 1 and set(calls[0]) <= set(_C.config_keys())
    assert calls[0] == {"workers": 1, "pin": False}
    assert RuntimeConfig.from_user(cfg) is cfg and len(calls) == 1
    from asteria.refresh.host_pool import HostPoolEngine

    e = HostPoolEngine(cfg)
    try:
        assert len(calls) == 1 and e.runtime.config == cfg.c_config.as_dict()
    finally:
        e.close()


def test_c_keys_take_libasteria_value():
    """The value stored is the one libasteria validated (one home)."""
    c = RuntimeConfig(workers="4")
    assert c.workers == 4 and c.c_config.as_dict()["workers"] == 4


def test_max_failures_is_a_python_key():
    """max_failures is the optimizer's schedule's (the one consecutive-failure count, for every
    executor): validated and stored once in RuntimeConfig, never handed to libasteria."""
    assert "max_failures" not in _C.config_keys()
    assert "max_failures" not in _C.default_config()
    c = RuntimeConfig.from_user({"max_failures": 7})
    assert c.max_failures == 7 and "max_failures" not in c.c_config.as_dict()
    assert "max_failures" not in c.c_items()
    assert pickle.loads(pickle.dumps(c)).max_failures == 7
    with pytest.raises(ValueError, match=r"runtime key 'max_failures': got 0; allowed: an "
                                         r"integer >= 1"):
        dataclasses.replace(c, max_failures=0)


def test_copies_are_validated_where_they_enter(tmp_path):
    c = RuntimeConfig(workers=2, staleness=3, trace=str(tmp_path / "t.json"))
    for copied in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
        assert copied == c and copied.c_config == c.c_config
    blob = pickle.dumps(c)
    tmp_path.rename(tmp_path.with_name(tmp_path.name + "-moved"))
    with pytest.raises(ValueError, match="'trace'"):
        pickle.loads(blob)


@pytest.mark.parametrize("key,value,match", [
    ("trace", 5, "a path string"),
    ("cpuset", "0\0-1", "embedded NUL"),
    ("cpuset", "0-\udcff", "not valid UTF-8"),
])
def test_values_that_cannot_cross_into_c(key, value, match):
    with pytest.raises(ValueError, match=rf"runtime key '{key}'.*{match}"):
        RuntimeConfig.from_user({key: value})
