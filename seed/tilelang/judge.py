#!/usr/bin/env python3
"""tilelang's block-sparse attention example judged by flashref's block-sparse fixtures.

The kernel that started flashref: tilelang's example returns NaN on the rows of a q-block whose
block-mask row is all zero. This driver runs it on the inputs of flashref's fixtures, as
published and with guard.patch (the guard of SPEC §4), and writes each output as a candidate
result file for `flashref check --candidate` (docs/fixtures.md).

  plan    FIXTURES OUT           which fixtures the kernel can take, and why not the others
                                 (numpy only); writes OUT/plan.json
  run     FIXTURES OUT WORK      on a machine with a CUDA GPU and tilelang: every variant on every
                                 fixture it can take -> OUT/<variant>/<case>.h5; OUT/run.json
  emulate FIXTURES OUT           the same candidates from a numpy model of the kernel's loop (no
                                 GPU, no tilelang): a dry run of the whole pipeline
  deps                           every requirement of the installed tilelang is met (exit 2 if not)
  report  OUT                    OUT/verdicts.md from OUT/run.json and the `flashref check --json`
                                 files OUT/<variant>.check.json

Variants:
  published  example_tilelang_block_sparse_attn.py as published; where the fixture's mask needs
             32 x 32 kernel blocks, with block-size.patch (block size an argument, 64 by default)
  guarded    the same with guard.patch: a row whose block max is -inf takes 0 as the exponent's
             stand-in (the example's own commented-out "Check_inf" lines), and a row whose sum is
             0 (no visible key) writes O = 0 instead of 0 / 0

What the kernel can take (it is an example, not a library):
  - float16 only (its dtype is fixed): the fixtures' float16 twins, and the bfloat16 twins when
    their inputs are exactly float16 numbers (checked: then it reads exactly the fixture's
    inputs); float32 cases are judged by float32 tolerances it cannot meet by design;
  - one sequence length, one head count and one head dim for q, k, v (no GQA, Dv = D);
  - square mask blocks equal to its tile (64, or 32 with block-size.patch), and no bound on the
    keys inside a visible block: the driver pads q, k, v with zeros to a multiple of the tile,
    which is exact only where no row sees a tile holding padded keys;
  - no LSE output: O is judged alone (an empty row must still be exactly 0).
Each fixture it cannot take is listed in plan.json with the reason.

tilelang 0.1.15 does not compile the example when the mask's last dimension is a multiple of 8
("Cannot convert type boolx8 to CUDA type", from the vectorised copy of the bool mask row;
tile-ai/tilelang issue 2206; the published example at seq_len 512 hits it too). The driver then passes a mask one block
wider and taller, the extra row and column 0: the kernel reads only the first
ceil(seq_len / block) entries of a row, so the answer is the same.
"""
import argparse
import glob
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = "example_tilelang_block_sparse_attn.py"
KERNEL_BLOCKS = (64, 32)  # the example's tile; 32 with block-size.patch (threads = 2 * block)
VARIANTS = ("published", "guarded")
WHAT = {
    "published": "as published (with block-size.patch where the mask needs 32 x 32 tiles)",
    "guarded": "with guard.patch (SPEC §4), and block-size.patch where needed",
}


def fail(msg):
    print(f"judge.py: {msg}", file=sys.stderr)
    sys.exit(2)


def attr(f, name, default):
    if name not in f.attrs:
        return default
    v = f.attrs[name]
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, np.ndarray):
        v = v.item()
    if isinstance(v, np.generic):
        v = v.item()
    return v


# --- which fixtures the kernel can take (numpy only) ----------------------------------------

def plan_case(path):
    """A runnable plan {case, block, L, ds, mask, ...} or {case, reason} for one fixture."""
    import h5py
    with h5py.File(path, "r") as f:
        case = str(attr(f, "case", os.path.basename(path)[:-3]))
        dtype = str(attr(f, "input_dtype", "float32"))
        causal = str(attr(f, "causal", "none"))
        wl, wr = int(attr(f, "window_left", -1)), int(attr(f, "window_right", -1))
        bq, bk = int(attr(f, "block_q", 0)), int(attr(f, "block_k", 0))
        scale = float(attr(f, "scale", 0.0))
        q, k, v = (f["inputs"][n][...].astype(np.float32) for n in "qkv")
        mask = f["inputs/block_mask"][...].astype(bool) if bq > 0 else None
        has_kv_len = "kv_len" in f["inputs"]
        empty_rows = int(np.isneginf(f["golden/lse"][...]).sum())
    B, Hq, Lq, D = q.shape
    Hk, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    base = {"case": case, "input_dtype": dtype, "shape": [B, Hq, Lq, Lk, D],
            "block_q": bq, "block_k": bk, "empty_rows": empty_rows}

    def refuse(reason):
        return dict(base, reason=reason)

    if dtype == "float32":
        return refuse("a float32 case: the kernel computes in float16 only (its dtype is fixed), "
                      "so it is judged on the case's float16 twin instead")
    if causal != "none" or wl >= 0 or wr >= 0 or has_kv_len:
        return refuse("causal, window or kv_len masks: not the block-sparse path judged here")
    if mask is None:
        return refuse("no block mask")
    if Hq != Hk or D != Dv:
        return refuse(f"Hq = {Hq}, Hk = {Hk}, D = {D}, Dv = {Dv}: the kernel takes one head count "
                      "and one head dim for q, k and v")
    if abs(scale - 1.0 / np.sqrt(D)) > 1e-12 * scale:
        return refuse(f"scale {scale}: the kernel's scale is fixed at 1/sqrt(D)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not np.array_equal(x.astype(np.float16).astype(np.float32), x):
            return refuse(f"{name} is not exactly representable in float16, the kernel's only dtype")
    # Element-level visibility of the fixture (SPEC §2), the mask broadcast over batch and heads.
    i = np.arange(Lq) // bq
    j = np.arange(Lk) // bk
    vis = np.broadcast_to(mask, (B, Hq) + mask.shape[2:])[:, :, i][:, :, :, j]
    why = []
    for blk in KERNEL_BLOCKS:
        n = -(-max(Lq, Lk) // blk)
        L = n * blk
        visp = np.zeros((B, Hq, L, L), bool)
        visp[:, :, :Lq, :Lk] = vis
        real_row = (np.arange(L) < Lq).reshape(1, 1, n, blk, 1, 1)
        tiles = visp.reshape(B, Hq, n, blk, n, blk)
        t_any = (tiles & real_row).any(axis=(3, 5))
        t_all = (tiles | ~real_row).all(axis=(3, 5))
        no_real = ~real_row.any(axis=3).reshape(1, 1, n, 1)
        ok = (t_any == t_all) | no_real
        if ok.all():
            return dict(base, block=blk, L=L, n=n, ds=n + 1 if n % 8 == 0 else n,
                        padded=[L - Lq, L - Lk], kernel_mask=t_any.astype(np.uint8).tolist(),
                        patches=[] if blk == 64 else ["block-size.patch"])
        b, h, r, c = (int(x) for x in np.argwhere(~ok)[0])
        if (c + 1) * blk > Lk and t_any[b, h, r, c]:
            why.append(f"{blk} x {blk} tiles: keys {Lk}..{(c + 1) * blk - 1} would pad a tile that "
                       f"rows see (head {h}, q-tile {r}, k-tile {c}), and the kernel attends to "
                       "every key of a visible tile")
        else:
            why.append(f"{blk} x {blk} tiles: the mask ({bq} x {bk} blocks) varies inside "
                       f"q-tile {r}, k-tile {c} of head {h}")
    return refuse("no kernel tile expresses the mask exactly: " + "; ".join(why))


def plan_all(fixtures):
    paths = sorted(glob.glob(os.path.join(fixtures, "blocksparse_*.h5")))
    if not paths:
        fail(f"FIXTURES: expected blocksparse_*.h5 files in '{fixtures}', found none")
    return [plan_case(p) for p in paths]


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


# --- the kernel's sources: published, and with the patches ----------------------------------

def apply_patch(text, patch):
    """Apply a unified diff of one file to text; every hunk must match exactly."""
    lines = text.split("\n")
    out, pos = [], 0
    hunks = patch.split("\n@@ ")[1:]
    if not hunks:
        raise ValueError("no hunk in the patch")
    for h in hunks:
        body = h.split("\n")[1:]
        if body and body[-1] == "":
            body = body[:-1]
        old = [ln[1:] for ln in body if ln[:1] in (" ", "-")]
        new = [ln[1:] for ln in body if ln[:1] in (" ", "+")]
        for start in range(pos, len(lines) - len(old) + 1):
            if lines[start:start + len(old)] == old:
                break
        else:
            raise ValueError(f"hunk does not match: {h.splitlines()[0]}")
        out += lines[pos:start] + new
        pos = start + len(old)
    return "\n".join(out + lines[pos:])


def sources(src_dir):
    """{(variant, block_size_patched): source text}."""
    base = open(os.path.join(src_dir, EXAMPLE)).read()
    bs = open(os.path.join(src_dir, "block-size.patch")).read()
    guard = open(os.path.join(src_dir, "guard.patch")).read()
    return {("published", False): base,
            ("published", True): apply_patch(base, bs),
            ("guarded", False): apply_patch(base, guard),
            ("guarded", True): apply_patch(apply_patch(base, bs), guard)}


def load_module(path, name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_deps():
    """Every Requires-Dist of the installed tilelang (markers evaluated, no extras) is met."""
    from importlib import metadata
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    try:
        reqs = metadata.requires("tilelang") or []
        have = f"tilelang {metadata.version('tilelang')}"
    except metadata.PackageNotFoundError:
        fail("tilelang is not installed")
    missing = []
    for text in reqs:
        r = Requirement(text)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            v = metadata.version(r.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{r} (not installed)")
            continue
        if r.specifier and not r.specifier.contains(v, prereleases=True):
            missing.append(f"{r} (found {v})")
    if missing:
        fail(f"{have} needs: " + "; ".join(missing))
    print(f"{have}: every requirement met")
    return 0


# --- candidates -----------------------------------------------------------------------------

def fixture_inputs(fixtures, case):
    import h5py
    with h5py.File(os.path.join(fixtures, case + ".h5"), "r") as f:
        return tuple(f["inputs"][n][...].astype(np.float16) for n in "qkv")


def padded(x, L):
    B, H, n, D = x.shape
    y = np.zeros((B, H, L, D), x.dtype)
    y[:, :, :n] = x
    return y


def kernel_mask(p):
    B, H = p["shape"][0], p["shape"][1]
    m = np.zeros((B, H, p["ds"], p["ds"]), bool)
    m[:, :, :p["n"], :p["n"]] = np.array(p["kernel_mask"], bool)
    return m


def write_candidate(out, variant, p, o):
    import h5py
    d = os.path.join(out, variant)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, p["case"] + ".h5")
    with h5py.File(path + ".tmp", "w") as f:
        f["o"] = o  # [B, H, Lq, D] as the kernel wrote it (float16); no /lse: the kernel has none
        f.attrs["case"] = p["case"]
        f.attrs["backend"] = f"tilelang block-sparse example, {WHAT[variant]}"
    os.replace(path + ".tmp", path)
    rows = np.isnan(o).any(axis=-1)
    return {"nan_rows": int(rows.sum()),
            "nan_rows_first": [int(x) for x in np.argwhere(rows)[0]] if rows.any() else None}


def emulate_kernel(q, k, v, mask, blk, guarded):
    """A numpy model of the example's loop (float32 accumulation, P rounded to float16 before
    P V, the block max taken per block as the example does, exp2 with log2(e) folded in)."""
    B, H, L, D = q.shape
    scale = (1.0 / D) ** 0.5 * 1.44269504
    o = np.zeros((B, H, L, D), np.float16)
    qf, kf, vf = (x.astype(np.float32) for x in (q, k, v))
    with np.errstate(all="ignore"):
        for b in range(B):
            for h in range(H):
                for r in range(L // blk):
                    qt = qf[b, h, r * blk:(r + 1) * blk]
                    acc = np.zeros((blk, D), np.float32)
                    logsum = np.zeros(blk, np.float32)
                    smax = np.full(blk, -np.inf, np.float32)
                    for c in range(L // blk):
                        if not mask[b, h, r, c]:
                            continue
                        s = qt @ kf[b, h, c * blk:(c + 1) * blk].T
                        prev, smax = smax, s.max(axis=1)
                        if guarded:
                            smax = np.where(smax == -np.inf, 0, smax).astype(np.float32)
                        sc = np.exp2(prev * scale - smax * scale)
                        pr = np.exp2(s * scale - smax[:, None] * scale)
                        logsum = logsum * sc + pr.sum(axis=1)
                        acc = acc * sc[:, None] + pr.astype(np.float16).astype(np.float32) @ \
                            vf[b, h, c * blk:(c + 1) * blk]
                    res = acc / logsum[:, None]
                    if guarded:
                        res = np.where(logsum[:, None] == 0, 0, res)
                    o[b, h, r * blk:(r + 1) * blk] = res.astype(np.float16)
    return o


def run(args, emulate):
    plans = plan_all(args.fixtures)
    os.makedirs(args.out, exist_ok=True)
    report = {"format": 1, "variants": WHAT, "mode": "emulated (numpy model)" if emulate else "gpu",
              "plans": plans, "runs": []}
    modules = {}
    if not emulate:
        import torch
        import tilelang
        report["environment"] = {
            "tilelang": tilelang.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}
        os.makedirs(args.work, exist_ok=True)
        for (variant, bs), text in sources(HERE).items():
            path = os.path.join(args.work, f"{variant}{'_bs' if bs else ''}.py")
            with open(path, "w") as f:
                f.write(text)
            modules[(variant, bs)] = path
        print(f"tilelang {tilelang.__version__}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name(0)}", flush=True)
    errors = 0
    for p in plans:
        if "reason" in p:
            print(f"{p['case']}: not run: {p['reason']}", flush=True)
            continue
        q, k, v = (padded(x, p["L"]) for x in fixture_inputs(args.fixtures, p["case"]))
        m = kernel_mask(p)
        B, H, Lq, _, D = p["shape"]
        for variant in VARIANTS:
            rec = {"case": p["case"], "variant": variant, "block": p["block"], "ds": p["ds"]}
            t0 = time.time()
            try:
                if emulate:
                    o = emulate_kernel(q, k, v, m, p["block"], variant == "guarded")
                else:
                    bs = p["block"] != 64
                    key = (variant, bs)
                    if isinstance(modules[key], str):  # loaded on first use
                        modules[key] = load_module(modules[key], f"tl_{variant}_{int(bs)}")
                    kw = {"block": p["block"]} if bs else {}
                    kern = modules[key].blocksparse_flashattn(B, H, p["L"], D, p["ds"], False, **kw)
                    rec["compile_s"] = round(time.time() - t0, 1)
                    dev = [torch.from_numpy(x).cuda() for x in (q, k, v)]
                    out = kern(*dev, torch.from_numpy(m).cuda())
                    torch.cuda.synchronize()
                    o = out.cpu().numpy()
                rec.update(write_candidate(args.out, variant, p, np.ascontiguousarray(o[:, :, :Lq])))
                rec["status"] = "ran"
            except Exception as e:  # reported, and the exit status says so
                errors += 1
                rec["status"] = "error"
                rec["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:300]}"
            rec["seconds"] = round(time.time() - t0, 1)
            report["runs"].append(rec)
            print(f"{p['case']} [{variant}, {p['block']} x {p['block']} tiles]: "
                  f"{rec.get('error') or str(rec['nan_rows']) + ' NaN rows'}", flush=True)
    write_json(os.path.join(args.out, "run.json"), report)
    if errors:
        print(f"judge.py: {errors} run(s) failed (see {args.out}/run.json)", file=sys.stderr)
        return 1
    return 0


# --- the verdicts as Markdown ---------------------------------------------------------------

def verdict_text(row):
    if row is None:
        return "not judged"
    if row["verdict"] == "pass":
        return "pass (O only)" if row.get("lse_dtype") in (None, "-", "") or \
            "no /lse" in row.get("message", "") else "pass"
    return "FAIL: " + row["message"].replace("; no /lse: O judged alone", "")


def report(args):
    run_json = os.path.join(args.out, "run.json")
    if not os.path.isfile(run_json):
        fail(f"OUT: expected {run_json} (from `judge.py run` or `emulate`), found none")
    rj = json.load(open(run_json))
    checks = {}
    for variant in VARIANTS:
        path = os.path.join(args.out, f"{variant}.check.json")
        if not os.path.isfile(path):
            fail(f"OUT: expected {path} (flashref check --json), found none")
        checks[variant] = {r["case"]: r for r in json.load(open(path))["rows"]}
    runs = {(r["case"], r["variant"]): r for r in rj["runs"]}
    lines = ["| fixture | kernel tile | empty rows | as published | with guard.patch |",
             "| --- | --- | --- | --- | --- |"]
    for p in rj["plans"]:
        if "reason" in p:
            continue
        cells = []
        for variant in VARIANTS:
            r = runs.get((p["case"], variant))
            if r is None or r["status"] != "ran":
                cells.append("did not run: " + (r["error"] if r else "no run"))
            else:
                cells.append(verdict_text(checks[variant].get(p["case"])))
        tile = f"{p['block']} x {p['block']}" + (" (block-size.patch)" if p["block"] != 64 else "")
        lines.append(f"| `{p['case']}` | {tile} | {p['empty_rows']} | " + " | ".join(cells) + " |")
    lines += ["", "Not run:", ""]
    for p in rj["plans"]:
        if "reason" in p:
            lines.append(f"- `{p['case']}`: {p['reason']}")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "verdicts.md"), "w") as f:
        f.write(md)
    print(md, end="")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("plan", "run", "emulate"):
        s = sub.add_parser(name)
        s.add_argument("fixtures")
        s.add_argument("out")
        if name == "run":
            s.add_argument("work", help="a folder for the kernel variants' sources")
    s = sub.add_parser("report")
    s.add_argument("out")
    sub.add_parser("deps")
    args = ap.parse_args()
    if args.command == "deps":
        return check_deps()
    if args.command in ("plan", "run", "emulate") and not os.path.isdir(args.fixtures):
        fail(f"FIXTURES: expected a folder of fixtures, got '{args.fixtures}'")
    if args.command == "plan":
        os.makedirs(args.out, exist_ok=True)
        plans = plan_all(args.fixtures)
        write_json(os.path.join(args.out, "plan.json"), plans)
        for p in plans:
            print(f"{p['case']}: " + (f"not run: {p['reason']}" if "reason" in p else
                                       f"{p['block']} x {p['block']} tiles, L = {p['L']}, "
                                       f"mask [{p['shape'][0]}, {p['shape'][1]}, {p['ds']}, "
                                       f"{p['ds']}], {p['empty_rows']} empty rows"))
        return 0
    if args.command == "report":
        return report(args)
    return run(args, emulate=args.command == "emulate")


if __name__ == "__main__":
    sys.exit(main())
