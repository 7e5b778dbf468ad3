#!/usr/bin/env bash
# One-time set-up of a fresh Debian/Ubuntu machine for building and testing burn-kernels:
# - Mesa's lavapipe (a Vulkan driver on the CPU), so the CubeCL kernels run without a GPU;
# - Debian's LLVM 22, laid out in the project's cache (`.cache/xdg`, which `.cargo/config.toml`
#   points `XDG_DATA_HOME` at) for CubeCL's CUDA compiler, so `--features cuda` builds offline;
# - the SmolLM2-135M weights and the fine-tuning corpus.
# It says what is missing and stops when it cannot install it.
set -euo pipefail
cd "$(dirname "$0")/.."

# A cold build of the workspace's tests fills about 25 GB; a warm target directory already
# holds most of that, so only the difference (at least 5 GB) must be free.
need_gb=25
target="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p "$target"
free_gb=$(df -Pk "$target" | awk 'NR == 2 { print int($4 / 1048576) }')
held_gb=$(du -sk "$target" | awk '{ print int($1 / 1048576) }')
want_gb=$((need_gb - held_gb > 5 ? need_gb - held_gb : 5))
if ((free_gb < want_gb)); then
  echo "setup: $free_gb GB free under $target (which holds $held_gb GB); a build needs about $need_gb GB in all, so $want_gb GB more" >&2
  exit 1
fi

pkgs=(mesa-vulkan-drivers libvulkan1 vulkan-tools llvm-22-dev libzstd-dev zlib1g-dev g++)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "setup: installing ${missing[*]}"
  if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
    echo "setup: could not install ${missing[*]} with apt-get; install them and run again" >&2
    exit 1
  fi
fi
if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found; install Rust with rustup (https://rustup.rs), 1.92 or newer" >&2
  exit 1
fi

./scripts/setup-llvm-prefix.sh "$PWD/.cache/xdg"

echo "setup: Vulkan devices:"
vulkaninfo --summary 2>/dev/null | grep -E "deviceName|driverName|apiVersion" || true
# The SmolLM2-135M GGUF the llama example and its tests load (skipped when already cached).
cargo xtask fetch-model
# The fine-tuning example's corpus (the works of Shakespeare, 5 MB); the tests do not need it.
cargo xtask fetch-corpus || echo "setup: fetch-corpus failed; the finetune example will say so" >&2
