#!/usr/bin/env python3
"""The Python binding's cost over the C++ entry, on the CPU backend.

1. Per-call overhead on a tiny problem (B = H = 1, L = 16, D = 64): the median time of
   flashref.attention(q, k, v) timed in Python, on numpy arrays and (where torch is installed)
   on torch CPU tensors over the same memory, less the median time of the C++ entry
   attention(problem, backend) on the same arrays timed in C++ (flashref._core.entry_seconds);
   and what one call allocates, as tracemalloc sees it.
2. The SPEC §8 CPU grid (B·L = 4096 tokens, Hq·D = 2048, dense and causal): GFLOP/s of the C++
   entry and of flashref.attention, median of repeated runs after a warm-up.
3. With --gpu OURS.json (the JSON of `flashref bench-gpu`, the C++ device entry timed with CUDA
   events): the same grid points through flashref.attention on torch CUDA tensors (same
   shapes, dtype and masks, the block masks regenerated as scripts/bench_gpu_torch.py does),
   timed the same way on the current stream (CUDA events around each call, synchronised: the
   latency a caller sees, the binding's host time included), and the ratio Python / C++; and
   the same calls back to back (events around a run of calls, one synchronisation: the
   throughput of a stream of calls, where the binding's host time overlaps the GPU's work),
   per call against the C++ entry's per-call time.

usage: build/venv/bin/python scripts/bench_python.py [--lengths 512 1024 ...] [--head-dims 64 128]
       [--repeats N] [--calls N] [--backend cpu] [--gpu OURS.json [--seconds S]]
"""

import argparse
import statistics
import time
import tracemalloc

import numpy as np

import flashref
from flashref import _core


def entry(q, k, v, o, lse, causal, backend, repeats):
    return _core.entry_seconds(q, k, v, o, lse, None, causal, -1, -1, None, 0, 0, None, backend,
                               False, repeats)


def python_median(call, repeats):
    call()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) * 1e-9


def tiny(backend, calls):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 16, 64), dtype=np.float32) for _ in range(3))
    o = np.empty((1, 1, 16, 64), np.float32)
    lse = np.empty((1, 1, 16), np.float32)
    print(f"tiny problem B = H = 1, L = 16, D = 64, backend {backend}, medians of {calls} calls")
    kinds = [("numpy", (q, k, v))]
    try:
        import torch

        kinds.append(("torch CPU", tuple(torch.from_numpy(x) for x in (q, k, v))))
    except ImportError:
        pass
    print(f"{'call':<56} {'median_us':>10} {'over C++ us':>12}")
    for return_lse in (False, True):
        c_entry = entry(q, k, v, o, lse if return_lse else None, "none", backend, calls)
        label = "return_lse=True" if return_lse else "O only"
        print(f"{'C++ attention(problem, backend), ' + label:<56} {c_entry * 1e6:10.2f}")
        for kind, (a, b, c) in kinds:
            py = python_median(
                lambda: flashref.attention(a, b, c, backend=backend, return_lse=return_lse),
                calls)
            print(f"{'flashref.attention, ' + kind + ', ' + label:<56} {py * 1e6:10.2f} "
                  f"{(py - c_entry) * 1e6:12.2f}")
    tracemalloc.start()
    flashref.attention(q, k, v, backend=backend, return_lse=True)
    before = tracemalloc.take_snapshot()
    keep = [flashref.attention(q, k, v, backend=backend, return_lse=True) for _ in range(100)]
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    outputs = sum(o.nbytes + lse.nbytes for o, lse in keep)
    print(f"allocated per call and kept (tracemalloc): {grown / len(keep):.0f} bytes, of which "
          f"O and LSE data {outputs / len(keep):.0f} bytes")
    del keep


def grid(backend, lengths, head_dims, repeats, tokens=4096, model=2048):
    print(f"\nSPEC §8 CPU grid: B·L = {tokens}, Hq·D = {model}, backend {backend}, "
          f"medians of {repeats} runs after a warm-up")
    print(f"{'mask':<7} {'B':>3} {'H':>3} {'L':>6} {'D':>4} {'C++ GFLOP/s':>12} "
          f"{'Python GFLOP/s':>15} {'Python/C++':>11}")
    rng = np.random.default_rng(1)
    for D in head_dims:
        H = model // D
        for L in lengths:
            B = tokens // L
            q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(3))
            o = np.empty_like(q)
            for mask, causal in (("dense", None), ("causal", "bottom_right")):
                flops = 4.0 * B * H * L * L * D * (0.5 if causal else 1.0)
                c_entry = entry(q, k, v, o, None, causal or "none", backend, repeats)
                py = python_median(
                    lambda: flashref.attention(q, k, v, causal=causal, backend=backend), repeats)
                print(f"{mask:<7} {B:>3} {H:>3} {L:>6} {D:>4} {flops / c_entry * 1e-9:12.1f} "
                      f"{flops / py * 1e-9:15.1f} {c_entry / py:11.3f}")


def gpu_grid(ours_json, seconds, seed):
    import json
    import os
    import sys

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_gpu_torch import bench_block_mask, fnv1a, time_fn

    with open(ours_json) as f:
        ours = json.load(f)
    dtype_of = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    print(f"\nSPEC §8 GPU grid through torch CUDA tensors (flashref.attention, backend cuda) "
          f"against the C++ device entry ({ours_json})")
    print(f"{'mask':<13} {'B':>3} {'H':>3} {'L':>6} {'D':>4} {'dtype':>9} {'C++ TFLOP/s':>12} "
          f"{'Python TFLOP/s':>15} {'Python/C++':>11} {'back to back':>15} {'Python/C++':>11}")
    ratios, stream_ratios = [], []
    tensors = {}
    for r in ours:
        if r.get("backend") != "cuda" or r["mask"] not in ("dense", "causal", "block_sparse"):
            continue
        B, H, L, D = r["B"], r["Hq"], r["Lq"], r["D"]
        key = (B, H, L, D, r["dtype"])
        if key not in tensors:
            tensors.clear()  # one shape's tensors at a time
            g = torch.Generator(device="cuda").manual_seed(seed)
            mk = lambda: (torch.randint(-128, 128, (B, H, L, D), device="cuda", generator=g)
                          .to(torch.float32) * 2.0**-6).to(dtype_of[r["dtype"]])
            tensors[key] = (mk(), mk(), mk())
        q, k, v = tensors[key]
        kwargs = {"backend": "cuda"}
        if r["mask"] == "causal":
            kwargs["causal"] = "bottom_right"
        elif r["mask"] == "block_sparse":
            mask = bench_block_mask(H, L, r["block"], r["density"], seed)
            if str(fnv1a(mask)) != r["mask_hash"]:
                sys.exit(f"block mask mismatch at L={L} D={D} density={r['density']}")
            kwargs["block_mask"] = torch.from_numpy(mask[None]).to("cuda")
            kwargs["block_size"] = r["block"]
        call = lambda: flashref.attention(q, k, v, **kwargs)  # noqa: E731
        t = time_fn(call, seconds)
        py = r["flops"] / t * 1e-12
        ratios.append(py / r["tflops"])
        streamed = r["flops"] / time_fn(call, seconds, back_to_back=True) * 1e-12
        stream_ratios.append(streamed / r["tflops"])
        label = r["mask"] if r["mask"] != "block_sparse" else f"bs {r['density']:g}"
        print(f"{label:<13} {B:>3} {H:>3} {L:>6} {D:>4} {r['dtype']:>9} {r['tflops']:12.1f} "
              f"{py:15.1f} {py / r['tflops']:11.3f} {streamed:15.1f} "
              f"{streamed / r['tflops']:11.3f}")
    if ratios:
        print(f"Python/C++, each call synchronised: median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)} points")
        print(f"Python/C++, calls back to back: median {statistics.median(stream_ratios):.3f}, "
              f"min {min(stream_ratios):.3f}, max {max(stream_ratios):.3f} over "
              f"{len(stream_ratios)} points")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 1024, 2048, 4096])
    ap.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu", metavar="OURS.json",
                    help="time the GPU grid points of this `flashref bench-gpu --json` file")
    ap.add_argument("--seconds", type=float, default=0.25, help="timing budget per GPU point")
    ap.add_argument("--seed", type=int, default=2024, help="bench-gpu's --seed")
    args = ap.parse_args()
    if args.gpu:
        gpu_grid(args.gpu, args.seconds, args.seed)
        return
    tiny(args.backend, args.calls)
    if args.lengths:
        grid(args.backend, args.lengths, args.head_dims, args.repeats)


if __name__ == "__main__":
    main()
