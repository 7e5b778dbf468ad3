#!/usr/bin/env bash
# One-time set-up of a fresh Debian/Ubuntu machine for building and testing burn-kernels:
# Mesa's lavapipe (a Vulkan driver on the CPU) so the CubeCL kernels run without a GPU.
set -euo pipefail
pkgs=(mesa-vulkan-drivers libvulkan1 vulkan-tools)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found; install Rust with rustup (https://rustup.rs), 1.92 or newer" >&2
  exit 1
fi
echo "setup: Vulkan devices:"
vulkaninfo --summary 2>/dev/null | grep -E "deviceName|driverName|apiVersion" || true
# The SmolLM2-135M GGUF the llama example and its tests load (skipped when already cached).
cargo xtask fetch-model
# The fine-tuning example's corpus (the works of Shakespeare, 5 MB); the tests do not need it.
cargo xtask fetch-corpus || echo "setup: fetch-corpus failed; the finetune example will say so" >&2
