"""PyTorch peers for the `cce` bench suite, timed on the same GPU in the same run.

--impl cce    : the `cut-cross-entropy` package (25.1.1, Triton kernels), default options (its
                gradient filter, filter_eps="high": eps(bf16) / 32)
--impl cce-exact : the same package with filter_eps=None: no gradient filter, the exact
                gradient (dE and dC summed in bf16 by its kernels), the peer of burn-cce's default
--impl liger  : `liger-kernel` (0.8.5) LigerFusedLinearCrossEntropyLoss
--impl torch  : plain PyTorch, logits = e @ c.T, cross_entropy on f32 logits

Inputs follow the Rust suite's recipe (not its exact values): bf16, a Zipf log-frequency prior
over a shuffled vocabulary in one hidden dimension, targets drawn from the prior, each token
leaning +10 towards its target, bulk logits ~ N(0, 1.5^2).

--mode loss: forward only (under no_grad); grad: backward only (forward once, untimed, then
backward with retain_graph); both: forward + backward. Peak memory = torch's max allocated
during one call minus what was allocated before it (MB = 1e6 bytes).
Prints one JSON line: {"times_ms": [...], "peak_mem_mb": x} or {"error": ...}.
"""
import argparse
import json
import math

from peer_util import time_calls

SHAPES = {"gemma": (8192, 256000, 2304), "smollm2": (8192, 49152, 576), "tiny": (256, 8192, 128)}


def inputs(torch, n, v, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    rank = torch.randperm(v, device="cuda", generator=g).float() + 1.0
    prior = -torch.log(rank)
    c = torch.randn(v, d, device="cuda", generator=g)
    c[:, 0] = prior
    probs = torch.softmax(prior, 0)
    targets = torch.multinomial(probs, n, replacement=True, generator=g)
    e = torch.randn(n, d, device="cuda", generator=g) * (1.5 / math.sqrt(d - 1))
    e[:, 1:] += (10.0 / (d - 1)) * c[targets, 1:]
    e[:, 0] = 1.0
    return e.bfloat16(), c.bfloat16(), targets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True, choices=["cce", "cce-exact", "liger", "torch"])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--mode", required=True, choices=["loss", "grad", "both"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F

        if args.impl in ("cce", "cce-exact"):
            from cut_cross_entropy import linear_cross_entropy as cce_loss
        elif args.impl == "liger":
            from liger_kernel.transformers.fused_linear_cross_entropy import (
                LigerFusedLinearCrossEntropyLoss,
            )
    except Exception as e:  # a peer is optional: say why it did not run
        print(json.dumps({"error": f"import failed: {e}"}))
        return
    n, v, d = SHAPES[args.shape]
    e0, c0, targets = inputs(torch, n, v, d)
    e = e0.clone().requires_grad_(True)
    c = c0.clone().requires_grad_(True)
    del e0, c0
    if args.impl == "cce":
        def loss_fn():
            return cce_loss(e, c, targets)
    elif args.impl == "cce-exact":
        def loss_fn():
            return cce_loss(e, c, targets, filter_eps=None)
    elif args.impl == "liger":
        lce = LigerFusedLinearCrossEntropyLoss()

        def loss_fn():
            return lce(c, e, targets)
    else:
        def loss_fn():
            return F.cross_entropy((e @ c.T).float(), targets)

    state = {}
    if args.mode == "loss":
        def run():
            with torch.no_grad():
                loss_fn()
    elif args.mode == "both":
        def run():
            e.grad = None
            c.grad = None
            loss_fn().backward()
    else:
        state["loss"] = loss_fn()

        def run():
            e.grad = None
            c.grad = None
            state["loss"].backward(retain_graph=True)

    def drop_grads():
        e.grad = None
        c.grad = None

    time_calls(torch, run, args.warmup, args.reps, reset=drop_grads)


if __name__ == "__main__":
    main()
