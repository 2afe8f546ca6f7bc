#!/usr/bin/env bash
# Compiles the C test and the C example with the system compiler against include/teraio.h and
# libteraio, checks that the header also compiles as C++, and runs both programs.
#
#   bindings/c/run-c-tests.sh            # builds libteraio with cargo first (debug profile)
#   TERAIO_LIB_DIR=target/debug bindings/c/run-c-tests.sh   # uses an already built library
#
# The test binary links the static library, the example the shared one (with an rpath), so both
# artifacts are exercised. Store files go under $TERAIO_TEST_DIR (default: the library
# directory), which must be on a file system with O_DIRECT (ext4, xfs; not tmpfs).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
CC="${CC:-cc}"
CXX="${CXX:-c++}"

if [[ -z "${TERAIO_LIB_DIR:-}" ]]; then
    cargo build --manifest-path "$root/Cargo.toml" -p teraio-c
    TERAIO_LIB_DIR="${CARGO_TARGET_DIR:-$root/target}/debug"
fi
lib_dir="$(cd "$TERAIO_LIB_DIR" && pwd)"
for artifact in libteraio.a libteraio.so; do
    [[ -f "$lib_dir/$artifact" ]] || { echo "run-c-tests: $lib_dir/$artifact not found" >&2; exit 1; }
done

work="${TERAIO_TEST_DIR:-$lib_dir/teraio-c-tests}"
mkdir -p "$work/bin"
cflags=(-std=c11 -Wall -Wextra -Werror -pedantic -O1 -g -I"$here/include")

"$CC" "${cflags[@]}" "$here/tests/test_teraio.c" "$lib_dir/libteraio.a" -lpthread -ldl -lm \
    -o "$work/bin/test_teraio"
"$CC" "${cflags[@]}" "$here/examples/roundtrip.c" -L"$lib_dir" -lteraio -Wl,-rpath,"$lib_dir" \
    -o "$work/bin/roundtrip"
if command -v "$CXX" >/dev/null; then
    printf '#include "teraio.h"\nint main() { return teraio_abi_version() == TERAIO_ABI_VERSION ? 0 : 1; }\n' |
        "$CXX" -std=c++17 -Wall -Wextra -Werror -pedantic -I"$here/include" -x c++ -fsyntax-only -
fi

"$work/bin/test_teraio" "$work/test-store"
"$work/bin/roundtrip" "$work/example-store"

# Install into a scratch prefix and build the example the way a user would: through pkg-config
# (and CMake, where it is installed).
prefix="$work/prefix"
rm -rf "$prefix"
TERAIO_LIB_DIR="$lib_dir" "$here/install.sh" "$prefix" >/dev/null
if command -v pkg-config >/dev/null; then
    export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
    # shellcheck disable=SC2046 # word splitting of the flags is intended
    "$CC" -std=c11 -Wall -Werror "$here/examples/roundtrip.c" $(pkg-config --cflags --libs teraio) \
        -Wl,-rpath,"$prefix/lib" -o "$work/bin/roundtrip-pkgconfig"
    # shellcheck disable=SC2046
    "$CC" -std=c11 -Wall -Werror "$here/examples/roundtrip.c" -I"$prefix/include" "$prefix/lib/libteraio.a" \
        $(pkg-config --static --libs-only-l teraio | sed 's/-lteraio//') -o "$work/bin/roundtrip-static"
    "$work/bin/roundtrip-pkgconfig" "$work/example-store" >/dev/null
    "$work/bin/roundtrip-static" "$work/example-store" >/dev/null
    echo "pkg-config build: ok"
fi
if command -v cmake >/dev/null; then
    cmake_src="$work/cmake-src"
    mkdir -p "$cmake_src"
    cp "$here/examples/roundtrip.c" "$cmake_src/"
    cp "$here/examples/CMakeLists.txt" "$cmake_src/"
    cmake -S "$cmake_src" -B "$work/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
    cmake --build "$work/cmake-build" >/dev/null
    "$work/cmake-build/roundtrip" "$work/example-store" >/dev/null
    "$work/cmake-build/roundtrip_static" "$work/example-store" >/dev/null
    echo "cmake build: ok"
fi
