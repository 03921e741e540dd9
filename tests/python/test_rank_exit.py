"""asteria.rank_exit.exit_rank, the epilogue of every multi-process worker of ours: the process
ends with the code given, after destroying its process groups and running the atexit handlers
(an open optimizer's finalizer closes its runtime), and a bad code is refused by name. Each case
runs in a child process, as a rank would; a few seconds each."""

import os
import subprocess
import sys
import textwrap

import pytest

from asteria.rank_exit import exit_rank

pytest.importorskip("asteria._C")


def child(body: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_ends_with_the_code_after_groups_and_atexit_handlers(tmp_path):
    r = child(f"""
        import atexit, torch, torch.distributed as dist
        import asteria
        from asteria.rank_exit import exit_rank

        dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0,
                                world_size=1)
        dist.all_reduce(torch.ones(3))
        p = torch.nn.Parameter(torch.randn(8, 8))
        opt = asteria.SOAP([p], lr=1e-2, runtime={{"mode": "async"}})
        p.grad = torch.randn(8, 8)
        opt.step()
        atexit.register(lambda: print("groups alive:", dist.is_initialized(), flush=True))
        print("trained", flush=True)
        exit_rank(7)
        print("never printed")
        """, tmp_path)
    assert r.returncode == 7, r.stdout + r.stderr
    # the handler ran, after the groups were destroyed (the optimizer's finalizer, registered
    # earlier, runs after it: test_runs_the_optimizers_finalizers)
    assert "trained" in r.stdout and "never printed" not in r.stdout
    assert "groups alive: False" in r.stdout


def test_runs_the_optimizers_finalizers(tmp_path):
    """An optimizer left open (no close()) is closed by its finalizer before the process ends:
    its NVMe tier's file is gone afterwards."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    r = child(f"""
        import torch
        import asteria
        from asteria.rank_exit import exit_rank

        p = torch.nn.Parameter(torch.randn(64, 64))
        opt = asteria.SOAP([p], lr=1e-2, precondition_frequency=2,
                           runtime={{"mode": "async", "staleness": 1, "nvme_dir": "{nvme}",
                                     "host_budget_bytes": 1}})
        for _ in range(3):
            p.grad = torch.randn(64, 64)
            opt.step()
        print("files while open:", len(list(__import__("os").scandir("{nvme}"))), flush=True)
        exit_rank(0)
        """, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "files while open: 0" not in r.stdout, r.stdout
    assert os.listdir(nvme) == [], os.listdir(nvme)


@pytest.mark.parametrize("code", [-1, 256, 1.0, True, "0"])
def test_a_bad_code_is_refused_naming_what_is_allowed(code):
    with pytest.raises(ValueError, match=r"exit_rank: code must be an int in \[0, 255\]"):
        exit_rank(code)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: files that start a process group but are not a rank's script: the pytest process's own
#: one-rank group (a fixture), and the benchmark that measures how a user's script ends
NOT_RANKS = {"tests/python/conftest.py": "the pytest process's own group (a fixture)",
             "benchmarks/bench_exit.py": "its ranks are a user's script: no epilogue of ours"}


def test_every_rank_script_of_ours_ends_through_exit_rank():
    """Each file of ours that starts a process group (a rank's script, or a test that spawns
    ranks) ends them through exit_rank, so no result depends on gloo's finalization race."""
    missing = []
    for top in ("tests", "benchmarks", "examples"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)
                if not name.endswith(".py") or rel in NOT_RANKS:
                    continue
                text = open(path).read()
                if "init_process_group(" in text and "exit_rank(" not in text:
                    missing.append(rel)
    assert not missing, f"start a process group but never end a rank through exit_rank: {missing}"
