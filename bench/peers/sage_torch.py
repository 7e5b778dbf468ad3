"""Peers for the `sage` bench suite on the same GPU: PyTorch scaled_dot_product_attention and the
`sageattention` package (its Triton kernels), f16, B=4 H=32, layout [B, H, N, D].
Prints one JSON line: {"times_ms": [...]} or {"error": ...}."""
import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True, choices=["sdpa", "sageattention"])
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--d", type=int, required=True)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    try:
        import torch
        if args.impl == "sdpa":
            fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        else:
            from sageattention import sageattn
            fn = lambda q, k, v: sageattn(q, k, v, tensor_layout="HND", is_causal=args.causal)
    except Exception as e:
        print(json.dumps({"error": f"import failed: {e}"}))
        return
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (4, 32, args.n, args.d)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        for _ in range(3):
            fn(q, k, v)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn(q, k, v)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        print(json.dumps({"times_ms": times}))
    except Exception as e:
        print(json.dumps({"error": str(e)[:300]}))


main()
