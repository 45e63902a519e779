#!/usr/bin/env python3
"""flashref's CUDA backend and PyTorch's SDPA kernels timed in turns, in one process.

The round's comparison (scripts/gpu-round: `flashref bench-gpu`, then scripts/bench_gpu_torch.py)
times each side in its own process, minutes apart, so that a ratio near 1 moves with the
card's clocks between the two (0.95-1.05 for one kernel across invocations). Here both run on
the same tensors in one process, in rounds: each round times every kernel once, in an order
that rotates from round to round, and the ratio is taken round by round. The table gives each
kernel's median time and the median, lowest and highest of the per-round ratios (theirs /
ours: above 1, flashref is faster).

flashref runs through its Python package (flashref.attention and flashref.attention_backward on
torch CUDA tensors, on the current stream), SDPA with the cuDNN and flash backends (dense and
causal), FlexAttention compiled (block-sparse masks; with --flex dense and causal too, BlockMasks
as the round builds them); the backward of PyTorch's kernels through autograd on the forward's
graph, as the round times it. flashref's backward is timed in its default, deterministic mode
and with deterministic=False. Each time is the median of five runs of back-to-back calls between
two CUDA events (the throughput of a stream of calls: the host's part of a call overlaps the
kernels before it, on both sides); with --single-calls, of single calls synchronised after each,
as the round times them (the host's part of each call then counts). Each kernel's host part
(the median time a call keeps the host, started on an idle GPU) is printed and kept too.

Shapes as the round's grid: B = tokens / L, Hq = Hk = model / D, bfloat16 inputs drawn as the
round draws them; dense, causal (top-left: Lq = Lk) and the round's block masks (128 x 128
blocks, every eighth query block row empty). Before timing, flashref's O is checked against
cuDNN's (FlexAttention's under a block mask, on rows that see a key), and with --backward its
gradients too: a layout mistake would time the wrong problem.

usage: bench_gpu_paired.py OUT.json [--lengths 1024 16384] [--head-dims 64 128]
       [--masks dense causal block_sparse] [--densities 0.5 0.2 0.05] [--flex] [--backward]
       [--rounds 5] [--seconds 0.2] [--single-calls]
"""

import argparse
import contextlib
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flashref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_torch import (  # noqa: E402  (the round's timing, masks and output)
    bench_block_mask, causal_mod, time_fn, to_block_mask, write_records)

SDPA = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))
_flex = None  # FlexAttention compiled once, on first use


def compiled_flex():
    global _flex
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


def backend_context(backend):
    """SDPA held to one backend, or nothing for kernels that are not SDPA's."""
    return sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()


def agree(name, ours, theirs, against, tol):
    """Exit if flashref's result and the baseline's differ by more than tol anywhere."""
    err = (ours.float() - theirs.float()).abs().max().item()
    if not math.isfinite(err) or err > tol:
        sys.exit(f"bench_gpu_paired: {name}: expected flashref within {tol} of {against}, "
                 f"got a largest difference of {err}")
    return err


def point(B, H, L, D, mask, density, backward, flex, args):
    """One grid point: every kernel's per-round times and the checks' largest differences, and
    the point's visible (query, key) pairs over all heads of one batch."""
    g = torch.Generator(device="cuda").manual_seed(args.seed)

    def draw():  # as scripts/bench_gpu_torch.py draws them: exact in bfloat16
        return (torch.randint(-128, 128, (B, H, L, D), device="cuda", generator=g)
                .to(torch.float32) * 2.0**-6).to(torch.bfloat16)

    q, k, v, d_o = draw(), draw(), draw(), draw()
    scale = 1.0 / math.sqrt(D)
    causal = mask == "causal"
    ours_args = {"scale": scale, "causal": "top_left" if causal else None, "backend": "cuda"}
    rows = torch.ones(1, H, L, 1, device="cuda")  # rows with a visible key
    if mask == "block_sparse":
        blocks = bench_block_mask(H, L, 128, density, args.seed)  # as the round's
        ours_args.update(block_mask=torch.from_numpy(blocks)[None].cuda(), block_size=128)
        visible = int(blocks.sum()) * 128 * 128  # L % 128 == 0
        rows = (torch.from_numpy(blocks.any(-1)).cuda().repeat_interleave(128, -1)[:, :L]
                .reshape(1, H, L, 1).float())
    else:
        visible = H * L * (L + 1) // 2 if causal else H * L * L

    sdpa = {}  # SDPA's kernels, where SDPA takes the mask
    if mask != "block_sparse":
        for name, backend in SDPA:
            sdpa[name] = (lambda a, b, c: F.scaled_dot_product_attention(
                a, b, c, is_causal=causal, scale=scale), backend)
    if flex or mask == "block_sparse":
        if mask == "block_sparse":
            flex_mask = to_block_mask(blocks, 128, L)
        elif causal:
            flex_mask = create_block_mask(causal_mod, None, None, L, L, device="cuda")
        else:
            nb = (L + 127) // 128
            flex_mask = to_block_mask(np.ones((H, nb, nb), np.uint8), 128, L)
        sdpa["flex"] = (lambda a, b, c: compiled_flex()(a, b, c, block_mask=flex_mask,
                                                        scale=scale), None)
    against = "cudnn" if "cudnn" in sdpa else "flex"

    def run(name, a, b, c):
        attn, backend = sdpa[name]
        with backend_context(backend):
            return attn(a, b, c)

    kernels, checks = {}, {}
    o, lse = flashref.attention(q, k, v, return_lse=True, **ours_args)
    checks["o"] = agree("O", o * rows, run(against, q, k, v) * rows, against, 0.03)
    if not backward:
        kernels["flashref"] = (lambda: flashref.attention(q, k, v, **ours_args), None)
        for name, (attn, backend) in sdpa.items():
            kernels[name] = ((lambda attn=attn: attn(q, k, v)), backend)
    else:
        for name, det in (("flashref", True), ("flashref_nondet", False)):
            kernels[name] = ((lambda det=det: flashref.attention_backward(
                q, k, v, o, lse, d_o, deterministic=det, **ours_args)), None)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        for name in sdpa:
            out = run(name, qg, kg, vg)  # the graph records the kernel's own backward
            kernels[name] = ((lambda out=out: torch.autograd.grad(out, (qg, kg, vg), d_o,
                                                                   retain_graph=True)), None)
        grads = flashref.attention_backward(q, k, v, o, lse, d_o, **ours_args)
        theirs = kernels[against][0]()  # the timed call itself: its graph is kept
        for name, a, b in zip(("dq", "dk", "dv"), grads, theirs):
            # dK, dV sum over every query row and grow with L: compared relative to their size.
            keep = rows if name == "dq" else 1.0
            size = b.float().abs().max()
            checks[name] = agree(name, a * keep / size, b * keep / size, against, 0.03)
    times = {name: [] for name in kernels}
    names = list(kernels)
    for r in range(args.rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            fn, backend = kernels[name]
            with backend_context(backend):
                times[name].append(time_fn(fn, args.seconds, back_to_back=not args.single_calls))
    host = {}
    for name, (fn, backend) in kernels.items():
        with backend_context(backend):
            host[name] = host_seconds(fn)
    return times, host, checks, visible


def host_seconds(fn, calls=21):
    """The median time a call keeps the host, from an idle GPU (as a single call starts): the
    part of a single call's time that a stream of calls overlaps with the kernels before it."""
    spent = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(spent)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--masks", nargs="+", default=["dense", "causal"],
                    choices=["dense", "causal", "block_sparse"])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.2, 0.05],
                    help="of the block-sparse masks (128 x 128 blocks, as the round's)")
    ap.add_argument("--flex", action="store_true",
                    help="FlexAttention (compiled) at dense and causal points too")
    ap.add_argument("--backward", action="store_true", help="time the backward instead")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--single-calls", action="store_true",
                    help="time single calls, each synchronised, instead of streams of calls")
    ap.add_argument("--seconds", type=float, default=0.2, help="per timing of one kernel")
    ap.add_argument("--tokens", type=int, default=16384, help="B * L")
    ap.add_argument("--model", type=int, default=2048, help="Hq * D")
    ap.add_argument("--seed", type=int, default=2024)
    args = ap.parse_args()
    if args.rounds < 1:
        sys.exit(f"bench_gpu_paired: --rounds: expected at least 1, got {args.rounds}")
    # One compiled FlexAttention per shape and mask: no fallback to the unfused eager path.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    records = []
    pass_name = "backward" if args.backward else "forward"
    device = torch.cuda.get_device_name()
    calls = "single calls" if args.single_calls else "streams of calls"
    print(f"{device}, torch {torch.__version__}, {pass_name}, bf16, {args.rounds} rounds, {calls}")
    print(f"{'D':>4s} {'L':>6s} {'mask':18s} {'kernel':16s} {'ms':>8s} {'TFLOP/s':>8s} "
          f"{'host µs':>8s} {'theirs/ours median [min, max] over rounds':>42s}")
    points = [(m, None) for m in args.masks if m != "block_sparse"]
    if "block_sparse" in args.masks:
        points += [("block_sparse", d) for d in args.densities]
    for D in args.head_dims:
        for L in args.lengths:
            for mask, density in points:
                B, H = args.tokens // L, args.model // D
                if B < 1 or H < 1 or (mask == "block_sparse" and L % 128):
                    sys.exit(f"bench_gpu_paired: expected L <= {args.tokens}, D <= {args.model} "
                             f"(and L a multiple of 128 for block masks), got L = {L}, D = {D}")
                times, host, checks, visible = point(B, H, L, D, mask, density,
                                                     args.backward, args.flex, args)
                flops = 4.0 * B * visible * D * (2.5 if args.backward else 1.0)
                label = f"{mask} {density:g}" if density is not None else mask
                ours = times["flashref"]
                rec = {"pass": pass_name, "B": B, "Hq": H, "L": L, "D": D, "mask": mask,
                       "density": density, "visible_fraction": visible / (H * L * L),
                       "flops": flops, "rounds": args.rounds, "device": device,
                       "back_to_back": not args.single_calls,
                       "checks": checks, "kernels": {}}
                for name, ts in times.items():
                    med = statistics.median(ts)
                    entry = {"times_s": ts, "median_s": med, "tflops": flops / med * 1e-12,
                             "host_s": host[name]}
                    line = (f"{D:4d} {L:6d} {label:18s} {name:16s} {med * 1e3:8.3f} "
                            f"{entry['tflops']:8.1f} {host[name] * 1e6:8.1f}")
                    if name != "flashref":
                        ratios = [t / o for t, o in zip(ts, ours)]
                        entry["theirs_over_ours"] = ratios
                        entry["ratio_median"] = statistics.median(ratios)
                        line += (f"   {entry['ratio_median']:.3f} [{min(ratios):.3f}, "
                                 f"{max(ratios):.3f}]")
                    rec["kernels"][name] = entry
                    print(line, flush=True)
                records.append(rec)
    write_records(args.out, records)


if __name__ == "__main__":
    main()
