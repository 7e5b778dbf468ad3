"""Host-to-device copy bandwidth on this machine (torch): pinned and pageable sources, one
1 GiB copy and the same bytes in 8 MiB pieces, 5 repetitions each; and a host memcpy of
1 GiB (torch's multi-threaded copy). The floor under ShadowKV's value uploads (issue 34)."""
import time

import torch


def timed(f, reps=5):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2], ts[0]


n = 1 << 30
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
for kind in ["pinned", "pageable"]:
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    if kind == "pinned":
        src = src.pin_memory()
    one = lambda: dev.copy_(src, non_blocking=True)
    piece = 8 << 20

    def pieces():
        for i in range(0, n, piece):
            dev[i : i + piece].copy_(src[i : i + piece], non_blocking=True)

    for name, f in [("one 1 GiB copy", one), ("8 MiB pieces", pieces)]:
        med, best = timed(f)
        print(f"h2d {kind:8} {name:15}: median {n / med / 1e9:6.1f} GB/s (best {n / best / 1e9:6.1f})")
a = torch.randint(0, 255, (n,), dtype=torch.uint8)
b = torch.empty_like(a)
med, best = timed(lambda: b.copy_(a))
print(f"host memcpy 1 GiB ({torch.get_num_threads()} threads): median {n / med / 1e9:6.1f} GB/s (best {n / best / 1e9:6.1f})")
