#!/usr/bin/env bash
# Named measurement steps for a GPU machine, over a bundle of `cargo xtask device-build`
# (its run.sh): one device call runs several steps and leaves each step's log under $O.
#   D=.device/sNN O=$OUT/name bash scripts/device-steps.sh STEP...
# The bundle these steps use:
#   CARGO_TARGET_DIR=/work/target-cuda cargo xtask device-build \
#     --only burn-kernels-bench,decode_profile,core,llama_tests,cce_tests,kvcache_tests --dir .device/sNN
# Steps:
#   env      nvidia-smi, the bundle's environment, whether ncu reads counters
#   decode   llama suite, SmolLM2 decode at batch 1, 8, 32: the replayed step against
#            PyTorch's CUDA graph and torch.compile (same run)
#   rpc8     decode_profile at batch 8 with the GEMVs' rows per cube capped at 1, 2 and 4
#            (BURN_KERNELS_GEMV_RPC)
#   decodeall  llama suite, every decode problem: SmolLM2 at batch 1, 8, 32, 128, batch 1 in
#            bf16 and f32 (Burn only), Llama-3.2-1B and Llama-3-8B shapes at batch 1; the
#            replayed step against PyTorch's CUDA graph and torch.compile (same run)
#   dtypes   decode_profile's captured step in f16, bf16 and f32 at batch 1, 8 and 32 (the
#            issue's "bf16 decode >= f32 everywhere")
#   mr32 mr128  decode_profile's captured step at batch 32 / 128 with the projections on the
#            GEMV kernels up to 16 rows (the default) and up to the batch
#            (BURN_KERNELS_GEMV_MAX_ROWS), one and four rows of x per GEMV cube
#   cli      `llama generate --backend cuda` on the real SmolLM2 weights (needs the bundle's
#            `llama` binary and --model parts): a cold process with empty CubeCL caches, two
#            warm ones, then --dtype f32 and f16; time to first token and tok/s from its
#            closing line
#   ncu1 ncu8 ncu32  per-kernel device times of SmolLM2-shape decode steps, eager then captured
#            (2 layers, f16, context 512, decode attention + fused ops), batch 1 / 8, ncu
#   dp1 dp8 dp32  decode_profile's eager and captured step (30 layers, f16, context 512),
#            with the one-launch Q/K/V + RoPE + cache store and without it
#            (BURN_KERNELS_QKV_STORE=0), batch 1 / 8 / 32
#   att1 att8  decode_profile's captured step, batch 1 / 8, over the decode attention's
#            layouts: planes per cube (BURN_KERNELS_DECODE_PLANES 2, 4, 8, 16) with the
#            default split and with one split per KV head (BURN_KERNELS_DECODE_SPLIT=4096:
#            the cube writes the output, no combine launch)
#   stg1 stg8  decode_profile's captured step, batch 1 / 8, with the GEMVs' input rows staged
#            in shared memory (BURN_KERNELS_GEMV_STAGE=1) and not (the default)
#   tkv      kvcache_tests of the decode attention and the quantized read (CUDA; ~6 min:
#            give it TL=8)
#   tskv     kvcache_tests' ShadowKV tests (CUDA and the CPU): the top-k selection kernel, the
#            gathers, decoding against the full cache
#   tllama   llama_tests captured-decode tests (CUDA)
#   tcore    core's CUDA tests of the decode-layer kernels (GEMVs, GEMV-T, Q/K/V + RoPE + store)
#   tgemm    core's CUDA GEMM tests: products against the host (1 and 7 rows: the decode
#            batches that FIXED_MIN_ROWS sends to Burn's matmul), gradients, the Hopper kernel
#   tgraphs  llama_tests' captured-graph tests (graphs::, the ones beside another thread's device
#            work included) three times: the stale-first-output fix on CUDA. One test at a time:
#            CubeCL captures in CUDA's global mode, so a test's capture fails while another
#            test's thread synchronizes (`burn_llama::graph`, "Threads")
#   bspec    specdec suite on the graph path, real weights (needs the --model parts): SD and
#            SpecInfer K = 2 replayed, now with the fused layer ops in the verification step
#   tdet     llama_tests train::cuda::cce_step_is_deterministic
#   bcceb    cce suite, SmolLM2 shape, 256 MiB blocks against Burn's plain loss (with the
#            fused passes, `cce (fused passes)`, in the same run)
#   tcce     every cce_tests test on CUDA (the chunked passes against the reference, the
#            reductions inside the Hopper GEMM with their launches counted, the fused passes)
#   tfused   cce_tests' fused-pass checks on CUDA (ops against the reference, the loss under
#            autodiff; each asserts the fused kernels launched)
#   bccef    cce suite, SmolLM2 shape: the default, the fused passes (with and without the
#            per-tile gradient filter) and Burn's plain loss only, with the PyTorch peers
#   bccefb   bccef without the PyTorch peers (Burn's rows only: under a minute)
#   tgraphs1 tgraphs once, its whole output kept
#   ncucce   ncu on the fused CCE kernels (SmolLM2 shape, loss + gradient, one call): speed of
#            light, compute and memory workload, occupancy, per kernel (forward, dE, dC walks)
#   skv64 skv128  shadowkv suite at 64K / 128K context (Llama-3-8B shape; budgets per card:
#            skv_budgets): ShadowKV against
#            the full cache, each with Burn's attention op and the decode attention kernel, and
#            ShadowKV's step profile (transfer share), then the same ShadowKV cache with the
#            other upload path (pinned staging off: ShadowKvCache::set_pinned_uploads)
#   skv64o skv128o  the ShadowKV rows of skv64 / skv128 with each pinned piece's copy issued as
#            soon as it is gathered (BURN_KERNELS_SHADOWKV_OVERLAP=1); run right after skv64 /
#            skv128 in the same call (the upload varies between machines: 80.6 and 97.0 ms a
#            step at 128K with the same code on two H100s)
#   skv64r skv128r  the ShadowKV rows of skv64 / skv128 reusing whatever chunks the previous step
#            left on the device (BURN_KERNELS_SHADOWKV_REUSE_MIN=0, the behaviour before
#            2026-12-07; the default fetches every chunk below 20% reuse): run right after
#            skv64 / skv128 in the same call
#   skv64h skv128h  the ShadowKV rows of skv64 / skv128 with the host values on transparent huge
#            pages (BURN_KERNELS_SHADOWKV_HUGEPAGES=1; off by default since session 64):
#            run right after skv64 / skv128 in the same call
#   skv64p skv128p  skv64 / skv128 with BURN_KERNELS_SHADOWKV_PINNED=0: the values uploaded
#            without pinned staging first (skv64 / skv128 already time both paths)
#   skv2s    shadowkv suite at 64K with two-stage selection (chunks of 4, 4x candidates:
#            BURN_KERNELS_SHADOWKV_CHUNK / _CANDIDATES), the setting that scored 45.0 against the
#            full cache's 48.3 on the RULER-style table; compare with skv64 in the same call
#   skv2s8   skv2s with 8x candidates (46.7 against 48.3 at 4K: within the issue's 2 points), at
#            SKV_CTX K context (default 64)
#   ncucomp  ncu on the compensated carry's adding product (the persistent kernel and the
#            prefetched one, their second launch) and on `G`'s product (the first Hopper GEMM
#            after the forward's 8), Gemma-2 shape: speed of light, memory, occupancy, stalls,
#            local-memory bytes (register spills)
#   bccegcw  bccegc's Burn rows with the compensated carry's store capped at the wide one
#            (BURN_KERNELS_COMPENSATED_STORE=wide): run beside bccegc to A/B the prefetched store
#   bccegcp  bccegc's Burn rows with the store capped at the prefetched one-tile kernel
#            (BURN_KERNELS_COMPENSATED_STORE=prefetched): beside bccegc, the persistent kernel's A/B
#   thop     every core Hopper GEMM test (products against the host, the adding and compensated
#            stores, the persistent kernel's tile walk)
#   thopcce  cce_tests' Hopper reductions (the loss's reductions inside core's Hopper GEMM)
#   thopo thopcceo  thop and thopcce with the main loop that keeps one MMA group in flight at
#            every stage (BURN_KERNELS_HOPPER_OVERLAP=1, session 65; not yet the default)
#   bccego   bccegc's Burn rows with the default main loop, then all of bccegc's rows (Apple's
#            too) with BURN_KERNELS_HOPPER_OVERLAP=1: the loop's A/B on one machine
#   tpers    core's compensated-store tests (every store at the small cases; the persistent
#            kernel walking several tiles a cube) and cce_tests' Hopper reductions
#   psw      sage's default (INT8 per warp, FP16 P̃·V, causal and not) at N = 1K (D = 64, 128), 4K
#            (D = 128) under CubeCL's profiler: per-kernel device times against the bench's
#            median (what does not scale with the work at short lengths)
#   pskv128  the ShadowKV rows of skv128 under CubeCL's profiler: per-kernel totals (prefill,
#            the timed steps and the profiled step together)
#   pcceg    Gemma-2 CCE loss + gradient with the paper's filter, automatic blocks and all
#            blocks of 256 MiB, under CubeCL's profiler: per-kernel totals (prof_sum)
#   pccege   the exact default at the Gemma-2 shape under CubeCL's profiler: per-kernel totals
#   pccegc   the same for the exact path with dE carried compensated (DeCarry::Compensated)
#   h2d      host-to-device copy bandwidth, pinned and pageable (scripts/h2d-bandwidth.py)
#   bcceg    cce suite, Gemma-2 shape, loss + gradient: the default, 64 and 256 MiB blocks with
#            and without the paper's filter, Burn's plain loss (70 GB budget: it needs ~50) and
#            the PyTorch peers (the fused passes stop at D = 576)
#   bccegf   cce suite, Gemma-2 shape, loss + gradient: the exact default, and the paper's filter
#            at automatic blocks, 256 MiB forward/scoring blocks, all blocks 256 MiB; Burn's plain
#            loss and Apple's CCE
#   bccegc   cce suite, Gemma-2 shape, loss + gradient, the few rows that decide DeCarry::Auto
#            (~90 s): the default (f32 dE carry), the compensated carry, each with and without
#            the paper's filter, dE summed in bf16; Burn's plain loss, Apple's CCE with its
#            filter and without (exact)
#   tsw      sage's Hopper kernel (warpgroup MMA, TMA) against the reference (issue 32): two
#            warpgroups a cube, then one
#   bsw      sage suite at N = 8192 and 16384, D = 128, causal and not: the Hopper kernel's rows
#            beside the mma.sync kernel, Burn's fused attention, PyTorch SDPA and sageattention;
#            then the Hopper rows alone with one warpgroup per cube
#   bsw16k   sage suite at N = 16384, D = 128: the default (tuned) and Hopper kernels (INT8 per warp,
#            FP16 P̃·V), Burn's fused attention (the baseline), PyTorch SDPA and sageattention
#            (~60 s)
#   bswall   sage suite, every N (1K..32K) and D (64, 128), causal and not: the Hopper kernel
#            beside the mma.sync kernel (INT8 per warp, FP16 P̃·V), PyTorch SDPA and
#            sageattention (the sweep that decides `choose`'s default on Hopper)
#   tswp     sage's Hopper kernel with the polynomial exp (BURN_SAGE_WGMMA_EXP=poly): the
#            exp2_poly test, then wgmma_kernel_matches_reference with it
#   bsw16kp  bsw16k with the polynomial exp (run bsw16k in the same call for the libdevice
#            rows)
#   tst      sage's kernel tuner (KernelChoice::Tuned: the default on CUDA) against the reference,
#            and the default kernel's shared and long cases
#   ncusw    ncu on the Hopper sage kernel (one launch, N = 8192, D = 128, non-causal): speed
#            of light, instruction mix, warp stalls, pipe use, local-memory bytes (spills),
#            occupancy (which resource holds it back)
#   tcomp    the compensated store's tests: core's adding Hopper GEMMs (bits of the pair) and
#            cce_tests' Hopper reductions (the carry against the reference; ~2.5 min)
#   bcces    cce suite, SmolLM2 and Gemma-2 shapes, every pass in 16, 32, 64, 128 and 256 MiB
#            blocks: time against peak memory, to choose the automatic blocks
#   tdp      llama_tests data_parallel (two GPUs follow one; needs a 2-GPU machine)
#   bftf     e2e suite, bf16 fine-tuning step at batch 8 × 2048: CCE with the chunked and the
#            fused passes, the plain loss, PyTorch's step (random weights)
#   bftfs    the bf16 fine-tuning step at batch 8 × 1024, 2048 and 4096 tokens: CCE (the
#            default, fused passes), the plain loss, PyTorch's step with its loss, Liger's and
#            Apple's fused linear cross-entropy (random weights)
#   bdp bdp4  e2e-dp suite: the fine-tuning step on 1 GPU and on 2 (4) GPUs, same run
# TL (minutes, default 8) bounds each step.
set -uo pipefail
D=${D:?bundle dir, e.g. .device/s43}
O=${O:?output dir}
TL=${TL:-8}
mkdir -p "$O"
peers=$(cd "$(dirname "$0")/../bench/peers" && pwd)
run() { timeout "$((TL * 60))" bash "$D/run.sh" "$@"; }
step() {
  local name=$1
  shift
  echo "== $name $(date +%T)"
  "$@" >"$O/$name.log" 2>&1
  echo "== $name rc=$? $(date +%T)"
  tail -n 30 "$O/$name.log"
}
prof() {
  RUN_WRAP="ncu --clock-control none --csv --metrics gpu__time_duration.sum" \
    run bin decode_profile --backend cuda --dtype f16 --attention decode --fused-ops \
    --layers 2 --context 512 --check-context 8 --steps 2 --graph --batch "$1"
}
# decode_profile's captured step (30 layers, f16, context 512) at batch $3, once for each
# value in $2 of the environment variable $1.
sweep() {
  local var=$1 batch=$3 v
  for v in $2; do
    echo "-- $var=$v"
    (export "$var=$v"; run bin decode_profile --backend cuda --dtype f16 \
      --attention decode --fused-ops --context 512 --steps 32 --graph --batch "$batch")
  done
}
# `llama generate` on the real weights: cold (empty caches), warm twice, then other dtypes.
cli() {
  local cache=/tmp/cli-cache prompt="Write a short story about a robot who learns to paint."
  rm -rf "$cache"
  for what in cold warm warm f32 f16; do
    local extra=()
    case $what in f32 | f16) extra=(--dtype "$what") ;; esac
    echo "-- $what ${extra[*]}"
    local t0
    t0=$(date +%s%N)
    XDG_CACHE_HOME=$cache run bin llama generate --backend cuda --chat --prompt "$prompt" \
      --max-new-tokens 128 "${extra[@]}"
    echo "wall $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  done
}
# The projections on the GEMVs up to 16 rows and up to $1 (one, then four rows of x a cube).
mr() {
  sweep BURN_KERNELS_GEMV_MAX_ROWS "16 $1" "$1"
  BURN_KERNELS_GEMV_RPC=4 sweep BURN_KERNELS_GEMV_MAX_ROWS "$1" "$1"
}
dtypes() {
  local b d
  for b in 1 8 32; do
    for d in f16 bf16 f32; do
      echo "-- batch $b $d"
      run bin decode_profile --backend cuda --dtype "$d" --attention decode --fused-ops \
        --context 512 --steps 32 --graph --batch "$b" | grep captured
    done
  done
}
tgraphs() {
  local out
  for i in 1 2 3; do
    out=$(run test llama_tests graphs:: --include-ignored --test-threads=1 2>&1)
    echo "-- run $i: rc=$? $(echo "$out" | grep -E '^test result|FAILED$' | tr '\n' ' ')"
    echo "$out" >"$O/tgraphs-$i.log"
  done
}
att() {
  for planes in 2 4 8 16; do
    for split in default 4096; do
      echo "-- BURN_KERNELS_DECODE_PLANES=$planes BURN_KERNELS_DECODE_SPLIT=$split"
      if [ "$split" = default ]; then unset BURN_KERNELS_DECODE_SPLIT; else export BURN_KERNELS_DECODE_SPLIT=$split; fi
      BURN_KERNELS_DECODE_PLANES=$planes run bin decode_profile --backend cuda --dtype f16 \
        --attention decode --fused-ops --context 512 --steps 32 --graph --batch "$1"
    done
  done
  unset BURN_KERNELS_DECODE_SPLIT
}
# Sums a CubeCL profile log ($1: CUBECL_DEBUG_OPTION=profile) by kernel name (the hash
# suffix dropped): total time, launches, mean; the 30 largest totals.
prof_sum() {
  local out
  out=$(awk -F'|' '/^\| *[0-9.]+(ns|µs|ms|s) *\|/ {
      t = $2; gsub(/ /, "", t); v = t + 0
      if (t ~ /ns$/) v /= 1e6; else if (t ~ /µs$/) v /= 1e3; else if (t ~ /ms$/) v += 0; else v *= 1e3
      name = ""; for (i = 3; i <= NF; i++) name = name "|" $i
      sub(/_[0-9a-f]+ *$/, "", name); gsub(/  +/, " ", name)
      if (length(name) > 240) name = substr(name, 1, 160) "…" substr(name, length(name) - 79)
      tot[name] += v; n[name]++; all += v }
    END { printf "total %.3f ms in profiled kernels\n", all
      for (k in tot) printf "%10.3f ms %7d x %9.4f ms %s\n", tot[k], n[k], tot[k] / n[k], k }' "$1")
  grep '^total' <<<"$out"
  grep -v '^total' <<<"$out" | sort -g -r | head -30
}
# Gemma-2 CCE loss + gradient with the paper's filter, one variant a process, under CubeCL's
# profiler: the automatic blocks (1.03x memory) and all blocks of 256 MiB (1.39x, 1.1x Apple's
# speed), to see where the automatic blocks lose their time. Each runs once unprofiled first
# (autotune and compilation out of the profile).
# Sage's default at short lengths under CubeCL's profiler: per-kernel device times of one call
# (after a warm run that fills the autotune cache), against the bench's median of the same
# call: the difference is what the host and the gaps between launches cost.
psw() {
  local n
  for n in "N=1024 D=64" "N=1024 D=128" "N=4096 D=128"; do
    local sel=(--suite sage --filter "$n" --skip-impl reference --skip-impl int4 --skip-impl fp8
      --skip-impl cmma --skip-impl smoothq --skip-impl burn --skip-impl torch
      --skip-impl sageattention --skip-impl wgmma)
    run bench "${sel[@]}" --min-reps 20 --warmup-ms 100 --measure-ms 200 --out "$O/psw-warm" |
      grep -E '^ *N=.*ms'
    rm -f /tmp/cubecl-prof.log
    CUBECL_DEBUG_LOG=/tmp/cubecl-prof.log CUBECL_DEBUG_OPTION=profile \
      run bench "${sel[@]}" --warmup-ms 0 --measure-ms 0 --out "$O/psw" | grep -E '^ *N=.*ms'
    echo "-- profile, $n (every launch of the profiled run)"
    prof_sum /tmp/cubecl-prof.log
  done
}

pcceg() {
  local common=(--skip-impl 'cce$' --skip-impl 'chunked passes' --skip-impl sorting
    --skip-impl autotuned --skip-impl fused --skip-impl 'bf16 dE' --skip-impl 'one f32'
    --skip-impl '(all blocks' --skip-impl plain --skip-impl torch)
  local v
  for v in auto 256; do
    local extra=(--skip-impl "paper's filter,")
    [ "$v" = 256 ] && extra=(--cce-chunk-bytes 256 --skip-impl 'grad filter')
    run bench --suite cce --filter gemma --filter both --warmup-ms 0 --measure-ms 0 \
      "${common[@]}" "${extra[@]}" --out "$O/pcceg-warm" | grep 'gemma.*ms'
    rm -f /tmp/cubecl-prof.log
    CUBECL_DEBUG_LOG=/tmp/cubecl-prof.log CUBECL_DEBUG_OPTION=profile \
      run bench --suite cce --filter gemma --filter both --warmup-ms 0 --measure-ms 0 \
      "${common[@]}" "${extra[@]}" --out "$O/pcceg" | grep 'gemma.*ms'
    echo "-- profile, paper's filter, blocks $v"
    prof_sum /tmp/cubecl-prof.log
    cp /tmp/cubecl-prof.log "$O/pcceg-$v-profile.log"
  done
}
# One set of rows at the Gemma-2 shape under CubeCL's profiler (a warm-up run first, so
# autotune and compilation stay out of the profile): $1 names the output, $2 the profile's
# heading, the rest are the bench's --skip-impl arguments that leave those rows.
prof_gemma() {
  local name=$1 heading=$2
  shift 2
  run bench --suite cce --filter gemma --filter both --warmup-ms 0 --measure-ms 0 \
    "$@" --out "$O/$name-warm" | grep 'gemma.*ms'
  rm -f /tmp/cubecl-prof.log
  CUBECL_DEBUG_LOG=/tmp/cubecl-prof.log CUBECL_DEBUG_OPTION=profile \
    run bench --suite cce --filter gemma --filter both --warmup-ms 0 --measure-ms 0 \
    "$@" --out "$O/$name" | grep 'gemma.*ms'
  echo "-- profile, $heading"
  prof_sum /tmp/cubecl-prof.log
  cp /tmp/cubecl-prof.log "$O/$name-profile.log"
}
# The exact default (no filter, automatic blocks) at the Gemma-2 shape under CubeCL's profiler,
# with the backward's pass times (the bench prints them where it times phases).
pccege() {
  prof_gemma pccege "exact default, automatic blocks" \
    --skip-impl 'cce (' --skip-impl plain --skip-impl torch
}
# The exact path with dE carried compensated (DeCarry::Compensated) under CubeCL's profiler.
pccegc() {
  prof_gemma pccegc "exact, compensated dE carry" --skip-impl 'cce$' --skip-impl 'grad filter' \
    --skip-impl 'chunked passes' --skip-impl sorting --skip-impl autotuned --skip-impl fused \
    --skip-impl 'bf16 dE' --skip-impl 'one f32' --skip-impl 'MiB' --skip-impl '(gemm' \
    --skip-impl plain --skip-impl torch
}
# The shadowkv suite's budgets for this card: SKV_BUDGETS if set, else 120 / 100 GB on a
# card of more than 100 GiB (H200), 72 / 90 GB on an H100 (the machines have 128 GiB of host
# memory). The suite's own defaults (40 GB device) leave the full cache at a small batch.
skv_budgets() {
  if [ -n "${SKV_BUDGETS:-}" ]; then echo "$SKV_BUDGETS"; return; fi
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mib:-0}" -gt 102400 ]; then echo "--max-mem-gb 120 --max-host-mem-gb 100"
  else echo "--max-mem-gb 72 --max-host-mem-gb 90"; fi
}
for s in "$@"; do
  case "$s" in
    env) step env bash -c "nvidia-smi; bash $D/run.sh env; ncu --version | tail -1" ;;
    decode) step decode run bench --suite llama --filter "smollm2-135m decode" \
      --exclude "batch 128" --exclude bf16 --exclude f32 \
      --skip-impl 'burn$' --skip-impl burn-kernels --skip-impl 'pytorch$' \
      --peers-dir "$peers" --out "$O/decode" ;;
    decodeall) step decodeall run bench --suite llama --filter decode \
      --skip-impl 'burn$' --skip-impl burn-kernels --skip-impl 'pytorch$' \
      --peers-dir "$peers" --out "$O/decodeall" ;;
    mr32 | mr128) step "$s" mr "${s#mr}" ;;
    cli) step cli cli ;;
    dtypes) step dtypes dtypes ;;
    ncu32) step ncu32 prof 32 ;;
    ncu1) step ncu1 prof 1 ;;
    ncu8) step ncu8 prof 8 ;;
    dp1 | dp8 | dp32) step "$s" sweep BURN_KERNELS_QKV_STORE "1 0" "${s#dp}" ;;
    rpc8) step rpc8 sweep BURN_KERNELS_GEMV_RPC "1 2 4" 8 ;;
    att1 | att8) step "$s" att "${s#att}" ;;
    stg1 | stg8) step "$s" sweep BURN_KERNELS_GEMV_STAGE "0 1" "${s#stg}" ;;
    tkv) step tkv run test kvcache_tests decode_attention quant_attention unfused ;;
    tskv) step tskv run test kvcache_tests shadowkv ;;
    tllama) step tllama run test llama_tests captured --include-ignored --test-threads=1 ;;
    tgemm) step tgemm run test core gemm ;;
    tcore) step tcore run test core qkv_rope_store norm_projections fused_projections static_cache fused_layer_ops ;;
    tgraphs) step tgraphs tgraphs ;;
    bspec) step bspec run bench --suite specdec --decode-kernels --warmup-ms 0 --measure-ms 0 \
      --spec-drafts 1,2 --out "$O/bspec" ;;
    tdet) step tdet run test llama_tests cce_step_is_deterministic --include-ignored --nocapture ;;
    bcceb) step bcceb run bench --suite cce --filter smollm2 --cce-chunk-bytes 256 \
      --peers-dir "$peers" --out "$O/bcceb" ;;
    tfused) step tfused run test cce_tests fused --include-ignored --nocapture ;;
    tcce) step tcce run test cce_tests --include-ignored ;;
    bccefb) step bccefb run bench --suite cce --filter smollm2 --cce-chunk-bytes 256 \
      --skip-impl 'sorting' --skip-impl "paper's" --skip-impl 'autotuned' --skip-impl 'bf16 dE' \
      --skip-impl 'one f32' --skip-impl torch --out "$O/bccefb" ;;
    ncucce) RUN_WRAP="ncu --clock-control none --kernel-name regex:cce_ --launch-count 8 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats --section WarpStateStats" \
      step ncucce run bench --suite cce --filter smollm2 --filter both --warmup-ms 0 \
      --measure-ms 0 --skip-impl 'cce$' --skip-impl blocks --skip-impl plain \
      --skip-impl sorting --skip-impl filter --skip-impl autotuned --skip-impl 'bf16 dE' \
      --skip-impl 'one f32' --skip-impl torch --out "$O/ncucce" ;;
    tgraphs1) step tgraphs1 run test llama_tests graphs:: --include-ignored --test-threads=1 ;;
    bccef) step bccef run bench --suite cce --filter smollm2 --cce-chunk-bytes 256 \
      --skip-impl 'sorting' --skip-impl "paper's" --skip-impl 'autotuned' --skip-impl 'bf16 dE' \
      --skip-impl 'one f32' --peers-dir "$peers" --out "$O/bccef" ;;
    skv64 | skv128) step "$s" run bench --suite shadowkv --filter "ctx=${s#skv}K" \
      $(skv_budgets) --out "$O/$s" ;;
    skv64o | skv128o) ctx=${s#skv}; BURN_KERNELS_SHADOWKV_OVERLAP=1 \
      step "$s" run bench --suite shadowkv --filter "ctx=${ctx%o}K" --skip-impl full \
      $(skv_budgets) --out "$O/$s" ;;
    skv64r | skv128r) ctx=${s#skv}; BURN_KERNELS_SHADOWKV_REUSE_MIN=0 \
      step "$s" run bench --suite shadowkv --filter "ctx=${ctx%r}K" --skip-impl full \
      $(skv_budgets) --out "$O/$s" ;;
    skv64h | skv128h) ctx=${s#skv}; BURN_KERNELS_SHADOWKV_HUGEPAGES=1 \
      step "$s" run bench --suite shadowkv --filter "ctx=${ctx%h}K" --skip-impl full \
      $(skv_budgets) --out "$O/$s" ;;
    skv64p | skv128p) ctx=${s#skv}; BURN_KERNELS_SHADOWKV_PINNED=0 \
      step "$s" run bench --suite shadowkv --filter "ctx=${ctx%p}K" $(skv_budgets) --out "$O/$s" ;;
    pcceg) step pcceg pcceg ;;
    psw) step psw psw ;;
    pskv128) rm -f /tmp/cubecl-prof.log
      CUBECL_DEBUG_LOG=/tmp/cubecl-prof.log CUBECL_DEBUG_OPTION=profile step pskv128 run bench \
        --suite shadowkv --filter ctx=128K --skip-impl full $(skv_budgets) --out "$O/pskv128"
      prof_sum /tmp/cubecl-prof.log ;;
    pccege) step pccege pccege ;;
    pccegc) step pccegc pccegc ;;
    h2d) step h2d python3 "$(dirname "$0")/h2d-bandwidth.py" ;;
    skv2s8) BURN_KERNELS_SHADOWKV_CHUNK=4 BURN_KERNELS_SHADOWKV_CANDIDATES=8 \
      step skv2s8 run bench --suite shadowkv --filter "ctx=${SKV_CTX:-64}K" $(skv_budgets) \
      --out "$O/skv2s8" ;;
    skv2s) BURN_KERNELS_SHADOWKV_CHUNK=4 BURN_KERNELS_SHADOWKV_CANDIDATES=4 \
      step skv2s run bench --suite shadowkv --filter "ctx=64K" $(skv_budgets) --out "$O/skv2s" ;;
    bcceg) step bcceg run bench --suite cce --filter gemma --filter both --cce-chunk-bytes 64,256 \
      --max-mem-gb 70 \
      --skip-impl 'sorting' --skip-impl 'autotuned' --skip-impl 'bf16 dE' --skip-impl 'one f32' \
      --peers-dir "$peers" --out "$O/bcceg" ;;
    bccegf) step bccegf run bench --suite cce --filter gemma --filter both --cce-chunk-bytes 256 \
      --cce-pass-blocks 256 --max-mem-gb 70 --skip-impl 'chunked passes' \
      --skip-impl sorting --skip-impl autotuned --skip-impl fused --skip-impl 'bf16 dE' \
      --skip-impl 'one f32' --skip-impl '(all blocks' --skip-impl '(pass block' --skip-impl liger \
      --skip-impl pytorch-plain --peers-dir "$peers" --out "$O/bccegf" ;;
    tsw) step tsw run test sage wgmma --include-ignored --nocapture
      BURN_SAGE_WGMMA_WARPGROUPS=1 step tsw1 run test sage wgmma --include-ignored --nocapture ;;
    tswp) step tswp-exp run test sage exp2 --nocapture
      BURN_SAGE_WGMMA_EXP=poly step tswp run test sage wgmma --include-ignored --nocapture ;;
    bsw16kp) BURN_SAGE_WGMMA_EXP=poly step bsw16kp run bench --suite sage --filter "N=16384 D=128" \
        --skip-impl reference --skip-impl int4 --skip-impl fp8 --skip-impl cmma --skip-impl smoothq \
        --min-reps 5 --warmup-ms 100 --measure-ms 300 --peers-dir "$peers" --out "$O/bsw16kp" ;;
    tst) step tst run test sage tuned attention_matches_reference --include-ignored --nocapture ;;
    bsw) for n in 8192 16384; do
        step "bsw$n" run bench --suite sage --filter "N=$n D=128" --skip-impl reference \
          --skip-impl int4 --skip-impl int8-fp8 --skip-impl cmma --min-reps 5 --warmup-ms 200 \
          --measure-ms 500 --peers-dir "$peers" --out "$O/bsw$n"
        # The Hopper kernel with one warpgroup per cube (two cubes an SM).
        BURN_SAGE_WGMMA_WARPGROUPS=1 step "bsw$n-wg1" run bench --suite sage \
          --filter "N=$n D=128" --skip-impl reference --skip-impl int4 --skip-impl fp8 \
          --skip-impl cmma --skip-impl burn --skip-impl torch --skip-impl sageattention \
          --skip-impl 'fp16$' \
          --min-reps 5 --warmup-ms 200 --measure-ms 500 --peers-dir "$peers" --out "$O/bsw$n-wg1"
      done ;;
    bccegc) step bccegc run bench --suite cce --filter gemma --filter both --max-mem-gb 70 \
      --skip-impl 'chunked passes' --skip-impl sorting --skip-impl autotuned --skip-impl fused \
      --skip-impl 'one f32' --skip-impl 'blocks' --skip-impl liger \
      --skip-impl pytorch-plain --peers-dir "$peers" --out "$O/bccegc" ;;
    bccegcp) BURN_KERNELS_COMPENSATED_STORE=prefetched step bccegcp run bench --suite cce \
      --filter gemma --filter both --max-mem-gb 70 --skip-impl 'chunked passes' \
      --skip-impl sorting --skip-impl autotuned --skip-impl fused --skip-impl 'one f32' \
      --skip-impl 'blocks' --skip-impl liger --skip-impl pytorch-plain --skip-impl cut-cross \
      --out "$O/bccegcp" ;;
    thop) step thop run test core hopper --include-ignored ;;
    thopo) BURN_KERNELS_HOPPER_OVERLAP=1 step thopo run test core hopper --include-ignored ;;
    thopcceo) BURN_KERNELS_HOPPER_OVERLAP=1 step thopcceo run test cce_tests hopper_reductions \
      --include-ignored ;;
    bccego) step bccegb run bench --suite cce --filter gemma --filter both --max-mem-gb 70 \
      --skip-impl 'chunked passes' --skip-impl sorting --skip-impl autotuned --skip-impl fused \
      --skip-impl 'one f32' --skip-impl 'blocks' --skip-impl liger --skip-impl pytorch-plain \
      --skip-impl cut-cross --out "$O/bccegb"
      BURN_KERNELS_HOPPER_OVERLAP=1 step bccego run bench --suite cce --filter gemma \
        --filter both --max-mem-gb 70 --skip-impl 'chunked passes' --skip-impl sorting \
        --skip-impl autotuned --skip-impl fused --skip-impl 'one f32' --skip-impl 'blocks' \
        --skip-impl liger --skip-impl pytorch-plain --peers-dir "$peers" --out "$O/bccego" ;;
    thopcce) step thopcce run test cce_tests hopper_reductions --include-ignored ;;
    tpers) step tpers run test core hopper_gemm_add_compensated --include-ignored
      step tpers-cce run test cce_tests hopper_reductions --include-ignored ;;
    bccegcw) BURN_KERNELS_COMPENSATED_STORE=wide step bccegcw run bench --suite cce --filter gemma \
      --filter both --max-mem-gb 70 --skip-impl 'chunked passes' --skip-impl sorting \
      --skip-impl autotuned --skip-impl fused --skip-impl 'one f32' --skip-impl 'blocks' \
      --skip-impl liger --skip-impl pytorch-plain --skip-impl cut-cross --out "$O/bccegcw" ;;
    bsw16k) step bsw16k run bench --suite sage --filter "N=16384 D=128" --skip-impl reference \
      --skip-impl int4 --skip-impl fp8 --skip-impl cmma --skip-impl smoothq \
      --min-reps 5 --warmup-ms 100 --measure-ms 300 --peers-dir "$peers" --out "$O/bsw16k" ;;
    bswall) step bswall run bench --suite sage --skip-impl reference --skip-impl int4 \
      --skip-impl fp8 --skip-impl cmma --skip-impl burn --skip-impl smoothq --min-reps 5 \
      --warmup-ms 100 --measure-ms 300 --peers-dir "$peers" --out "$O/bswall" ;;
    ncucomp) for k in compensated_persistent:1:persistent compensated_prefetched:1:prefetched \
        hopper_gemm:8:persistent; do
        name=${k%%:*} rest=${k#*:}
        BURN_KERNELS_COMPENSATED_STORE=${rest#*:} \
        RUN_WRAP="ncu --clock-control none --kernel-name regex:$name --launch-skip ${rest%%:*} \
          --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
          --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
          --section WarpStateStats --section SchedulerStats \
          --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,\
l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum" \
          step "ncucomp-$name" run bench --suite cce --filter gemma --filter both \
          --warmup-ms 0 --measure-ms 0 --skip-impl 'cce$' --skip-impl 'grad filter' \
          --skip-impl 'chunked passes' --skip-impl sorting --skip-impl autotuned \
          --skip-impl fused --skip-impl 'bf16 dE' --skip-impl 'one f32' --skip-impl 'MiB' \
          --skip-impl '(gemm' --skip-impl plain --skip-impl torch --out "$O/ncucomp"
      done ;;
    ncusw) RUN_WRAP="ncu --clock-control none --kernel-name regex:attn_wgmma --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,\
l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,\
regex:sm__inst_executed_pipe_.*\\.avg\\.pct_of_peak_sustained_active" \
      step ncusw run bench --suite sage --filter "N=8192 D=128" --skip-impl reference \
      --skip-impl int4 --skip-impl fp8 --skip-impl cmma --skip-impl burn --skip-impl torch \
      --skip-impl sageattention --skip-impl 'fp16$' --skip-impl smoothq --warmup-ms 0 \
      --measure-ms 0 --out "$O/ncusw" ;;
    tcomp) step tcomp run test core hopper_gemm_add --include-ignored
      step tcomp-cce run test cce_tests hopper_reductions --include-ignored ;;
    bcces) step bcces run bench --suite cce --cce-chunk-bytes 16,32,64,128,256 \
      --peers-dir "$peers" --out "$O/bcces" ;;
    tdp) step tdp run test llama_tests data_parallel --include-ignored --nocapture ;;
    bftf) step bftf run bench --suite e2e --filter "train step" --seq 2048 --batches 8 \
      --skip-impl 'cce$' --skip-impl 'cce + recompute attn$' --skip-impl 'plain loss$' \
      --skip-impl 'fused attn' --skip-impl 'one f32' --skip-impl 'MiB blocks' \
      --skip-impl automatic --skip-impl cubek --skip-impl liger --skip-impl apple \
      --peers-dir "$peers" --out "$O/bftf" ;;
    bftfs) for seq in 1024 2048 4096; do
        step "bftf$seq" run bench --suite e2e --filter "train step" --seq "$seq" --batches 8 \
          --skip-impl 'cce$' --skip-impl 'cce + recompute attn$' --skip-impl 'plain loss$' \
          --skip-impl 'fused attn' --skip-impl 'fused passes' --skip-impl 'one f32' \
          --skip-impl 'MiB blocks' --skip-impl automatic --skip-impl cubek \
          --peers-dir "$peers" --out "$O/bftf$seq"
      done ;;
    bdp) step bdp run bench --suite e2e-dp --devices 0,1 --out "$O/bdp" ;;
    bdp4) step bdp4 run bench --suite e2e-dp --devices 0,1,2,3 --out "$O/bdp4" ;;
    *) echo "unknown step $s" ;;
  esac
done
