#!/usr/bin/env bash
# Fetch, here, the Debian packages libasteria builds and links against, for a machine that has
# no apt and no registry (the lent GPU machine): tests/gpu/run.sh unpacks them there with
# `dpkg -x` into a private prefix (tests/gpu/deps_prefix.sh) and points pkg-config, CMake and
# the loader at it.
#
#   bash tests/gpu/fetch_debs.sh [DIR]     # default DIR: .debs in the repository root
#
# DIR/*.deb go first on the search paths; DIR/fallback/*.deb (runtime libraries a machine
# usually has in a newer version: libgfortran, libquadmath, libudev) go last, so the machine's
# own win where it has them (deps_prefix.sh). .debs is in .gitignore: it travels to the GPU
# machine only when named in the device tool's `carry`. Needs apt-get (run `apt-get update`
# first on a fresh machine); about 14 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.debs}

# The build's own dependencies (pkg-config modules openblas, lapacke, liburing, hwloc, cmocka),
# the libraries they load (the pthread OpenBLAS provides the BLAS / LAPACK that liblapacke
# links), pkg-config itself and the DLPack header.
PRIMARY=(libopenblas0-pthread libopenblas-pthread-dev liblapacke liblapacke-dev libtmglib3
         liburing2 liburing-dev libhwloc15 libhwloc-dev libcmocka0 libcmocka-dev
         pkgconf pkgconf-bin libpkgconf3 libdlpack-dev)
FALLBACK=(libgfortran5 libquadmath0 libudev1)

mkdir -p "$DIR/fallback"
rm -f "$DIR"/*.deb "$DIR"/fallback/*.deb
# apt-get download writes into the current directory; as root it warns that _apt cannot
# reach it (the download itself works)
(cd "$DIR" && apt-get download "${PRIMARY[@]}")
(cd "$DIR/fallback" && apt-get download "${FALLBACK[@]}")
echo "fetched $(ls "$DIR"/*.deb "$DIR"/fallback/*.deb | wc -l) packages into $DIR ($(du -sh "$DIR" | cut -f1))"
