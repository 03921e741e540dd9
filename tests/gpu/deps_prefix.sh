# Sourced, not run: asteria_deps_prefix DEBS PREFIX unpacks the .deb files that
# tests/gpu/fetch_debs.sh fetched (DEBS/*.deb, DEBS/fallback/*.deb) into PREFIX with `dpkg -x`
# and exports what makes the build and the tests use them: PATH (a pkg-config, if the machine
# has none), PKG_CONFIG_PATH (the .pc files carry the -I / -L of PREFIX) and LD_LIBRARY_PATH
# (the loader, and the linker's search for the libraries those libraries load). Not CPATH or
# LIBRARY_PATH: pkgconf leaves out the -I / -L of directories named there, and CMake's
# pkg_check_modules finds a module's libraries through its -L. Returns 1, having changed
# nothing in the environment, when DEBS holds no .deb or dpkg is missing.
#
# What `dpkg -x` does not do, done here: the packages' files name /usr (the .pc files'
# prefix, libdir and include paths), rewritten to PREFIX/usr, and PREFIX/usr/include added to
# every module's Cflags (lapacke.pc names only include/x86_64-linux-gnu: its header is in
# /usr/include, which a compiler searches anyway, but not PREFIX/usr/include); Debian's alternatives links
# (openblas.pc, lapack.pc, libblas.so.3 and liblapack.so.3 → the pthread OpenBLAS), which
# its maintainer scripts would make, made by hand.

asteria_deps_prefix() {
  local debs=$1 prefix=$2 f ml pc
  compgen -G "$debs/*.deb" >/dev/null || return 1
  command -v dpkg >/dev/null 2>&1 || { echo "asteria_deps_prefix: no dpkg to unpack $debs" >&2; return 1; }
  rm -rf "$prefix"
  mkdir -p "$prefix/fallback"
  for f in "$debs"/*.deb; do dpkg -x "$f" "$prefix" || return 1; done
  for f in "$debs"/fallback/*.deb; do
    [ -e "$f" ] || continue
    dpkg -x "$f" "$prefix/fallback" || return 1
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
