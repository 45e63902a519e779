#!/usr/bin/env python3
"""PyTorch's attention kernels on the grid points of `flashref bench-gpu`.

Reads the JSON that `flashref bench-gpu --json` wrote and times, on the same shapes, dtype
and masks: SDPA with the flash backend, SDPA with the cuDNN backend (dense and causal: SDPA
has no block-sparse mask) and FlexAttention compiled, with a BlockMask built from the very
block mask flashref used (regenerated here with the same counter-based generator and checked
against flashref's hash). Prints TFLOP/s and the ratio of flashref's figure to each, and
writes the records as JSON.

Records of the backward (`bench-gpu --backward`: "pass": "backward") are matched
by PyTorch's backward through autograd on the same kernels: the forward runs once outside the
timing, then only `torch.autograd.grad(out, (q, k, v), dO, retain_graph=True)` is timed (SDPA
flash, SDPA cuDNN, FlexAttention compiled with the same BlockMask). The FLOPs are flashref's
record's (SPEC §9: 2.5 x the forward's).

usage: bench_gpu_torch.py OURS.json OUT.json [--seconds S]
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

M64 = (1 << 64) - 1


def mix64(z):
    """SplitMix64's finaliser on numpy uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniform(seed, stream, n):
    """flashref::testdata::counter_rng(seed, stream).uniform(i) for i in range(n)."""
    with np.errstate(over="ignore"):
        key = mix64(mix64(np.uint64(seed)) ^ np.uint64((stream * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & M64))
        i = np.arange(n, dtype=np.uint64)
        bits = mix64(key ^ mix64(i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0xD1B54A32D192ED03)))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def bench_block_mask(hq, length, block, density, seed):
    """tools/bench/grid.cpp's block_sparse_mask: (Hq, nb, nb) uint8."""
    nb = (length + block - 1) // block
    u = uniform(seed, length, hq * nb * nb).reshape(hq, nb, nb)
    qb = np.arange(nb).reshape(1, nb, 1)
    return ((qb % 8 != 7) & (u < density)).astype(np.uint8)


def fnv1a(mask):
    h = 0xCBF29CE484222325
    for b in mask.reshape(-1).tobytes():
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


def to_block_mask(mask, block, length):
    """A FlexAttention BlockMask whose visible blocks are all 'full' (no mask_mod needed)."""
    bm = torch.from_numpy(mask).cuda().bool()[None]  # (1, Hq, nb, nb)
    full_num = bm.sum(-1).to(torch.int32)
    order = torch.argsort((~bm).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    partial_num = torch.zeros_like(full_num)
    return BlockMask.from_kv_blocks(partial_num, order.clone(), full_num, order,
                                    BLOCK_SIZE=block, seq_lengths=(length, length))


def causal_mod(b, h, q, kv):
    return kv <= q


def time_fn(fn, seconds, back_to_back=False):
    """Median seconds per call of fn on the current stream, CUDA events around each timed run:
    one call per run (synchronised after each), or with back_to_back five runs of several calls
    each, the events around the whole run (the throughput of a stream of calls)."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    first = start.elapsed_time(stop) * 1e-3
    if back_to_back:
        reps, calls = 5, int(min(100, max(5, seconds / 5 / max(first, 1e-7))))
    else:
        reps, calls = int(min(200, max(5, seconds / max(first, 1e-7)))), 1
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / calls)
    times.sort()
    return times[len(times) // 2]


def write_records(path, records):
    """The records as JSON at path, whole or not at all (through a file beside it)."""
    with open(path + ".tmp", "w") as f:
        json.dump(records, f, indent=1)
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours")
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--back-to-back", action="store_true",
                    help="time streams of calls; records of `flashref bench-gpu --back-to-back` "
                         "are timed so in any case")
    args = ap.parse_args()
    with open(args.ours) as f:
        ours = json.load(f)

    # One compiled kernel per shape and mask kind: lift the recompile limits so that no grid
    # point falls back to the unfused eager path.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    flex = torch.compile(flex_attention, dynamic=False)
    dtype_of = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    records = []
    shapes = {}
    measured = {}  # PyTorch's times per point and pass
    print(f"{'mask':13s} {'pass':18s} {'L':>6s} {'D':>4s} {'vis':>6s} {'ours':>7s} {'flash':>7s} {'cudnn':>7s} "
          f"{'flex':>7s} {'/flash':>7s} {'/cudnn':>7s} {'/flex':>7s}   (TFLOP/s; ours/theirs)")
    for r in ours:
        B, H, L, D = r["B"], r["Hq"], r["Lq"], r["D"]
        key = (B, H, L, D, r["dtype"])
        if key not in shapes:
            shapes.clear()  # one shape's tensors at a time
            g = torch.Generator(device="cuda").manual_seed(args.seed)
            mk = lambda: (torch.randint(-128, 128, (B, H, L, D), device="cuda", generator=g)
                          .to(torch.float32) * 2.0**-6).to(dtype_of[r["dtype"]])
            shapes[key] = (mk(), mk(), mk(), mk())
        q, k, v, d_o = shapes[key]
        out = dict(r)
        backward = r.get("pass") == "backward"
        point = (key, r["mask"], r.get("density"), r.get("block"), backward)
        times = measured.setdefault(point, {})
        scale = 1.0 / math.sqrt(D)
        back_to_back = args.back_to_back or r.get("back_to_back", False)

        def timed(attn):
            """The forward's time, or with a backward record the backward's alone."""
            if not backward:
                return time_fn(lambda: attn(q, k, v), args.seconds, back_to_back)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            o = attn(qg, kg, vg)
            return time_fn(lambda: torch.autograd.grad(o, (qg, kg, vg), d_o, retain_graph=True),
                           args.seconds, back_to_back)

        if not times and r["mask"] in ("dense", "causal"):
            causal = r["mask"] == "causal"
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        times[name] = timed(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal, scale=scale))
                except RuntimeError as e:  # backend unavailable for this shape
                    times[name + "_error"] = str(e).splitlines()[0]
        for name in ("flash", "cudnn"):
            if name + "_error" in times:
                out[name + "_error"] = times[name + "_error"]
        if "flex" not in times:
            if r["mask"] == "causal":
                bm = create_block_mask(causal_mod, None, None, L, L, device="cuda")
            else:
                if r["mask"] == "block_sparse":
                    mask = bench_block_mask(H, L, r["block"], r["density"], args.seed)
                    if str(fnv1a(mask)) != r["mask_hash"]:
                        sys.exit(f"block mask mismatch at L={L} D={D} density={r['density']}: "
                                 f"hash {fnv1a(mask)} != flashref's {r['mask_hash']}")
                else:
                    mask = np.ones((H, (L + 127) // 128, (L + 127) // 128), np.uint8)
                bm = to_block_mask(mask, r["block"] if r["mask"] == "block_sparse" else 128, L)
            times["flex"] = timed(lambda a, b, c: flex(a, b, c, block_mask=bm, scale=scale))
        pass_name = "backward" if backward else "forward"
        line = f"{r['mask']:13s} {pass_name:18s} {L:6d} {D:4d} {r['visible_fraction']:6.3f} {r['tflops']:7.1f}"
        for name in ("flash", "cudnn", "flex"):
            t = times.get(name)
            out[name + "_median_s"] = t
            out[name + "_tflops"] = r["flops"] / t * 1e-12 if t else None
            line += f" {out[name + '_tflops']:7.1f}" if t else f" {'n/a':>7s}"
        for name in ("flash", "cudnn", "flex"):
            t = times.get(name)
            out["ours_over_" + name] = t / r["median_s"] if t else None
            line += f" {t / r['median_s']:7.2f}" if t else f" {'n/a':>7s}"
        print(line, flush=True)
        records.append(out)
    write_records(args.out, records)


if __name__ == "__main__":
    main()
