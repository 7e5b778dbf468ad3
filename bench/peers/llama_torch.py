"""PyTorch peer for the `llama` bench suite: a random-weight Hugging Face Llama of the same shape,
timed on the same GPU in the same run. Prints one JSON line: {"times_ms": [...]} or {"error": ...}.

prefill: one forward over `--len` tokens (batch `--batch`) plus the last position's logits.
decode: one token per sequence after a cached context of `--len` tokens (the cache is cropped
back to `--len` after every step, as the Burn side truncates its cache).
decode --cuda-graph: the step over transformers' StaticCache captured once in a
torch.cuda.CUDAGraph and replayed. decode --compile: the same step through
torch.compile(mode="reduce-overhead") (Inductor kernels replayed as CUDA graphs). Recent
transformers (5.x) advance a StaticCache by a device-held counter and ignore `cache_position`,
so each replay appends one position: the cache holds `--len` plus every step taken, and the
timed steps attend over `--len` to `--len + warmup + reps` positions.
"""
import argparse
import json
import sys
import time

from peer_util import import_hf_llama

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--phase", required=True, choices=["prefill", "decode"])
    ap.add_argument("--len", type=int, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    hf = import_hf_llama()
    if hf is None:
        return
    torch, LlamaConfig, LlamaForCausalLM = hf
    torch.set_default_dtype(torch.float16)
    cfg = LlamaConfig(**SHAPES[args.shape], rms_norm_eps=1e-5, max_position_embeddings=8192)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.len), device="cuda")
    step = torch.randint(0, cfg.vocab_size, (args.batch, 1), device="cuda")

    with torch.inference_mode():
        if args.cuda_graph or args.compile:
            run = graph_step(model, cfg, ids, step, args)
        elif args.phase == "prefill":
            def run():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
        else:
            past = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values

            def run():
                model(input_ids=step, past_key_values=past, use_cache=True, logits_to_keep=1)
                past.crop(args.len)

        for _ in range(args.warmup):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    import transformers
    print(json.dumps({"times_ms": times, "torch": torch.__version__,
                      "transformers": transformers.__version__}))


def static_cache(cfg, batch, length):
    """transformers' StaticCache; its constructor's arguments changed across versions."""
    import torch
    from transformers import StaticCache
    attempts = [
        dict(config=cfg, max_batch_size=batch, max_cache_len=length, device="cuda", dtype=torch.float16),
        dict(config=cfg, max_cache_len=length),
    ]
    for kwargs in attempts:
        try:
            return StaticCache(**kwargs)
        except TypeError:
            continue
    raise RuntimeError("no StaticCache constructor matched")


def graph_step(model, cfg, ids, step, args):
    """The decode step after `ids` over a static cache, captured in a CUDA graph (or compiled
    with torch.compile's reduce-overhead mode)."""
    import torch
    if args.phase != "decode":
        raise ValueError("--cuda-graph and --compile time the decode step")
    # Room for every step a recent transformers appends (see the module docs).
    cache = static_cache(cfg, args.batch, args.len + 3 + args.warmup + args.reps + 16)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
          cache_position=torch.arange(args.len, device="cuda"))
    pos = torch.tensor([args.len], device="cuda")
    step_fn = model.forward
    if args.compile:
        step_fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def forward():
        return step_fn(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=1,
                       cache_position=pos).logits

    if args.compile:
        for _ in range(3):  # compiles, then records the graph
            forward()
        return forward

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        import traceback
        traceback.print_exc()
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        sys.exit(0)
