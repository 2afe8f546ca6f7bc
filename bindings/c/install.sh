#!/usr/bin/env bash
# Installs the teraio C API under a prefix: lib/libteraio.{so,a}, include/teraio.h,
# lib/pkgconfig/teraio.pc and lib/cmake/teraio/teraio-config.cmake.
#
#   bindings/c/install.sh /usr/local                          # builds the release library first
#   TERAIO_LIB_DIR=target/release bindings/c/install.sh ~/.local   # installs an already built one
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 PREFIX" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
mkdir -p "$1"
prefix="$(cd "$1" && pwd)"
libdir="$prefix/lib"

if [[ -z "${TERAIO_LIB_DIR:-}" ]]; then
    cargo build --manifest-path "$root/Cargo.toml" -p teraio-c --release
    TERAIO_LIB_DIR="${CARGO_TARGET_DIR:-$root/target}/release"
fi
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$here/Cargo.toml" | head -n 1)"

install -d "$prefix/include" "$libdir/pkgconfig" "$libdir/cmake/teraio"
install -m 644 "$here/include/teraio.h" "$prefix/include/teraio.h"
install -m 755 "$TERAIO_LIB_DIR/libteraio.so" "$libdir/libteraio.so"
install -m 644 "$TERAIO_LIB_DIR/libteraio.a" "$libdir/libteraio.a"
sed -e "s|@PREFIX@|$prefix|g" -e "s|@LIBDIR@|$libdir|g" -e "s|@VERSION@|$version|g" \
    "$here/teraio.pc.in" >"$libdir/pkgconfig/teraio.pc"
sed -e "s|@VERSION@|$version|g" "$here/cmake/teraio-config.cmake.in" >"$libdir/cmake/teraio/teraio-config.cmake"
echo "installed teraio $version C API under $prefix"
