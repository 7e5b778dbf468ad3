"""PyTorch peer for the `e2e` bench suite: one fine-tuning step (forward, loss, backward, AdamW)
of a random-weight Hugging Face Llama of the SmolLM2-135M shape, the way a PyTorch user trains
it: f32 master weights, torch.autocast(bfloat16), SDPA attention (flash where it applies),
fused AdamW. Loss: transformers' own (logits upcast to f32), or a fused linear cross-entropy,
Liger's (`--loss liger`) or Apple's cut-cross-entropy (`--loss cce`), applied to the final hidden
states and the tied embedding. Timed on the same GPU in the same run as the Burn candidates.
Prints one JSON line: {"times_ms": [...], "peak_mem_mb": x} or {"error": ...}; peak_mem_mb is
the most memory one step allocates beyond what the model and optimizer hold before it.
"""
import argparse
import json

from peer_util import import_hf_llama, time_calls

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
               tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192)


def loss_fn(args, model, torch, ids):
    """The step's loss function over `ids` ([batch, seq + 1], as the Burn side: every token goes
    through the model, position t is scored against token t + 1)."""
    targets = ids[:, 1:].reshape(-1)

    def hidden():
        h = model.model(input_ids=ids).last_hidden_state[:, :-1]
        return h.reshape(-1, h.shape[-1])

    if args.loss == "hf":
        def run():
            return model(input_ids=ids, labels=ids).loss
        return run
    if args.loss == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss)
        lce = LigerFusedLinearCrossEntropyLoss()

        def run():
            return lce(model.lm_head.weight, hidden(), targets)
        return run
    from cut_cross_entropy import linear_cross_entropy

    # Under autocast the final norm returns the f32 residual stream's dtype; Apple's backward
    # takes 16-bit operands only, so both go in as bf16 (what autocast gives a matmul).
    def run():
        h = hidden().to(torch.bfloat16)
        return linear_cross_entropy(h, model.lm_head.weight.to(torch.bfloat16), targets)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--loss", choices=["hf", "liger", "cce"], default="hf")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-step", action="store_true",
                    help="after the warm-up, run one step between cudaProfilerStart/Stop (for "
                         "`ncu --profile-from-start off`) instead of timing")
    args = ap.parse_args()
    hf = import_hf_llama()
    if hf is None:
        return
    torch, LlamaConfig, LlamaForCausalLM = hf
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = LlamaConfig(**SMOLLM2)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device="cuda")
    try:
        loss = loss_fn(args, model, torch, ids)
    except Exception as e:
        print(json.dumps({"error": f"{args.loss}: {type(e).__name__}: {e}"}))
        return

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if args.profile_step:
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(json.dumps({"profiled": 1}))
        return
    time_calls(torch, step, args.warmup, args.reps)


if __name__ == "__main__":
    main()
