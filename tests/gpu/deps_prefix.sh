# Sourced, not run. Three functions for a machine with no apt and no package index:
#
# asteria_deps_prefix DEBS PREFIX unpacks the .deb files that tests/gpu/fetch_debs.sh fetched
# (DEBS/*.deb, DEBS/fallback/*.deb) into PREFIX and exports what makes the build and the tests
# use them: PATH (a pkg-config, if the machine has none), PKG_CONFIG_PATH (the .pc files carry
# the -I / -L of PREFIX) and LD_LIBRARY_PATH (the loader, and the linker's search for the
# libraries those libraries load). Not CPATH or LIBRARY_PATH: pkgconf leaves out the -I / -L of
# directories named there, and CMake's pkg_check_modules finds a module's libraries through its
# -L. Unpacking: `dpkg -x`; without dpkg, binutils' ar and tar; without those, python3 reads the
# ar archive and its data.tar itself (ASTERIA_DEB_UNPACKER=dpkg|ar|python picks one). Returns 1,
# having changed nothing in the environment, when DEBS holds no .deb or none of the three can
# unpack them. The libraries are Debian 12's: they need glibc >= 2.36 (run.sh prints the
# machine's).
#
# asteria_tools_prefix WHEELS PREFIX installs, from the wheels tests/gpu/fetch_wheels.sh
# fetched, the build tools the machine lacks (cmake >= 3.25, ninja, scikit-build-core) with
# `pip install --no-index --find-links WHEELS --target PREFIX`, puts the cmake and ninja
# binaries first on PATH (no Python needed to run them) and exports ASTERIA_TOOLS_PYTHONPATH
# (PREFIX: the directory pip's build backend imports scikit-build-core from, for the one pip
# command that builds the package; not PYTHONPATH, whose entries would shadow the machine's own
# packages, torch's typing_extensions among them), and prints what it installed.
# ASTERIA_GPU_TOOLS="cmake ninja scikit-build-core" installs those whatever the machine has.
# Returns 1 with nothing changed when nothing is lacking or WHEELS holds no wheel; 2 when pip
# failed (the message on stderr).
#
# asteria_nvml_prefix WHEELS PREFIX gives the machine's python pynvml (package nvidia-ml-py, the
# train-f1 stage's NVML energy readings) from the wheel fetch_wheels.sh fetched, when it lacks
# it: a pure-Python wheel is a zip of site-packages' layout, so python3's zipfile unpacks its
# pynvml.py and dist-info into PREFIX, no pip needed. PREFIX holds that one module and goes on
# PYTHONPATH (exported as ASTERIA_NVML_PYTHONPATH) without shadowing any of the machine's own.
# Prints the wheel's name. Returns 1 with nothing changed when the machine has pynvml or WHEELS
# holds no nvidia_ml_py wheel; 2 when the wheel could not be unpacked (the message on stderr).
#
# What `dpkg -x` does not do, done here: the packages' files name /usr (the .pc files'
# prefix, libdir and include paths), rewritten to PREFIX/usr, and PREFIX/usr/include added to
# every module's Cflags (lapacke.pc names only include/x86_64-linux-gnu: its header is in
# /usr/include, which a compiler searches anyway, but not PREFIX/usr/include); Debian's alternatives links
# (openblas.pc, lapack.pc, libblas.so.3 and liblapack.so.3 → the pthread OpenBLAS), which
# its maintainer scripts would make, made by hand.

# The unpacker this machine has (ASTERIA_DEB_UNPACKER overrides): dpkg, ar (+ tar), python.
asteria_deb_unpacker() {
  if [ -n "${ASTERIA_DEB_UNPACKER:-}" ]; then echo "$ASTERIA_DEB_UNPACKER"
  elif command -v dpkg >/dev/null 2>&1; then echo dpkg
  elif command -v ar >/dev/null 2>&1 && command -v tar >/dev/null 2>&1; then echo ar
  elif command -v "${PYTHON:-python3}" >/dev/null 2>&1; then echo python
  else echo none; fi
}

# _asteria_deb_x HOW DEB DIR: the package's files (its data.tar) under DIR, as dpkg -x does.
_asteria_deb_x() {
  local how=$1 deb=$2 dir=$3 member
  case $how in
    dpkg) dpkg -x "$deb" "$dir" ;;
    ar)
      member=$(ar t "$deb" | grep -m1 '^data\.tar') || { echo "$deb: no data.tar member" >&2; return 1; }
      case $member in
        *.xz) ar p "$deb" "$member" | tar -xJ -C "$dir" ;;
        *.gz) ar p "$deb" "$member" | tar -xz -C "$dir" ;;
        *.zst) ar p "$deb" "$member" | tar --zstd -x -C "$dir" ;;
        *) ar p "$deb" "$member" | tar -x -C "$dir" ;;
      esac ;;
    python)
      "${PYTHON:-python3}" - "$deb" "$dir" <<'PYEOF'
import io, sys, tarfile
deb, dest = sys.argv[1], sys.argv[2]
with open(deb, "rb") as f:
    data = f.read()
if data[:8] != b"!<arch>\n":
    sys.exit(f"{deb}: not an ar archive (a .deb is one)")
pos = 8
while pos + 60 <= len(data):  # ar members: a 60-byte header, the body, padded to even size
    name = data[pos:pos + 16].decode().strip().rstrip("/")
    size = int(data[pos + 48:pos + 58])
    body = data[pos + 60:pos + 60 + size]
    pos += 60 + size + (size & 1)
    if name.startswith("data.tar"):
        if name.endswith(".zst"):
            sys.exit(f"{deb}: {name} is zstd, which this python's tarfile cannot read: "
                     "install dpkg, or binutils' ar with tar and zstd")
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as t:
            # our own packages, fetched by fetch_debs.sh: extracted as dpkg -x does (their
            # links may be absolute, which the safer filters refuse)
            if hasattr(tarfile, "fully_trusted_filter"):
                t.extractall(dest, filter="fully_trusted")
            else:
                t.extractall(dest)
        sys.exit(0)
sys.exit(f"{deb}: no data.tar member")
PYEOF
      ;;
    *) echo "no way to unpack $deb: no dpkg, no ar and tar, no python3" >&2; return 1 ;;
  esac
}

asteria_deps_prefix() {
  local debs=$1 prefix=$2 f ml pc how
  compgen -G "$debs/*.deb" >/dev/null || return 1
  how=$(asteria_deb_unpacker)
  [ "$how" != none ] || { echo "asteria_deps_prefix: no dpkg, ar + tar or python3 to unpack $debs" >&2; return 1; }
  rm -rf "$prefix"
  mkdir -p "$prefix/fallback"
  for f in "$debs"/*.deb; do _asteria_deb_x "$how" "$f" "$prefix" || return 1; done
  for f in "$debs"/fallback/*.deb; do
    [ -e "$f" ] || continue
    _asteria_deb_x "$how" "$f" "$prefix/fallback" || return 1
  done
  ml=$prefix/usr/lib/x86_64-linux-gnu
  while IFS= read -r -d '' pc; do
    sed -i -e "s|=/usr/|=$prefix/usr/|g" -e "s|=/usr\$|=$prefix/usr|" \
           -e "s|-I/usr/|-I$prefix/usr/|g" -e "s|-L/usr/|-L$prefix/usr/|g" \
           -e "s|^Cflags:.*|& -I$prefix/usr/include|" "$pc"
  done < <(find "$prefix/usr" -name '*.pc' -type f -print0)
  mkdir -p "$ml/pkgconfig"
  ln -sf ../openblas-pthread/pkgconfig/openblas.pc "$ml/pkgconfig/openblas.pc"
  ln -sf ../openblas-pthread/pkgconfig/blas-openblas.pc "$ml/pkgconfig/blas.pc"
  ln -sf ../openblas-pthread/pkgconfig/lapack-openblas.pc "$ml/pkgconfig/lapack.pc"
  for f in libblas.so.3 liblapack.so.3 libopenblas.so.0 libblas.so liblapack.so libopenblas.so; do
    [ -e "$ml/openblas-pthread/$f" ] && ln -sf "openblas-pthread/$f" "$ml/$f"
  done
  if ! command -v pkg-config >/dev/null 2>&1 && [ -x "$prefix/usr/bin/pkgconf" ]; then
    mkdir -p "$prefix/bin"
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$prefix/usr/bin/pkgconf" >"$prefix/bin/pkg-config"
    chmod +x "$prefix/bin/pkg-config"
    export PATH=$prefix/bin:$PATH
  fi
  export PKG_CONFIG_PATH=$ml/pkgconfig:$prefix/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  # a fallback library serves only where the machine has none of that name (LD_LIBRARY_PATH
  # comes before the machine's own directories wherever it is put)
  local cache lib name
  cache=$( ( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true) | awk 'NR > 1 {print $1}')
  mkdir -p "$prefix/fallback-lib"
  for lib in "$prefix"/fallback/usr/lib/x86_64-linux-gnu/*.so.* "$prefix"/fallback/lib/x86_64-linux-gnu/*.so.*; do
    [ -e "$lib" ] || continue
    name=${lib##*/}
    case $name in *.so.[0-9]|*.so.[0-9][0-9]) ;; *) continue;; esac  # the soname links
    grep -qxF "$name" <<<"$cache" || ln -sf "$lib" "$prefix/fallback-lib/$name"
  done
  export LD_LIBRARY_PATH=$ml:$ml/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:$prefix/fallback-lib
  return 0
}

asteria_tools_prefix() {
  local wheels=$1 prefix=$2 py=${PYTHON:-python3} want=() v
  compgen -G "$wheels/*.whl" >/dev/null || return 1
  if [ -n "${ASTERIA_GPU_TOOLS:-}" ]; then
    read -r -a want <<<"$ASTERIA_GPU_TOOLS"
  else
    v=$(cmake --version 2>/dev/null | head -n1 | awk '{print $3}')
    if [ -z "$v" ] || [ "$(printf '%s\n3.25\n' "$v" | sort -V | head -n1)" != "3.25" ]; then
      want+=(cmake)
    fi
    command -v ninja >/dev/null 2>&1 || want+=(ninja)
    "$py" -c "import scikit_build_core" >/dev/null 2>&1 || want+=(scikit-build-core)
  fi
  [ ${#want[@]} -gt 0 ] || return 1
  local spec=() t
  for t in "${want[@]}"; do
    case $t in cmake) spec+=("cmake>=3.25");; scikit-build-core) spec+=("scikit-build-core>=0.10");; *) spec+=("$t");; esac
  done
  rm -rf "$prefix"
  if ! "$py" -m pip install --quiet --no-index --find-links "$wheels" --target "$prefix" "${spec[@]}" >&2; then
    echo "asteria_tools_prefix: pip could not install ${spec[*]} from $wheels (no pip, or no wheel for this python)" >&2
    return 2
  fi
  [ -d "$prefix/cmake/data/bin" ] && export PATH=$prefix/cmake/data/bin:$PATH
  [ -x "$prefix/bin/ninja" ] && { mkdir -p "$prefix/ninja-bin"; ln -sf ../bin/ninja "$prefix/ninja-bin/ninja"; export PATH=$prefix/ninja-bin:$PATH; }
  export ASTERIA_TOOLS_PYTHONPATH=$prefix
  echo "${want[*]}"
}

asteria_nvml_prefix() {
  local wheels=$1 prefix=$2 py=${PYTHON:-python3} whl
  "$py" -c "import pynvml" >/dev/null 2>&1 && return 1
  whl=$(ls "$wheels"/nvidia_ml_py-*.whl 2>/dev/null | sort -V | tail -n1)
  [ -n "$whl" ] || return 1
  rm -rf "$prefix"
  mkdir -p "$prefix"
  "$py" - "$whl" "$prefix" <<'PYEOF' || return 2
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist()
             if n == "pynvml.py" or n.split("/")[0].endswith(".dist-info")]
    if "pynvml.py" not in names:
        sys.exit(f"{whl}: no pynvml.py in the wheel")
    z.extractall(dest, names)
PYEOF
  export ASTERIA_NVML_PYTHONPATH=$prefix
  echo "${whl##*/}"
}
