"""Peers for the `sage` bench suite on the same GPU: PyTorch scaled_dot_product_attention and the
`sageattention` package (its Triton kernels), f16, B=4 H=32, layout [B, H, N, D].

One configuration: --impl sdpa|sageattention --n N --d D [--causal]; prints one JSON line
{"times_ms": [...]} or {"error": ...}.
Many in one process (torch is imported and Triton compiles once): --batch IMPL:N:D:CAUSAL,...
(CAUSAL 0 or 1); prints one JSON line {"results": {"IMPL:N:D:CAUSAL": {"times_ms": [...]} or
{"error": ...}, ...}}."""
import argparse
import json
import time


def attention_fn(torch, impl, causal):
    if impl == "sdpa":
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if impl == "sageattention":
        from sageattention import sageattn
        return lambda q, k, v: sageattn(q, k, v, tensor_layout="HND", is_causal=causal)
    raise ValueError(f"unknown impl {impl}")


def time_one(torch, impl, n, d, causal, reps):
    try:
        fn = attention_fn(torch, impl, causal)
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (4, 32, n, d)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        for _ in range(3):
            fn(q, k, v)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(q, k, v)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        del q, k, v
        torch.cuda.empty_cache()
        return {"times_ms": times}
    except Exception as e:
        return {"error": str(e)[:300]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["sdpa", "sageattention"])
    ap.add_argument("--n", type=int)
    ap.add_argument("--d", type=int)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--batch", help="IMPL:N:D:CAUSAL,... timed in this one process")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    try:
        import torch
    except Exception as e:
        print(json.dumps({"error": f"import failed: {e}"}))
        return
    if args.batch:
        results = {}
        for key in args.batch.split(","):
            impl, n, d, causal = key.split(":")
            results[key] = time_one(torch, impl, int(n), int(d), causal == "1", args.reps)
        print(json.dumps({"results": results}))
    elif args.impl and args.n and args.d:
        print(json.dumps(time_one(torch, args.impl, args.n, args.d, args.causal, args.reps)))
    else:
        print(json.dumps({"error": "give --batch, or --impl, --n and --d"}))


main()
