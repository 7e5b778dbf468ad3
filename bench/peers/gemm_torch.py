"""PyTorch peer for the `gemm` bench suite: torch.matmul on the same GPU in the same run.

--m --n --k: a [m, k] @ [k, n] product (the right side stored [n, k] and transposed with
--rhs-t, the left side stored [k, m] and transposed with --lhs-t); --dtype f32|bf16|f16; --tf32 1 allows TF32 for f32 (torch's
allow_tf32 matmul flag), 0 keeps strict f32; --add adds an [m, n] tensor to the product; --inner N runs the product N times per
timed repetition.
Prints one JSON line: {"times_ms": [...]} or {"error": ...}.
"""
import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--dtype", required=True, choices=["f32", "bf16", "f16"])
    ap.add_argument("--tf32", default="1", choices=["0", "1"])
    ap.add_argument("--rhs-t", action="store_true")
    ap.add_argument("--lhs-t", action="store_true")
    ap.add_argument("--inner", type=int, default=1)
    ap.add_argument("--add", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    try:
        import torch
    except Exception as e:
        print(json.dumps({"error": f"import failed: {e}"}))
        return
    torch.backends.cuda.matmul.allow_tf32 = args.tf32 == "1"
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.lhs_t:
        a = torch.randn(args.k, args.m, device="cuda", generator=g).to(dt).t()
    else:
        a = torch.randn(args.m, args.k, device="cuda", generator=g).to(dt)
    if args.rhs_t:
        b = torch.randn(args.n, args.k, device="cuda", generator=g).to(dt).t()
    else:
        b = torch.randn(args.k, args.n, device="cuda", generator=g).to(dt)
    c = torch.randn(args.m, args.n, device="cuda", generator=g).to(dt) if args.add else None

    def one():
        out = a @ b
        return out + c if c is not None else out

    def call():
        for _ in range(args.inner - 1):
            one()
        return one()

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        del out
    print(json.dumps({"times_ms": times}))


if __name__ == "__main__":
    main()
