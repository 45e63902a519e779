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
torch CUDA tensors, on the current stream), SDPA with the cuDNN and flash backends; the backward
of SDPA through autograd on the forward's graph, as the round times it. flashref's backward is
timed in its default, deterministic mode and with deterministic=False. Each time is the median
of five runs of back-to-back calls between two CUDA events (the throughput of a stream of
calls: the host's part of a call overlaps the kernels before it, on both sides).

Shapes as the round's grid: B = tokens / L, Hq = Hk = model / D, bfloat16 inputs drawn as the
round draws them; dense and causal (top-left: Lq = Lk). Before timing, flashref's O is checked
against cuDNN's (and its gradients against cuDNN's): a layout mistake would time the wrong
problem.

usage: bench_gpu_paired.py OUT.json [--lengths 1024 16384] [--head-dims 64 128]
       [--masks dense causal] [--backward] [--rounds 5] [--seconds 0.2]
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_torch import time_fn  # noqa: E402  (the round's timing, back to back here)

SDPA = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))


def agree(name, ours, theirs, tol):
    """Exit if flashref's result and the baseline's differ by more than tol anywhere."""
    err = (ours.float() - theirs.float()).abs().max().item()
    if not math.isfinite(err) or err > tol:
        sys.exit(f"bench_gpu_paired: {name}: expected flashref within {tol} of cuDNN, "
                 f"got a largest difference of {err}")
    return err


def point(B, H, L, D, causal, backward, rounds, seconds, seed):
    """One grid point: every kernel's per-round times and the checks' largest differences."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw():  # as scripts/bench_gpu_torch.py draws them: exact in bfloat16
        return (torch.randint(-128, 128, (B, H, L, D), device="cuda", generator=g)
                .to(torch.float32) * 2.0**-6).to(torch.bfloat16)

    q, k, v, d_o = draw(), draw(), draw(), draw()
    scale = 1.0 / math.sqrt(D)
    mode = "top_left" if causal else None

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal, scale=scale)

    kernels = {}
    checks = {}
    o, lse = flashref.attention(q, k, v, scale=scale, causal=mode, backend="cuda",
                                return_lse=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = sdpa(q, k, v)
    checks["o"] = agree("O", o, ref, 0.03)
    if not backward:
        kernels["flashref"] = lambda: flashref.attention(q, k, v, scale=scale, causal=mode,
                                                          backend="cuda")
        for name, backend in SDPA:
            kernels[name] = (lambda: sdpa(q, k, v), backend)  # timed inside sdpa_kernel(backend)
    else:
        def ours(deterministic):
            return lambda: flashref.attention_backward(q, k, v, o, lse, d_o, scale=scale,
                                                       causal=mode, backend="cuda",
                                                       deterministic=deterministic)
        kernels["flashref"] = ours(True)
        kernels["flashref_nondet"] = ours(False)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        for name, backend in SDPA:
            with sdpa_kernel(backend):
                out = sdpa(qg, kg, vg)
            kernels[name] = (lambda out=out: torch.autograd.grad(out, (qg, kg, vg), d_o,
                                                                  retain_graph=True))
        grads = flashref.attention_backward(q, k, v, o, lse, d_o, scale=scale, causal=mode,
                                            backend="cuda")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            theirs = torch.autograd.grad(sdpa(qg, kg, vg), (qg, kg, vg), d_o)
        for name, a, b in zip(("dq", "dk", "dv"), grads, theirs):
            # The gradients grow with L (dK, dV sum over every query row): relative to their size.
            checks[name] = agree(name, a / b.float().abs().max(), b / b.float().abs().max(), 0.03)
    times = {name: [] for name in kernels}
    names = list(kernels)
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            fn, backend = kernels[name] if isinstance(kernels[name], tuple) else (kernels[name], None)
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                times[name].append(time_fn(fn, seconds, back_to_back=True))
    return times, checks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--masks", nargs="+", default=["dense", "causal"], choices=["dense", "causal"])
    ap.add_argument("--backward", action="store_true", help="time the backward instead")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.2, help="per timing of one kernel")
    ap.add_argument("--tokens", type=int, default=16384, help="B * L")
    ap.add_argument("--model", type=int, default=2048, help="Hq * D")
    ap.add_argument("--seed", type=int, default=2024)
    args = ap.parse_args()
    if args.rounds < 1:
        sys.exit(f"bench_gpu_paired: --rounds: expected at least 1, got {args.rounds}")
    records = []
    pass_name = "backward" if args.backward else "forward"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {pass_name}, bf16, "
          f"{args.rounds} rounds")
    print(f"{'D':>4s} {'L':>6s} {'mask':7s} {'kernel':16s} {'ms':>8s} {'TFLOP/s':>8s} "
          f"{'theirs/ours median [min, max] over rounds':>42s}")
    for D in args.head_dims:
        for L in args.lengths:
            for mask in args.masks:
                B, H, causal = args.tokens // L, args.model // D, mask == "causal"
                if B < 1 or H < 1:
                    sys.exit(f"bench_gpu_paired: expected L <= {args.tokens} and D <= "
                             f"{args.model}, got L = {L}, D = {D}")
                pairs = L * (L + 1) // 2 if causal else L * L
                flops = 4.0 * B * H * pairs * D * (2.5 if args.backward else 1.0)
                times, checks = point(B, H, L, D, causal, args.backward, args.rounds,
                                      args.seconds, args.seed)
                ours = times["flashref"]
                rec = {"pass": pass_name, "B": B, "Hq": H, "L": L, "D": D, "mask": mask,
                       "flops": flops, "rounds": args.rounds, "checks": checks, "kernels": {}}
                for name, ts in times.items():
                    med = statistics.median(ts)
                    entry = {"times_s": ts, "median_s": med, "tflops": flops / med * 1e-12}
                    line = f"{D:4d} {L:6d} {mask:7s} {name:16s} {med * 1e3:8.3f} {entry['tflops']:8.1f}"
                    if name != "flashref":
                        ratios = [t / o for t, o in zip(ts, ours)]
                        entry["theirs_over_ours"] = ratios
                        entry["ratio_median"] = statistics.median(ratios)
                        line += (f"   {entry['ratio_median']:.3f} [{min(ratios):.3f}, "
                                 f"{max(ratios):.3f}]")
                    rec["kernels"][name] = entry
                    print(line, flush=True)
                records.append(rec)
    with open(args.out + ".tmp", "w") as f:
        json.dump(records, f, indent=1)
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
