"""The GPU check's dependencies carried as .deb files (tests/gpu/fetch_debs.sh,
tests/gpu/deps_prefix.sh, stage 0 of tests/gpu/run.sh), for the lent GPU machine, which has no
apt. Checked here with the machine's own pkg-config modules hidden (PKG_CONFIG_LIBDIR at an
empty directory), so only the unpacked prefix can satisfy them: the headers a program includes
and the libraries it loads come from the prefix, and run.sh builds libasteria and the package
against it and reaches its no-GPU exit (77).

Without dpkg the packages are unpacked with ar and tar, or by python3 alone: each gives the
files, links and modes dpkg -x gives. The build tools a machine may lack (cmake >= 3.25, ninja,
scikit-build-core) come as wheels (tests/gpu/fetch_wheels.sh) and install offline into a prefix
whose cmake and ninja run without it on PYTHONPATH. pynvml (nvidia-ml-py, the train-f1 stage's
energy readings) comes as a wheel too and unpacks, without pip, into a prefix that holds it alone.

The packages come from $ASTERIA_GPU_DEBS or .debs in the checkout when they are there, else
fetch_debs.sh fetches them (about 14 MB from the Debian registry); the wheels from
$ASTERIA_GPU_WHEELS or .wheels, else fetch_wheels.sh (about 30 MB from the package index); the
tests skip when that cannot be done (no apt-get or pip, no registry)."""

import json
import os
import shutil
import subprocess

import pytest

# the GPU check's scripts: tested once, in the main environment (scripts/run_tests.sh)
pytestmark = pytest.mark.main_env_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = os.path.join(ROOT, "tests", "gpu")
MODULES = ("openblas", "lapacke", "liburing", "hwloc", "cmocka")

PROBE = r"""
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <cblas.h>
#include <lapacke.h>
#include <hwloc.h>
#include <liburing.h>
#include <cmocka.h>
int main(void) {
    float x[2] = {1, 2}, a[4] = {2, 1, 1, 2}, w[2];
    float dot = cblas_sdot(2, x, 1, x, 1);
    int info = LAPACKE_ssyev(LAPACK_ROW_MAJOR, 'V', 'U', 2, a, 2, w);
    /* linked, not called: an io_uring or a test run needs more than a probe */
    void *ring = (void *)&io_uring_queue_init, *mock = (void *)&_cmocka_run_group_tests;
    printf("%g %d %g %g %x\n", dot, info, w[0], w[1], hwloc_get_api_version());
    return !(dot == 5 && info == 0 && w[0] > 0.99f && w[0] < 1.01f && w[1] > 2.99f
             && w[1] < 3.01f && ring != mock);
}
"""


def _local(kind: str, ext: str):
    """$ASTERIA_GPU_<KIND> or ROOT/.<kind> where it holds ``ext`` files, else None."""
    for d in (os.environ.get(f"ASTERIA_GPU_{kind.upper()}"), os.path.join(ROOT, f".{kind}")):
        if d and os.path.isdir(d) and any(f.endswith(ext) for f in os.listdir(d)):
            return d
    return None


def _fetched(tmp_path_factory, kind: str, what: str) -> str:
    """A fresh directory filled by gpu/fetch_<kind>.sh; the test skipped, naming ``what``,
    where that fails."""
    d = str(tmp_path_factory.mktemp(kind))
    r = subprocess.run(["bash", os.path.join(GPU, f"fetch_{kind}.sh"), d], capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"fetch_{kind}.sh could not fetch the {what}: {r.stderr[-500:]}")
    return d


@pytest.fixture(scope="module")
def debs(tmp_path_factory):
    d = _local("debs", ".deb")
    if d is None and shutil.which("apt-get") is None:
        pytest.skip("no apt-get to fetch the .deb files")
    return d or _fetched(tmp_path_factory, "debs", "packages")


def _hidden_env(tmp_path):
    empty = tmp_path / "no-system-pc"
    empty.mkdir(exist_ok=True)
    env = dict(os.environ, PKG_CONFIG_LIBDIR=str(empty))
    env.pop("PKG_CONFIG_PATH", None)
    return env


@pytest.mark.timeout(300)
def test_prefix_serves_headers_and_libraries(debs, tmp_path):
    if shutil.which("cc") is None or shutil.which("dpkg") is None:
        pytest.skip("needs a C compiler and dpkg")
    prefix = tmp_path / "prefix"
    (tmp_path / "probe.c").write_text(PROBE)
    mods = " ".join(MODULES)
    script = f"""set -euo pipefail
. {GPU}/deps_prefix.sh
asteria_deps_prefix {debs} {prefix}
flags="$(pkg-config --cflags --libs {mods})"
echo "FLAGS $flags"
cc -M probe.c $(pkg-config --cflags {mods}) | tr ' \\\\' '\\n\\n' | sed -n 's/^/HEADER /p'
cc -o probe probe.c $flags
./probe
ldd ./probe | sed -n 's/^/LDD /p'
"""
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_hidden_env(tmp_path),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout.splitlines()
    headers = [ln[len("HEADER "):].strip() for ln in out if ln.startswith("HEADER ")]
    for h in ("cblas.h", "lapacke.h", "hwloc.h", "liburing.h", "cmocka.h"):
        found = [p for p in headers if os.path.basename(p) == h]
        assert found and all(p.startswith(str(prefix)) for p in found), (h, found)
    libs = {ln.split()[1]: ln.split("=>")[1].split()[0] for ln in out
            if ln.startswith("LDD ") and "=>" in ln}
    for soname in ("libopenblas.so.0", "liblapacke.so.3", "libhwloc.so.15", "liburing.so.2",
                   "libcmocka.so.0", "liblapack.so.3", "libblas.so.3"):
        assert libs.get(soname, "").startswith(str(prefix)), (soname, libs.get(soname))


@pytest.mark.timeout(600)
def test_run_sh_builds_against_carried_debs(debs, tmp_path):
    """tests/gpu/run.sh in a copy of this checkout, the machine's pkg-config modules hidden:
    stage 0 unpacks the packages, libasteria, the CUDA C tests (where nvcc is) and the Python
    package build against them, and without a GPU it exits 77."""
    for tool in ("cmake", "cc", "dpkg", "git"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is here: run.sh would run its benchmarks")
    except ImportError:
        pytest.skip("needs torch")
    files = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True,
                           check=True).stdout.decode().split("\0")
    work = tmp_path / "checkout"
    for f in filter(None, files):
        src = os.path.join(ROOT, f)
        if os.path.isfile(src):
            dst = work / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    out = tmp_path / "out"
    env = dict(_hidden_env(tmp_path), ASTERIA_GPU_DEBS=debs, OUT=str(out))
    env.pop("ASTERIA_GPU_INNER", None)
    r = subprocess.run(["bash", "tests/gpu/run.sh"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=580)
    assert r.returncode == 77, r.stdout[-4000:] + r.stderr[-2000:]
    steps = {s["step"]: s for s in json.loads((out / "gpu_check.json").read_text())["steps"]}
    assert steps["deps-prefix"]["status"] == "ok"
    for dep in MODULES:
        assert steps[f"dep:{dep}"]["status"] == "found", steps[f"dep:{dep}"]
    assert steps["dep:dlpack"]["detail"].startswith("libdlpack-dev from")
    assert steps["build-libasteria"]["status"] == "ok"
    assert steps["python-package"]["status"] == "ok"
    assert steps["gpu"]["status"] == "skipped"
    cache = (work / "build" / "gpu" / "CMakeCache.txt").read_text()
    deps = str(work / "build" / "gpu-deps")
    for var in ("OPENBLAS_LIBRARY_DIRS", "LAPACKE_INCLUDE_DIRS", "URING_LIBRARY_DIRS",
                "HWLOC_LIBRARY_DIRS"):
        line = next(ln for ln in cache.splitlines() if ln.startswith(var + ":"))
        assert deps in line, line


def _tree_listing(root):
    out = []
    for d, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = os.path.join(d, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            out.append((rel, oct(st.st_mode), os.readlink(p) if os.path.islink(p) else
                        (st.st_size if os.path.isfile(p) else None)))
    return sorted(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["ar", "python"])
def test_unpacking_without_dpkg_gives_what_dpkg_gives(debs, tmp_path, how):
    if shutil.which("dpkg") is None:
        pytest.skip("needs dpkg for the reference")
    if how == "ar" and (shutil.which("ar") is None or shutil.which("tar") is None):
        pytest.skip("needs binutils' ar and tar")
    listings = {}
    for unpacker in ("dpkg", how):
        dest = tmp_path / unpacker
        dest.mkdir()
        script = f"""set -euo pipefail
. {GPU}/deps_prefix.sh
for f in {debs}/*.deb; do _asteria_deb_x {unpacker} "$f" {dest}; done
"""
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        listings[unpacker] = _tree_listing(dest)
    assert listings["dpkg"] and listings[how] == listings["dpkg"]


def test_unpacker_is_the_first_the_machine_has():
    r = subprocess.run(["bash", "-c", f". {GPU}/deps_prefix.sh; asteria_deb_unpacker; "
                        "ASTERIA_DEB_UNPACKER=python asteria_deb_unpacker"],
                       capture_output=True, text=True, timeout=60)
    first, forced = r.stdout.split()
    assert first == ("dpkg" if shutil.which("dpkg") else "ar" if shutil.which("ar") else
                     "python")
    assert forced == "python"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    return _local("wheels", ".whl") or _fetched(tmp_path_factory, "wheels", "wheels")


@pytest.mark.timeout(300)
def test_build_tools_from_wheels_offline(wheels, tmp_path):
    """Every tool installed as if the machine lacked it: the carried cmake (>= 3.25) and ninja
    run from PATH with PYTHONPATH untouched, and scikit-build-core imports from the one
    directory the pip build is given."""
    prefix = tmp_path / "tools"
    script = f"""set -euo pipefail
. {GPU}/deps_prefix.sh
ASTERIA_GPU_TOOLS="cmake ninja scikit-build-core" asteria_tools_prefix {wheels} {prefix}
echo "CMAKE $(command -v cmake) $(cmake --version | head -n1)"
echo "NINJA $(command -v ninja) $(ninja --version)"
echo "PYTHONPATH=${{PYTHONPATH:-}}"
PYTHONPATH=$ASTERIA_TOOLS_PYTHONPATH python3 -c 'import scikit_build_core as s; print("SKB", s.__file__)'
"""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=240,
                       env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines() if ln.strip()}
    assert out["CMAKE"][0].startswith(str(prefix))
    version = tuple(int(x) for x in out["CMAKE"][-1].split(".")[:2])
    assert version >= (3, 25)
    assert out["NINJA"][0].startswith(str(prefix))
    assert out["SKB"][0].startswith(str(prefix))
    assert "PYTHONPATH=" in r.stdout and f"PYTHONPATH={prefix}" not in r.stdout


@pytest.mark.timeout(120)
def test_nvml_from_its_wheel_offline(wheels, tmp_path):
    """The carried nvidia-ml-py wheel gives a python without pynvml the module from a prefix
    that holds nothing else, so it goes on PYTHONPATH without shadowing the machine's packages."""
    assert any(f.startswith("nvidia_ml_py-") and f.endswith(".whl") for f in os.listdir(wheels)), \
        f"no nvidia-ml-py wheel in {wheels}: fetch them again with tests/gpu/fetch_wheels.sh"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if subprocess.run(["python3", "-c", "import pynvml"], env=env,
                      capture_output=True).returncode == 0:
        pytest.skip("this python has pynvml: asteria_nvml_prefix leaves it alone")
    prefix = tmp_path / "nvml"
    script = f"""set -euo pipefail
. {GPU}/deps_prefix.sh
asteria_nvml_prefix {wheels} {prefix} >{tmp_path}/wheel
echo "WHEEL $(cat {tmp_path}/wheel)"
PYTHONPATH=$ASTERIA_NVML_PYTHONPATH python3 -c 'import pynvml; print("MODULE", pynvml.__file__); print("FN", callable(pynvml.nvmlDeviceGetTotalEnergyConsumption))'
"""
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=100,
                       env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines() if ln.strip()}
    assert out["WHEEL"][0].startswith("nvidia_ml_py-")
    assert out["MODULE"][0] == str(prefix / "pynvml.py")
    assert out["FN"] == ["True"]
    top = sorted(p.name for p in prefix.iterdir())
    assert len(top) == 2 and top[1] == "pynvml.py" and top[0].endswith(".dist-info"), top
    # a machine that has pynvml is left alone: nothing unpacked, status 1
    fake = tmp_path / "has" / "pynvml.py"
    fake.parent.mkdir()
    fake.write_text("")
    r = subprocess.run(["bash", "-c", f". {GPU}/deps_prefix.sh; "
                        f"asteria_nvml_prefix {wheels} {tmp_path}/again"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(env, PYTHONPATH=str(fake.parent)))
    assert r.returncode == 1 and not (tmp_path / "again").exists()
