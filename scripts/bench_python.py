#!/usr/bin/env python3
"""The Python binding's cost over the C++ entry, on the CPU backend.

1. Per-call overhead on a tiny problem (B = H = 1, L = 16, D = 64): the median time of
   flashref.attention(q, k, v) timed in Python, less the median time of the C++ entry
   attention(problem, backend) on the same arrays timed in C++ (flashref._core.entry_seconds);
   and what one call allocates, as tracemalloc sees it.
2. The SPEC §8 CPU grid (B·L = 4096 tokens, Hq·D = 2048, dense and causal): GFLOP/s of the C++
   entry and of flashref.attention, median of repeated runs after a warm-up.

usage: build/venv/bin/python scripts/bench_python.py [--lengths 512 1024 ...] [--head-dims 64 128]
       [--repeats N] [--calls N] [--backend cpu]
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
    print(f"{'call':<46} {'median_us':>10} {'over C++ us':>12}")
    for return_lse in (False, True):
        c_entry = entry(q, k, v, o, lse if return_lse else None, "none", backend, calls)
        py = python_median(
            lambda: flashref.attention(q, k, v, backend=backend, return_lse=return_lse), calls)
        label = "return_lse=True" if return_lse else "O only"
        print(f"{'C++ attention(problem, backend), ' + label:<46} {c_entry * 1e6:10.2f}")
        print(f"{'flashref.attention, ' + label:<46} {py * 1e6:10.2f} {(py - c_entry) * 1e6:12.2f}")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 1024, 2048, 4096])
    ap.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tiny(args.backend, args.calls)
    if args.lengths:
        grid(args.backend, args.lengths, args.head_dims, args.repeats)


if __name__ == "__main__":
    main()
