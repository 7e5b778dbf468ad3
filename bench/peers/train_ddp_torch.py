"""PyTorch peer for the `e2e-dp` bench suite: the fine-tuning step of `train_torch.py` (a
random-weight Hugging Face Llama of the SmolLM2-135M shape, f32 master weights,
torch.autocast(bfloat16), SDPA attention, fused AdamW, transformers' own loss) data-parallel over
the GPUs `--devices` with DistributedDataParallel over NCCL: one process per GPU, each on
`--batch` sequences (the per-GPU batch). One GPU runs the same step without DDP.

A timed step is synchronized on every GPU (a barrier before it, every device synchronized after
it); rank 0 prints one JSON line: {"times_ms": [...], "peak_mem_mb": x} (rank 0's memory) or
{"error": ...}.
"""
import argparse
import json
import os
import time

from peer_util import import_hf_llama
from train_torch import SMOLLM2


def worker(rank, args, devices, port):
    hf = import_hf_llama(quiet=rank != 0)
    if hf is None:
        return
    torch, LlamaConfig, LlamaForCausalLM = hf
    import torch.distributed as dist

    world = len(devices)
    torch.cuda.set_device(devices[rank])
    device = torch.device("cuda", devices[rank])
    if world > 1:
        # A rank that fails leaves the others in a collective: they time out instead of hanging.
        from datetime import timedelta
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=180))
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = LlamaConfig(**SMOLLM2)
    cfg._attn_implementation = "sdpa"
    with device:
        model = LlamaForCausalLM(cfg).train()
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[devices[rank]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    generator = torch.Generator(device=device).manual_seed(rank)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device,
                        generator=generator)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def synced():
        torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    try:
        for _ in range(args.warmup):
            step()
        synced()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        synced()
        peak = (torch.cuda.max_memory_allocated() - before) / 1e6
        times = []
        for _ in range(args.reps):
            synced()
            t0 = time.perf_counter()
            step()
            synced()
            times.append((time.perf_counter() - t0) * 1e3)
        result = {"times_ms": times, "peak_mem_mb": peak}
    except Exception as ex:
        result = {"error": f"rank {rank}: {type(ex).__name__}: {str(ex)[:200]}"}
    if rank == 0:
        print(json.dumps(result), flush=True)
    if world > 1:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, required=True, help="sequences per GPU")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--devices", default="0", help="GPU indices, e.g. 0,1")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--port", type=int, default=29517)
    args = ap.parse_args()
    devices = [int(d) for d in args.devices.split(",")]
    if len(devices) == 1:
        worker(0, args, devices, args.port)
        return
    try:
        import torch.multiprocessing as mp
    except Exception as e:
        print(json.dumps({"error": f"import failed: {e}"}))
        return
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    mp.spawn(worker, args=(args, devices, args.port), nprocs=len(devices), join=True)


if __name__ == "__main__":
    main()
