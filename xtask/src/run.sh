#!/usr/bin/env bash
# Runs what `cargo xtask device-build` bundled, on a machine with a CUDA driver and no Rust.
#   run.sh stash                 keep the groups/parts that came with this call in $stash (/tmp
#                                survives between calls of a warm machine); later calls find them
#   run.sh tests [libtest args]  every CUDA test binary; exits non-zero if any fails
#   run.sh test NAME [args]      one test binary (core, cce_tests, sage, llama_tests, ...)
#   run.sh bench [runner args]   the benchmark runner (give --out an absolute path)
#   run.sh bin NAME [args]       a bundled tool: llama, finetune, spec_table, decode_profile
#   run.sh env                   print the environment the others run in
# RUN_WRAP (e.g. "ncu --profile-from-start off ...") prefixes the bench and bin commands.
# Each bundle group (gNN.tar.xz: one binary, libdevice, the peer wheels) unpacks once into $dest. Binaries run from $dest, so CubeCL keeps its
# autotune and kernel caches under $XDG_CACHE_HOME/cubecl (default /tmp/burn-kernels-cache).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${BURN_KERNELS_DEVICE_DIR:-/tmp/burn-kernels-device}
stash=${BURN_KERNELS_DEVICE_STASH:-/tmp/burn-kernels-stash}
mkdir -p "$stash"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/burn-kernels-cache}

# The path of part $1 (this call's copy or the stash's), checked against the MANIFEST.
part() {
  local want f
  want=$(awk -v n="$1" '$1 == n { print $2 }' "$here/MANIFEST")
  for f in "$here/$1" "$stash/$1"; do
    if [ -f "$f" ] && [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$want" ]; then
      echo "$f"; return 0
    fi
  done
  return 1
}

parts_of() { awk -v p="$1" '$1 != "commit" && index($1, p) == 1 { print $1 }' "$here/MANIFEST"; }

# Unpack every group of this commit that is here or stashed and not yet unpacked; a new commit
# starts $dest afresh. Missing groups are fine: what arrived runs.
commit=$(awk '$1 == "commit" { print $2 }' "$here/MANIFEST")
if [ "${1:-}" != stash ]; then
  [ "$(cat "$dest/COMMIT" 2>/dev/null)" = "$commit" ] || { rm -rf "$dest"; mkdir -p "$dest"; }
  for g in $(parts_of g | grep '\.tar\.xz$'); do
    [ -f "$dest/.$g" ] && continue
    f=$(part "$g") || continue
    xz -dc "$f" | tar xf - -C "$dest" && touch "$dest/.$g" && echo "unpacked $g" >&2 \
      || { echo "run.sh: unpacking $g failed" >&2; exit 3; }
  done
  [ -f "$dest/COMMIT" ] || { echo "run.sh: no bundle group of commit $commit is here or stashed: carry .device/gNN.tar.xz" >&2; exit 3; }
fi

# The model, when its parts were bundled (device-build --model) and all are here or stashed.
model_file="$stash/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$model_file" ] && [ -n "$(parts_of model.)" ]; then
  files=()
  for p in $(parts_of model.); do f=$(part "$p") && files+=("$f") || { files=(); break; }; done
  [ ${#files[@]} -gt 0 ] && cat "${files[@]}" > "$model_file"
fi
[ -f "$model_file" ] && export BURN_KERNELS_MODEL=${BURN_KERNELS_MODEL:-$model_file}

# libdevice: the machine's CUDA toolkit if it has one, else the bundled copy.
if [ -z "${CUDA_PATH:-}" ]; then
  has=""
  for r in /usr/local/cuda /opt/cuda /usr/lib/cuda /usr; do
    [ -f "$r/nvvm/libdevice/libdevice.10.bc" ] && has=$r && break
  done
  export CUDA_PATH=${has:-$dest/cuda}
fi

# NCCL for Burn's all-reduce between GPUs (data-parallel fine-tuning): cudarc loads
# libnccl.so.2 by name, so the directory of a copy (PyTorch's nvidia-nccl wheel) joins the
# loader path when the system has none. Without it the all-reduce copies through the host.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so'; then
  nccl=$(python3 -c 'import nvidia, glob, os; print(next((os.path.dirname(f) for d in nvidia.__path__ for f in glob.glob(d + "/**/libnccl.so*", recursive=True)), ""))' 2>/dev/null)
  [ -n "$nccl" ] && [ -d "$nccl" ] && export LD_LIBRARY_PATH="$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# Peer wheels (pure Python; torch and triton are on the device) install once.
if [ -d "$dest/wheels" ] && [ ! -f "$dest/py/.installed" ] && compgen -G "$dest/wheels/*.whl" > /dev/null; then
  python3 -m pip install --quiet --no-deps --no-index --target "$dest/py" "$dest"/wheels/*.whl \
    && touch "$dest/py/.installed"
fi
[ -d "$dest/py" ] && export PYTHONPATH="$dest/py${PYTHONPATH:+:$PYTHONPATH}"

what=${1:-}; shift || true
case "$what" in
  stash)
    for p in $(parts_of g) $(parts_of model); do
      [ -f "$here/$p" ] && cp "$here/$p" "$stash/$p" && echo "stashed $p"
    done
    ls -la "$stash" ;;
  env)
    echo "dest=$dest commit=$commit CUDA_PATH=$CUDA_PATH XDG_CACHE_HOME=$XDG_CACHE_HOME"
    echo "BURN_KERNELS_MODEL=${BURN_KERNELS_MODEL:-} PYTHONPATH=${PYTHONPATH:-}"
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" ;;
  tests)
    cd "$dest" || exit 3
    status=0
    for t in "$dest"/tests/*; do
      echo "== $(basename "$t")"
      "$t" "$@" || status=1
    done
    exit $status ;;
  test)
    name=${1:?usage: $0 test NAME [libtest args]}; shift
    t=$(ls "$dest"/tests/"$name"-* 2>/dev/null | head -n 1)
    [ -n "$t" ] || { echo "run.sh: no test binary $name in the groups here" >&2; exit 3; }
    cd "$dest" || exit 3
    exec "$t" "$@" ;;
  bench)
    # The peer scripts are in the repository (run.sh lives in its .device folder).
    peers=()
    case " $* " in *" --peers-dir "*) ;; *) peers=(--peers-dir "$here/../bench/peers") ;; esac
    cd "$dest" || exit 3
    exec ${RUN_WRAP:-} "$dest/bin/burn-kernels-bench" "${peers[@]}" "$@" ;;
  bin)
    name=${1:?usage: $0 bin NAME [args]}; shift
    cd "$dest" || exit 3
    exec ${RUN_WRAP:-} "$dest/bin/$name" "$@" ;;
  *) echo "usage: $0 stash|tests|test|bench|bin|env [args]" >&2; exit 2 ;;
esac
