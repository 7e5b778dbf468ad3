"""What the PyTorch peer scripts share: the optional transformers import and the timing loop.
Each script prints one JSON line: {"times_ms": [...], "peak_mem_mb": x} or {"error": ...}."""
import json
import time


def import_hf_llama(quiet=False):
    """(torch, LlamaConfig, LlamaForCausalLM) with torch's generator seeded to 0, or None after
    printing why they are missing (the peers are optional: the bench shows the reason; `quiet`
    for a process that is not the one reporting)."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:
        if not quiet:
            print(json.dumps({"error": f"import failed: {e}"}))
        return None
    torch.manual_seed(0)
    return torch, LlamaConfig, LlamaForCausalLM


def time_calls(torch, run, warmup, reps, reset=None):
    """Runs `run` `warmup` times, then once for the peak memory it allocates beyond what was
    allocated before it (MB = 1e6 bytes), then `reps` timed times (synchronized); `reset` runs
    after the warm-up (e.g. dropping gradients so they do not count as held). Prints the JSON
    result line, or the error (e.g. out of memory)."""
    try:
        for _ in range(warmup):
            run()
        torch.cuda.synchronize()
        if reset is not None:
            reset()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 1e6
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    except Exception as ex:
        print(json.dumps({"error": f"{type(ex).__name__}: {str(ex)[:200]}"}))
        return
    print(json.dumps({"times_ms": times, "peak_mem_mb": peak}))
