#!/bin/sh
# Lays out Debian's LLVM 22 (package llvm-22-dev) where the tracel LLVM bundler looks for its
# LLVM 23 build, so that `cargo build --features cuda` links it instead of downloading one.
#
#   scripts/setup-llvm-prefix.sh <dir>      (then build with XDG_DATA_HOME=<dir>)
#
# CubeCL's CUDA runtime (cubecl-cuda 0.12) compiles kernels in-process through LLVM's NVPTX
# backend (crate cubecl-llvm). Its build dependency tracel-llvm-bundler skips the download when
# `$XDG_DATA_HOME/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed` exists, and cubecl-llvm's
# build script then asks `<prefix>/bin/llvm-config --link-static` how to link. LLVM 22 stands in
# for 23: cubecl-llvm calls none of the C-API functions 23 added (checked against the headers).
#
# The prefix holds:
#   include -> /usr/lib/llvm-22/include
#   lib/    links to every file of /usr/lib/llvm-22/lib, plus the static zlib, zstd and
#           libstdc++ archives: this is the first -L of the final link, so those win over the
#           shared libraries and the binary needs only libc, libm and libgcc_s on a GPU machine
#   bin/llvm-config  a wrapper (below)
set -eu
xdg="${1:?usage: $0 <xdg-data-home>}"
llvm=/usr/lib/llvm-22
prefix="$xdg/tracel/tracel-llvm-23.1.0-4"
[ -x "$llvm/bin/llvm-config" ] || { echo "setup-llvm-prefix: $llvm/bin/llvm-config missing (apt-get install llvm-22-dev)" >&2; exit 1; }
for a in /usr/lib/x86_64-linux-gnu/libzstd.a /usr/lib/x86_64-linux-gnu/libz.a; do
  [ -f "$a" ] || { echo "setup-llvm-prefix: $a missing (apt-get install libzstd-dev zlib1g-dev)" >&2; exit 1; }
done
# The wrapper, written first to a scratch file: an existing prefix that already matches is left
# untouched, since a new sentinel file makes cargo rebuild cubecl-llvm and everything above it.
tmp=$(mktemp); trap 'rm -f "$tmp"' EXIT
cat > "$tmp" <<'WRAPPER'
#!/bin/sh
# Debian's llvm-config for LLVM 22 behind the bundler's LLVM 23 prefix:
#  --libdir       this prefix's lib/ (see setup-llvm-prefix.sh)
#  --libs         without Polly (llvm-22-dev ships no static Polly; NVPTX code generation does
#                 not use it)
#  --system-libs  without z3 (an absolute .so path the bundler cannot turn into -l; only
#                 clang's static analyser uses it) and libxml2 (only the Windows manifest tool)
here=$(cd "$(dirname "$0")/.." && pwd)
case " $* " in *" --libdir "*) echo "$here/lib"; exit 0;; esac
out=$(/usr/lib/llvm-22/bin/llvm-config "$@") || exit $?
printf '%s\n' "$out" | sed -e 's#-lPolly\(ISL\)\? \?##g' -e 's#/usr/lib/x86_64-linux-gnu/libz3.so \?##' -e 's#-lxml2##'
WRAPPER
if [ -f "$prefix/.tracel-llvm-installed" ] && cmp -s "$tmp" "$prefix/bin/llvm-config" \
  && [ "$(ls "$prefix/lib" | wc -l)" -eq "$(( $(ls "$llvm/lib" | wc -l) + 3 ))" ]; then
  echo "setup-llvm-prefix: $prefix already laid out (left as is)"
  exit 0
fi
rm -rf "$prefix"
mkdir -p "$prefix/bin" "$prefix/lib"
ln -s "$llvm/include" "$prefix/include"
for f in "$llvm"/lib/*; do ln -s "$f" "$prefix/lib/"; done
ln -sf /usr/lib/x86_64-linux-gnu/libzstd.a "$prefix/lib/libzstd.a"
ln -sf /usr/lib/x86_64-linux-gnu/libz.a "$prefix/lib/libz.a"
ln -sf "$(g++ -print-file-name=libstdc++.a)" "$prefix/lib/libstdc++.a"
cp "$tmp" "$prefix/bin/llvm-config"
chmod +x "$prefix/bin/llvm-config"
touch "$prefix/.tracel-llvm-installed"
echo "setup-llvm-prefix: LLVM $("$llvm/bin/llvm-config" --version) laid out in $prefix"
