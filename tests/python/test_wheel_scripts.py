"""The wheel's scripts, checked cheaply (building a wheel and the bare-system run take minutes
and a network: docs/install.md has their commands and results):

 - scripts/build_wheel.sh and scripts/test_wheel_bare.sh parse, answer --help, refuse an
   unknown option or a missing wheel before they touch anything;
 - scripts/wheel_smoke.py, the bare-system run's training, passes against this environment's
   asteria (so a change of the stats or the plan it reads shows here, not on the bare root);
 - `python -m asteria` says when a CUDA build finds no CUDA device."""

import os
import subprocess
import sys

import pytest
import torch

# scripts of the release, not of the package: tested once, in the main environment
pytestmark = pytest.mark.main_env_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")


def run(*args, **kw):
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=120,
                          **kw)


@pytest.mark.parametrize("script", ["build_wheel.sh", "test_wheel_bare.sh"])
def test_script_parses_and_answers_help(script):
    path = os.path.join(SCRIPTS, script)
    assert run("bash", "-n", path).returncode == 0
    r = run("bash", path, "--help")
    assert r.returncode == 0 and script in r.stdout, r


def test_build_wheel_refuses_an_unknown_option():
    r = run("bash", os.path.join(SCRIPTS, "build_wheel.sh"), "--no-such-option")
    assert r.returncode == 2 and "usage:" in r.stderr, r


def test_bare_test_refuses_a_missing_wheel(tmp_path):
    r = run("bash", os.path.join(SCRIPTS, "test_wheel_bare.sh"), str(tmp_path / "none.whl"))
    assert r.returncode == 1 and "no CPU wheel" in r.stderr, r
    assert not os.listdir(tmp_path)


def test_wheel_smoke_trains_here(tmp_path):
    r = run(sys.executable, os.path.join(SCRIPTS, "wheel_smoke.py"),
            env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "state dict round trip" in r.stdout and r.stdout.rstrip().endswith("wheel smoke: OK")


def test_describe_notes_a_cuda_build_without_a_device(monkeypatch):
    from asteria import __main__ as info

    monkeypatch.setattr(info._C, "HAVE_CUDA", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = info.describe()
    assert lines[1].startswith("libasteria: CUDA yes")
    assert lines[-1].startswith("note: built with CUDA, but torch sees no CUDA device")
