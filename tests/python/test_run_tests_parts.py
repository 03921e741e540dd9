"""scripts/parts.sh, the part runner of the test command (scripts/run_tests.sh): a failing part
does not stop the parts after it, the end lists every part with its result, counts and time, and
the exit status is non-zero when any part failed or did not run. Bash only, a second or so."""

import os
import re
import subprocess

import pytest

# the test command's own scripts: checked once, in the main environment (scripts/run_tests.sh)
pytestmark = pytest.mark.main_env_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(body: str) -> subprocess.CompletedProcess:
    script = f"set -uo pipefail\ncd {ROOT}\nsource scripts/parts.sh\n{body}\n"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


PASSING = "ok() { echo '===== 3 passed, 1 skipped in 2.10s ====='; }"
QUIET = "quiet() { echo '2 failed, 1242 passed, 15 skipped in 2174.43s (0:36:14)'; return 1; }"
FAILING = "bad() { echo '50% tests passed, 1 tests failed out of 2'; return 8; }"


def test_a_failed_part_does_not_stop_the_rest_and_fails_the_command():
    r = run(f"{FAILING}\n{PASSING}\n{QUIET}\ntimed first bad\ntimed second ok\n"
            "skipped third 'its setup failed'\ntimed fourth quiet\nsummary")
    assert r.returncode == 1, r.stdout + r.stderr
    table = r.stdout.split("== result and wall time per part ==")[1].splitlines()
    first, second, third, fourth = (next(line for line in table if line.startswith(name))
                                    for name in ("first", "second", "third", "fourth"))
    assert "FAILED (exit 8): 50% tests passed, 1 tests failed out of 2" in first
    assert "passed: 3 passed, 1 skipped in 2.10s" in second
    assert "NOT RUN (its setup failed)" in third
    assert "FAILED (exit 1): 2 failed, 1242 passed, 15 skipped in 2174.43s (0:36:14)" in fourth
    assert "== FAILED" in r.stdout


def test_all_parts_passing_exit_zero_with_their_counts():
    r = run(f"{PASSING}\ntimed one ok\ntimed two ok\nsummary")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed: 3 passed, 1 skipped in 2.10s") == 2
    assert "== all parts passed ==" in r.stdout


def test_the_test_command_uses_the_part_runner():
    text = open(os.path.join(ROOT, "scripts", "run_tests.sh")).read()
    assert "source scripts/parts.sh" in text and text.rstrip().endswith("summary")
    assert not re.search(r"^set -\w*e", text, re.M)  # a failed part must not end the command
