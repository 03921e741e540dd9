#!/usr/bin/env bash
# The CPU wheel on a bare system (docs/install.md): a minimal Debian root (debootstrap minbase
# plus python3 and python3-venv; no -dev packages, no OpenBLAS, no compiler), torch and numpy
# fetched here with `pip download` and installed there with --no-index inside a network
# namespace of its own, the asteria wheel installed by a non-root user into a venv, then
# scripts/wheel_smoke.py as that user: SOAP async (refresh on the C pool), the NVMe tier in a
# temporary directory, a state-dict round trip, every library of asteria._C from the wheel.
#
#   sudo bash scripts/test_wheel_bare.sh [--fresh] [WHEEL]
#
# WHEEL: default the newest CPU abi3 wheel in dist/; a +cuN wheel runs there too (no driver in
# the root: it must import and take the CPU path).
#
# Root is needed for debootstrap, chroot and the mounts. The root and the downloads are kept in
# BARE_CACHE (default .bare/, git-ignored): a rerun only reinstalls asteria (--fresh: a new
# root and venv, the downloads checked again).
# Not part of scripts/run_tests.sh: the first run downloads torch's wheels (~2.6 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

fresh=0
whl=""
for a in "$@"; do
  case $a in
    --fresh) fresh=1;;
    -h|--help) sed -n '2,17p' "$0"; exit 0;;
    *) whl=$a;;
  esac
done
if [ -z "$whl" ]; then
  whl=$(ls -t dist/asteria-*-abi3-manylinux*.whl 2>/dev/null | grep -v '+cu' | head -1 || true)
fi
[ -f "$whl" ] || { echo "no CPU wheel given or in dist/: run bash scripts/build_wheel.sh" >&2; exit 1; }
whl=$(readlink -f "$whl")
[ "$(id -u)" -eq 0 ] || { echo "run as root (debootstrap, chroot, mounts)" >&2; exit 1; }

CACHE=$(readlink -f "${BARE_CACHE:-.bare}")
BR=$CACHE/root
SUITE=${BARE_SUITE:-bookworm}
TORCH=${BARE_TORCH:-2.11.0}
USER_NAME=trainer
log() { echo "[bare] $*"; }
t_start=$(date +%s)
mkdir -p "$CACHE/wheels"

# A run killed before its cleanup leaves /dev, /proc, /sys and the wheelhouse mounted in the
# root: removing the root then would go through them. Unmount first, and refuse if that fails.
clear_root() {
  local m
  for m in $(awk -v r="$BR/" 'index($2, r) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount -l "$m"
  done
  if awk -v r="$BR/" 'index($2, r) == 1 {found = 1} END {exit !found}' /proc/self/mounts; then
    echo "mounts left under $BR: not removing it" >&2; exit 1
  fi
  rm -rf --one-file-system "$BR"
}

if ((fresh)); then
  clear_root
  rm -f "$CACHE/wheels.ok"
fi

# ---- the root ---------------------------------------------------------------------------------
if [ ! -f "$BR/.asteria-bare-ok" ]; then
  command -v debootstrap >/dev/null || {
    log "apt-get install debootstrap"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
  }
  # the Debian mirror apt uses here (deb822 "URIs:" or one-line "deb" entries)
  mirror=$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
               /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } |
           sed -n -e 's/^URIs: *//p' -e 's/^deb  *\(\[[^]]*\] *\)\{0,1\}\([^ ]*\).*/\2/p' |
           tr ' ' '\n' | grep -m1 -E '/debian/?$' || true)
  [ -n "$mirror" ] || { echo "no Debian mirror in /etc/apt/sources.list*" >&2; exit 1; }
  log "debootstrap --variant=minbase $SUITE from $mirror (python3, python3-venv)"
  clear_root
  nice -n 19 debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$BR" "$mirror" \
    > "$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log"; exit 1; }
  chroot "$BR" useradd --create-home --shell /bin/bash "$USER_NAME"
  touch "$BR/.asteria-bare-ok"
fi
log "root $BR: $(du -sh --exclude=home "$BR" | cut -f1), $(chroot "$BR" dpkg-query -W | wc -l) packages"

# What the root must not have: that is what makes the test mean something.
bad=$(chroot "$BR" dpkg-query -W -f '${Package}\n' |
      grep -E -- '-dev$|openblas|lapack|^libblas|uring|hwloc|^gcc(-[0-9]+)?$|^cpp|^clang|^g\+\+' || true)
[ -z "$bad" ] || { echo "the bare root has packages it must not have: $bad" >&2; exit 1; }
if chroot "$BR" sh -c 'command -v cc gcc c99 clang' >/dev/null; then
  echo "the bare root has a C compiler" >&2; exit 1
fi
log "no -dev package, no BLAS/LAPACK, liburing or hwloc, no compiler in the root"

# ---- the wheels (downloaded here; the root has no network when they are installed) ----------
py_root=$(chroot "$BR" python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
if [ ! -f "$CACHE/wheels.ok" ] || [ "$(cat "$CACHE/wheels.ok")" != "torch==$TORCH numpy cp$py_root" ]; then
  plats=()
  for v in $(seq 17 "$(chroot "$BR" python3 -c 'import platform; print(platform.libc_ver()[1].split(".")[1])')"); do
    plats+=(--platform "manylinux_2_${v}_x86_64")
  done
  plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
  log "pip download torch==$TORCH numpy for cp$py_root into $CACHE/wheels"
  nice -n 19 python3 -m pip download -q --no-cache-dir -d "$CACHE/wheels" --only-binary=:all: \
    --python-version "$py_root" --implementation cp "${plats[@]}" "torch==$TORCH" numpy
  echo "torch==$TORCH numpy cp$py_root" > "$CACHE/wheels.ok"
fi
log "wheelhouse: $(ls "$CACHE/wheels" | wc -l) files, $(du -sh "$CACHE/wheels" | cut -f1)"

# ---- mounts for the run ------------------------------------------------------------------------
mounted=()
cleanup() {
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" || true; done
}
trap cleanup EXIT
mnt() { mount "$@"; mounted+=("${@: -1}"); }
mnt -t proc proc "$BR/proc"
mnt -t sysfs sysfs "$BR/sys"
mnt --bind /dev "$BR/dev"
mkdir -p "$BR/opt/wheels" "$BR/opt/asteria"
mnt --bind -o ro "$CACHE/wheels" "$BR/opt/wheels"
rm -f "$BR"/opt/asteria/*
cp "$whl" scripts/wheel_smoke.py "$BR/opt/asteria/"
chmod a+r "$BR"/opt/asteria/*

# As the user, with nothing from this shell's environment and no network at all.
as_user() {
  unshare --net chroot --userspec="$USER_NAME:$USER_NAME" "$BR" \
    env -i HOME="/home/$USER_NAME" USER="$USER_NAME" PATH=/usr/bin:/bin LANG=C.UTF-8 \
    bash -c "cd ~ && $1"
}
VENV=/home/$USER_NAME/venv
if ! as_user "test -x $VENV/bin/python && $VENV/bin/python -c 'import torch'" 2>/dev/null; then
  log "as $USER_NAME: venv $VENV, pip install --no-index torch==$TORCH numpy"
  as_user "rm -rf $VENV && python3 -m venv $VENV &&
           $VENV/bin/pip install -q --no-index --find-links /opt/wheels torch==$TORCH numpy"
fi
base=$(basename "$whl")
log "as $USER_NAME (uid $(chroot "$BR" id -u "$USER_NAME")): pip install --no-index $base"
t_install=$(date +%s)
as_user "$VENV/bin/pip uninstall -q -y asteria 2>/dev/null; set -e
         $VENV/bin/pip install -q --no-index --find-links /opt/wheels /opt/asteria/$base
         $VENV/bin/pip list 2>/dev/null | grep -E '^(asteria|torch|numpy) '"
log "installed in $(($(date +%s) - t_install)) s"

log "ldd of every shared object in the installed asteria"
as_user "set -e; shopt -s nullglob; site=\$($VENV/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"platlib\"])')
         missing=0
         for so in \$site/asteria/*.so \$site/asteria.libs/*.so*; do
           nf=\$(ldd \$so | grep 'not found' || true)
           if [ -n \"\$nf\" ]; then missing=1; echo \"  \${so#\$site/}: \$nf\"
           else echo \"  \${so#\$site/}: \$(ldd \$so | grep -c '=>') libraries, all found\"; fi
         done
         exit \$missing" || { echo "a library of the wheel is missing in the bare root" >&2; exit 1; }

log "as $USER_NAME: python /opt/asteria/wheel_smoke.py --vendored"
t_run=$(date +%s)
as_user "$VENV/bin/python /opt/asteria/wheel_smoke.py --vendored"
log "smoke run $(($(date +%s) - t_run)) s; whole script $(($(date +%s) - t_start)) s"
log "PASS: $base on a bare $SUITE root, as a non-root user, offline"
