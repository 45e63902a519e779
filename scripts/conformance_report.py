#!/usr/bin/env python3
"""The conformance report: other attention implementations judged by flashref's fixtures.

Runs PyTorch's SDPA backends (math, memory-efficient, flash, cuDNN), FlexAttention (eager and
compiled) and PyTorch's CPU SDPA on the inputs of every fixture in testdata/, writes each
output as a candidate result file in the documented layout (/o, and /lse where the
implementation exposes it), judges it with `flashref check --candidate --json`, and writes a
Markdown table (per implementation and case: pass, or how it fails) plus the raw verdicts.

The backward (SPEC §9): on every fixture with /inputs/do, PyTorch autograd through the SDPA
backends (each where it accepts the case) and FlexAttention (eager and compiled) gives
dQ, dK, dV of sum(O * dO); they are written as /dq, /dk, /dv beside /o and judged the same
way, in a second table.

usage: conformance_report.py --flashref BIN --fixtures DIR --out DIR [--markdown FILE]
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import h5py
import numpy as np
import torch
import torch.nn.functional as F


class Unsupported(Exception):
    """The implementation does not accept this case (the reason is reported)."""


def attr(f, name, default):
    if name not in f.attrs:
        return default
    v = f.attrs[name]
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, np.ndarray):
        v = v.item()
    return v


def load_case(path):
    """The inputs and the visibility of every (query, key) pair, per docs/semantics.md."""
    with h5py.File(path, "r") as f:
        q = f["inputs/q"][...].astype(np.float32)
        k = f["inputs/k"][...].astype(np.float32)
        v = f["inputs/v"][...].astype(np.float32)
        B, Hq, Lq, D = q.shape
        Lk = k.shape[2]
        scale = float(attr(f, "scale", 1.0 / np.sqrt(D) if D > 0 else 1.0))
        causal = str(attr(f, "causal", "none"))
        wl, wr = int(attr(f, "window_left", -1)), int(attr(f, "window_right", -1))
        bq, bk = int(attr(f, "block_q", 0)), int(attr(f, "block_k", 0))
        dtype = str(attr(f, "input_dtype", "float32"))
        i = np.arange(Lq)[:, None]
        j = np.arange(Lk)[None, :]
        diag = i + (Lk - Lq)
        vis = np.ones((B, Hq, Lq, Lk), dtype=bool)
        if causal == "bottom_right":
            vis &= j <= diag
        elif causal == "top_left":
            vis &= j <= i
        if wl >= 0:
            vis &= j >= diag - wl
        if wr >= 0:
            vis &= j <= diag + wr
        if bq > 0:
            bm = f["inputs/block_mask"][...].astype(bool)
            vis = vis & bm[:, :, i // bq, j // bk]
        has_kv_len = "inputs/kv_len" in f
        if has_kv_len:
            kv = f["inputs/kv_len"][...].astype(np.int64)
            vis &= j[None, None] < kv[:, None, None, None]
    other_masks = wl >= 0 or wr >= 0 or bq > 0 or has_kv_len
    return dict(q=q, k=k, v=v, vis=vis, scale=scale, causal=causal, dtype=dtype,
                only_causal=causal != "none" and not other_masks,
                unmasked=causal == "none" and not other_masks, B=B, Hq=Hq, Hk=k.shape[1],
                Lq=Lq, Lk=Lk, D=D, Dv=v.shape[3])


def expand_kv(c, t):
    """GQA/MQA for kernels without it: repeat each key/value head for its query heads."""
    rep = c["Hq"] // c["Hk"]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def tensors(c, device, dtype):
    q = torch.from_numpy(c["q"]).to(device=device, dtype=dtype)
    k = torch.from_numpy(c["k"]).to(device=device, dtype=dtype)
    v = torch.from_numpy(c["v"]).to(device=device, dtype=dtype)
    return q, k, v


def half_dtype(c):
    return torch.float16 if c["dtype"] == "float16" else torch.bfloat16


def additive_bias(c, device, dtype):
    """0 where visible, -inf elsewhere, with the last dimension padded for 16-element alignment."""
    lk = c["Lk"]
    pad = (lk + 15) // 16 * 16
    bias = torch.full((c["B"], c["Hq"], c["Lq"], pad), float("-inf"), device=device, dtype=dtype)
    bias[..., :lk].masked_fill_(torch.from_numpy(c["vis"]).to(device), 0.0)
    return bias[..., :lk]


def sdpa_math(c):
    q, k, v = tensors(c, "cuda", torch.float32)
    mask = torch.from_numpy(c["vis"]).cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(q, expand_kv(c, k), expand_kv(c, v), attn_mask=mask,
                                           scale=c["scale"])
    return o, None


def sdpa_efficient(c):
    if c["D"] != c["Dv"] and c["D"] % 8:
        raise Unsupported("head dims")
    q, k, v = tensors(c, "cuda", torch.float32)
    bias = additive_bias(c, "cuda", torch.float32)
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, expand_kv(c, k), expand_kv(c, v), bias, True, 0.0, False, scale=c["scale"])
    return out[0], out[1][:, :, : c["Lq"]]


def causal_flag(c):
    """The flash kernel takes no mask: only unmasked problems, and causal ones PyTorch aligns
    top-left (the same as bottom-right when Lq == Lk)."""
    if c["unmasked"]:
        return False
    if c["only_causal"] and (c["causal"] == "top_left" or c["Lq"] == c["Lk"]):
        return True
    raise Unsupported("the flash backend takes no mask other than top-left causal")


def sdpa_flash(c):
    causal = causal_flag(c)
    q, k, v = tensors(c, "cuda", half_dtype(c))
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, expand_kv(c, k), expand_kv(c, v), 0.0, causal, False, scale=c["scale"])
    return out[0], out[1]


def sdpa_cudnn(c):
    q, k, v = tensors(c, "cuda", half_dtype(c))
    bias = None if c["unmasked"] else additive_bias(c, "cuda", half_dtype(c))
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, expand_kv(c, k), expand_kv(c, v), bias, True, 0.0, False, False, scale=c["scale"])
    return out[0], out[1].reshape(c["B"], c["Hq"], c["Lq"])


_flex_compiled = None


def flex(c, compiled):
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    fn = flex_attention
    if compiled:
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention)
        fn = _flex_compiled
    q, k, v = tensors(c, "cuda", torch.float32)
    vis = torch.from_numpy(c["vis"]).cuda()

    def mask_mod(b, h, q_idx, kv_idx):
        return vis[b, h, q_idx, kv_idx]

    bm = create_block_mask(mask_mod, c["B"], c["Hq"], c["Lq"], c["Lk"], device="cuda",
                           _compile=compiled)
    o, lse = fn(q, k, v, block_mask=bm, scale=c["scale"], enable_gqa=c["Hq"] != c["Hk"],
                return_lse=True)
    return o, lse


def sdpa_cpu(c):
    q, k, v = tensors(c, "cpu", torch.float32)
    bias = None if c["unmasked"] else additive_bias(c, "cpu", torch.float32).contiguous()
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, expand_kv(c, k), expand_kv(c, v), 0.0, False, attn_mask=bias, scale=c["scale"])
    return out[0], out[1]


# ---- the backward: autograd through the public entry points ----------------------------------


def has_backward(path):
    with h5py.File(path, "r") as f:
        return "inputs/do" in f and "golden/dq" in f


def load_do(path):
    with h5py.File(path, "r") as f:
        return f["inputs/do"][...].astype(np.float32)


def leaf_tensors(c, device, dtype):
    q, k, v = tensors(c, device, dtype)
    return [t.detach().requires_grad_(True) for t in (q, k, v)]


def autograd(c, d_o, forward, device, dtype):
    """dQ, dK, dV of sum(O * dO) through `forward(q, k, v) -> O`; GQA by repeat_interleave inside
    the graph, so dK, dV come back summed over each group as SPEC §9 defines them."""
    q, k, v = leaf_tensors(c, device, dtype)
    o = forward(q, expand_kv(c, k), expand_kv(c, v))
    do = torch.from_numpy(d_o).to(device=device, dtype=o.dtype)
    (o * do).sum().backward()
    return o, None, q.grad, k.grad, v.grad


def sdpa_backend_grad(backend_name, precision):
    def run(c, d_o):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, backend_name)
        dtype = torch.float32 if precision == "fp32" else half_dtype(c)
        if backend_name == "FLASH_ATTENTION":
            causal = causal_flag(c)
            mask = None
        else:
            causal = False
            mask = None if c["unmasked"] else torch.from_numpy(c["vis"]).cuda()

        def forward(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                      scale=c["scale"])
        return autograd(c, d_o, forward, "cuda", dtype)
    return run


def flex_grad(compiled):
    def run(c, d_o):
        global _flex_compiled
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        fn = flex_attention
        if compiled:
            if _flex_compiled is None:
                _flex_compiled = torch.compile(flex_attention)
            fn = _flex_compiled
        vis = torch.from_numpy(c["vis"]).cuda()

        def mask_mod(b, h, q_idx, kv_idx):
            return vis[b, h, q_idx, kv_idx]

        bm = create_block_mask(mask_mod, c["B"], c["Hq"], c["Lq"], c["Lk"], device="cuda",
                               _compile=compiled)
        q, k, v = leaf_tensors(c, "cuda", torch.float32)
        o, lse = fn(q, k, v, block_mask=bm, scale=c["scale"], enable_gqa=c["Hq"] != c["Hk"],
                    return_lse=True)
        (o * torch.from_numpy(d_o).cuda()).sum().backward()
        return o, lse, q.grad, k.grad, v.grad
    return run


BWD_IMPLS = [
    ("sdpa-math", "fp32", sdpa_backend_grad("MATH", "fp32"), "autograd, SDPA math backend"),
    ("sdpa-efficient", "fp32", sdpa_backend_grad("EFFICIENT_ATTENTION", "fp32"),
     "autograd, SDPA memory-efficient backend"),
    ("sdpa-flash", "bf16/fp16", sdpa_backend_grad("FLASH_ATTENTION", "half"),
     "autograd, SDPA flash backend (no mask but causal)"),
    ("sdpa-cudnn", "bf16/fp16", sdpa_backend_grad("CUDNN_ATTENTION", "half"),
     "autograd, SDPA cuDNN backend"),
    ("flex-eager", "fp32", flex_grad(False), "autograd, FlexAttention eager"),
    ("flex-compiled", "fp32", flex_grad(True), "autograd, FlexAttention torch.compile"),
]


def classify_backward(row, precision):
    """The gradients' verdict for the table: which tensors were judged and how they fail."""
    if row["verdict"] == "pass":
        return "pass (" + row.get("gradients_judged", "-") + ")"
    msg = row.get("message", "")
    if precision != "fp32" and row["dtype"] == "float32" and "outside tolerance" in msg \
            and "NaN" not in msg and "empty" not in msg and "no row sees" not in msg:
        return f"FAIL: beyond fp32 tolerance (ran in {precision})"
    return "FAIL: " + msg[:160]


IMPLS = [
    ("sdpa-math", "fp32", sdpa_math, "torch SDPA, math backend (CUDA); no LSE exposed"),
    ("sdpa-efficient", "fp32", sdpa_efficient, "torch SDPA, memory-efficient backend (CUDA)"),
    ("sdpa-flash", "bf16/fp16", sdpa_flash, "torch SDPA, flash backend (CUDA)"),
    ("sdpa-cudnn", "bf16/fp16", sdpa_cudnn, "torch SDPA, cuDNN backend (CUDA)"),
    ("flex-eager", "fp32", lambda c: flex(c, False), "FlexAttention, eager"),
    ("sdpa-cpu", "fp32", sdpa_cpu, "torch SDPA, CPU flash kernel"),
    ("flex-compiled", "fp32", lambda c: flex(c, True), "FlexAttention, torch.compile"),
]


def write_candidate(path, o, lse, grads=None):
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        f["o"] = o.detach().float().cpu().numpy()
        if lse is not None:
            f["lse"] = lse.detach().float().cpu().numpy()
        for name, g in zip(("dq", "dk", "dv"), grads or ()):
            if g is not None:
                f[name] = g.detach().float().cpu().numpy()
    os.replace(tmp, path)


def judge(flashref, fixture, cand):
    """flashref check --candidate --json: the verdict row, or an error line."""
    js = cand + ".json"
    proc = subprocess.run([flashref, "check", fixture, "--candidate", cand, "--json", js],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not os.path.exists(js):
        return None, "check error: " + proc.stdout.strip().splitlines()[-1][:90]
    return json.load(open(js))[0], None


def classify(row, precision):
    """A short verdict for the table, from `flashref check --json`."""
    if row["verdict"] == "pass":
        return "pass" + ("" if row["lse_judged"] else " (O only)")
    how = []
    if row["nan_rows"]:
        how.append(f"NaN in {row['nan_rows']} rows")
    if row["empty_rows_bad"]:
        parts = []
        for key, label in (("empty_o_nonzero", "O != 0"), ("empty_lse_posinf", "LSE +inf"),
                           ("empty_lse_zero", "LSE 0"), ("empty_lse_nan", "LSE NaN"),
                           ("empty_lse_finite", "LSE finite")):
            if row[key]:
                parts.append(label)
        how.append(f"{row['empty_rows_bad']}/{row['empty_rows']} empty rows: " + ", ".join(parts))
    if row["bad_elements"]:
        if precision != "fp32" and row["dtype"] == "float32":
            how.append(f"beyond fp32 tolerance (ran in {precision})")
        else:
            how.append(f"error beyond tolerance ({row['bad_elements']} values)")
    return "FAIL: " + "; ".join(how)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flashref", required=True)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--markdown")
    ap.add_argument("--only", nargs="*", help="implementations to run (default: all)")
    ap.add_argument("--budget-s", type=float, default=240, help="stop starting new work after this")
    ap.add_argument("--no-backward", action="store_true", help="skip the autograd table")
    ap.add_argument("--ours", nargs="*", default=[],
                    help="our backends to judge alongside (e.g. cpu cuda), as flashref-<name>")
    args = ap.parse_args()
    start = time.time()
    os.makedirs(os.path.join(args.out, "candidates"), exist_ok=True)
    cases = sorted(p[:-3] for p in os.listdir(args.fixtures) if p.endswith(".h5"))
    results = {}  # impl -> case -> cell
    raw = []
    for name, precision, fn, _ in IMPLS:
        if args.only and name not in args.only:
            continue
        results[name] = {}
        for case in cases:
            if time.time() - start > args.budget_s:
                results[name][case] = "not run (time budget)"
                continue
            c = load_case(os.path.join(args.fixtures, case + ".h5"))
            cand = os.path.join(args.out, "candidates", f"{name}__{case}.h5")
            try:
                o, lse = fn(c)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                write_candidate(cand, o, lse)
            except Unsupported as e:
                results[name][case] = f"unsupported: {e}"
                continue
            except Exception as e:  # the implementation refused the case
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                results[name][case] = f"unsupported: {type(e).__name__}: {msg[:90]}"
                continue
            js = cand + ".json"
            proc = subprocess.run([args.flashref, "check", os.path.join(args.fixtures, case + ".h5"),
                                   "--candidate", cand, "--json", js],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if not os.path.exists(js):
                results[name][case] = "check error: " + proc.stdout.strip().splitlines()[-1][:90]
                continue
            row = json.load(open(js))[0]
            row["implementation"] = name
            raw.append(row)
            results[name][case] = classify(row, precision if c["dtype"] == "float32" else "fp32")
        print(f"{name}: done ({time.time() - start:.0f} s)", flush=True)

    # The backward: autograd through each implementation on the fixtures that carry /inputs/do.
    bwd_results = {}
    if not args.no_backward:
        for name, precision, fn, _ in BWD_IMPLS:
            if args.only and name not in args.only:
                continue
            bwd_results[name] = {}
            for case in cases:
                fixture = os.path.join(args.fixtures, case + ".h5")
                if not has_backward(fixture):
                    continue
                if time.time() - start > args.budget_s:
                    bwd_results[name][case] = "not run (time budget)"
                    continue
                c = load_case(fixture)
                cand = os.path.join(args.out, "candidates", f"bwd__{name}__{case}.h5")
                try:
                    o, lse, dq, dk, dv = fn(c, load_do(fixture))
                    torch.cuda.synchronize()
                    write_candidate(cand, o, lse, (dq, dk, dv))
                except Unsupported as e:
                    bwd_results[name][case] = f"unsupported: {e}"
                    continue
                except Exception as e:
                    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    bwd_results[name][case] = f"unsupported: {type(e).__name__}: {msg[:90]}"
                    continue
                row, err = judge(args.flashref, fixture, cand)
                if err:
                    bwd_results[name][case] = err
                    continue
                row["implementation"] = name + " (backward)"
                raw.append(row)
                bwd_results[name][case] = classify_backward(
                    row, precision if c["dtype"] == "float32" else "fp32")
            print(f"{name} backward: done ({time.time() - start:.0f} s)", flush=True)

    for be in args.ours:  # our own backends, judged by the same rule for comparison
        js = os.path.join(args.out, f"flashref-{be}.json")
        subprocess.run([args.flashref, "check", args.fixtures, "--backend", be, "--json", js],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        col = results.setdefault(f"flashref-{be}", {})
        for row in (json.load(open(js)) if os.path.exists(js) else []):
            row["implementation"] = f"flashref-{be}"
            raw.append(row)
            col[row["case"]] = (classify(row, "fp32") if row["verdict"] != "error"
                                else "unsupported: " + row["message"].split(": ")[-1][:90])

    with open(os.path.join(args.out, "conformance.json"), "w") as f:
        json.dump({"results": results, "backward": bwd_results, "rows": raw}, f, indent=1)

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    lines = [
        "What flashref's golden fixtures say about attention implementations people use. Each",
        "implementation ran on the inputs of every fixture (`testdata/*.h5`); its output was written",
        "as a candidate result file and judged by `flashref check --candidate` with the fixture's",
        "own tolerances (`docs/semantics.md`). This part is generated by",
        "`scripts/conformance-report OUT_DIR` on a machine with an NVIDIA GPU and PyTorch.",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- PyTorch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
        f"{torch.backends.cudnn.version()}, GPU: {gpu}, CPU: {platform.processor() or platform.machine()}",
        "- Half-precision-only kernels (flash, cuDNN) ran in bfloat16 (float16 for the float16",
        "  case) on float32 fixtures: their accuracy there is judged against the float32 tolerance",
        "  and reported as such, but their handling of empty rows and NaN is judged exactly.",
        "- tilelang's block-sparse example: not run. The GPU machine used for this report is",
        "  offline, and tilelang 0.1.15 with the dependencies it needs there (z3-solver,",
        "  apache-tvm-ffi, torch-c-dlpack-ext) is 79 MB of wheels, more than could be copied to it",
        "  for one run. `docs/fixtures.md` shows how to judge it (or any kernel) with the same files.",
        "",
        "| implementation | what |",
        "| --- | --- |",
    ]
    for name, precision, _, what in IMPLS:
        if name in results:
            lines.append(f"| {name} | {what}; inputs {precision} |")
    for be in args.ours:
        lines.append(f"| flashref-{be} | this library's {be} backend, for comparison |")
    lines += ["", "| case | " + " | ".join(results) + " |",
              "| --- |" + " --- |" * len(results)]
    for case in cases:
        lines.append(f"| {case} | " + " | ".join(results[n].get(case, "") for n in results) + " |")
    summary = []
    for n in results:
        cells = list(results[n].values())
        npass = sum(1 for x in cells if x.startswith("pass"))
        nfail = sum(1 for x in cells if x.startswith("FAIL"))
        summary.append(f"- {n}: {npass} pass, {nfail} fail, {len(cells) - npass - nfail} not run or unsupported")
    lines += ["", "Summary:", ""] + summary + [""]
    if bwd_results:
        bwd_cases = sorted({case for col in bwd_results.values() for case in col})
        lines += [
            "### The backward pass (SPEC §9)",
            "",
            "PyTorch autograd of `sum(O * dO)` through each implementation, on every fixture with",
            "`/inputs/do`; dQ, dK, dV written as `/dq, /dk, /dv` and judged by `flashref check`",
            "(each gradient's tolerance, empty rows and keys no row sees exactly 0). GQA/MQA by",
            "`repeat_interleave` inside the graph (FlexAttention: `enable_gqa`), so dK, dV are",
            "summed over each group.",
            "",
            "| implementation | what |",
            "| --- | --- |",
        ]
        for name, precision, _, what in BWD_IMPLS:
            if name in bwd_results:
                lines.append(f"| {name} | {what}; inputs {precision} |")
        lines += ["", "| case | " + " | ".join(bwd_results) + " |",
                  "| --- |" + " --- |" * len(bwd_results)]
        for case in bwd_cases:
            lines.append(f"| {case} | " +
                         " | ".join(bwd_results[n].get(case, "") for n in bwd_results) + " |")
        lines += [""]
        for n in bwd_results:
            cells = list(bwd_results[n].values())
            npass = sum(1 for x in cells if x.startswith("pass"))
            nfail = sum(1 for x in cells if x.startswith("FAIL"))
            lines.append(f"- {n} backward: {npass} pass, {nfail} fail, "
                         f"{len(cells) - npass - nfail} not run or unsupported")
        lines += [""]
    md = "\n".join(lines)
    with open(os.path.join(args.out, "conformance.md"), "w") as f:
        f.write(md)
    if args.markdown:  # replace the generated part of the page, keep the prose around it
        begin, end = "<!-- generated by scripts/conformance-report: begin -->", "<!-- end -->"
        page = open(args.markdown).read() if os.path.exists(args.markdown) else ""
        if begin in page and end in page:
            head, rest = page.split(begin, 1)
            md = head + begin + "\n" + md + "\n" + end + rest.split(end, 1)[1]
        with open(args.markdown + ".tmp", "w") as f:
            f.write(md)
        os.replace(args.markdown + ".tmp", args.markdown)
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
