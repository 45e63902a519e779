"""scripts/conformance_report.py, the part that needs no GPU: the verdict cells it derives from
real `flashref check --json` rows (candidates built here, as the CLI tests build theirs), the
placement of the half-precision twins under their float32 case, a rendering that is a pure
function of the JSON, and — once docs/conformance.json is committed — that docs/conformance.md
is its rendering. Exit status 77 (skipped) when this python3 lacks h5py or numpy.

usage: test_conformance_report.py --script PY --flashref BIN --testdata DIR --docs DIR --work DIR
"""
import argparse
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    for name in ("--script", "--flashref", "--testdata", "--docs", "--work"):
        ap.add_argument(name, required=True)
    args = ap.parse_args()
    try:
        import h5py
        import numpy as np
    except ImportError as e:
        print(f"SKIPPED: {sys.executable} cannot import h5py and numpy ({e})")
        return 77
    spec = importlib.util.spec_from_file_location("conformance_report", args.script)
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    fixture = lambda case: os.path.join(args.testdata, case + ".h5")  # noqa: E731

    def reference(case):
        path = os.path.join(args.work, case + ".h5")
        subprocess.run([args.flashref, "run", "--backend", "reference", "--problem",
                        fixture(case), "--out", path], check=True, stdout=subprocess.DEVNULL)
        with h5py.File(path, "r") as f:
            return f["o"][()], f["lse"][()]

    def candidate(name, o, lse):
        path = os.path.join(args.work, name + ".h5")
        with h5py.File(path, "w") as f:
            f["o"] = o
            if lse is not None:
                f["lse"] = lse
        return path

    def judged(impl, case, family, path):
        row, error = cr.check(args.flashref, fixture(case), "--candidate", path)
        assert error is None, error
        return {"implementation": impl, "fixture": case, "family": family, "status": "judged",
                "check": row}

    o, lse = reference("causal_lq_gt_lk")
    fa2 = np.where(np.isneginf(lse), np.inf, lse).astype(np.float32)
    o_gqa, lse_gqa = reference("gqa")
    o_ext, lse_ext = reference("extreme_scores")
    base2 = (lse_ext.astype(np.float64) / np.log(2.0)).astype(np.float32)
    o_tw, lse_tw = reference("causal_lq_gt_lk_bf16")
    o_hb, lse_hb = reference("half_inputs_bf16")
    o_hf, lse_hf = reference("half_inputs_fp16")
    cells = [
        judged("k32", "causal_lq_gt_lk", "causal_lq_gt_lk", candidate("fa2", o, fa2)),
        judged("k32", "gqa", "gqa", candidate("o_only", o_gqa, None)),
        judged("k32", "extreme_scores", "extreme_scores", candidate("base2", o_ext, base2)),
        judged("k32", "half_inputs_bf16", "half_inputs_bf16", candidate("hb32", o_hb, lse_hb)),
        judged("k32", "half_inputs_fp16", "half_inputs_fp16", candidate("hf32", o_hf, lse_hf)),
        judged("k16", "causal_lq_gt_lk_bf16", "causal_lq_gt_lk", candidate("tw", o_tw, lse_tw)),
        judged("k16", "half_inputs_bf16", "half_inputs", candidate("hb", o_hb, lse_hb)),
        {"implementation": "k16", "fixture": "gqa_bf16", "family": "gqa",
         "status": "unsupported", "reason": "head dims"},
        {"implementation": "k16", "fixture": "gqa_mqa_bf16", "family": "gqa_mqa",
         "status": "not run", "reason": "time budget"},
    ]
    report = {"format": cr.FORMAT,
              "environment": {"date": "2026-01-01", "torch": "T", "cuda": "C", "cudnn": 1,
                              "gpu": "G", "cpu": "x86_64"},
              "implementations": [{"name": "k32", "dtype": "float32", "what": "a kernel"},
                                  {"name": "k16", "dtype": "bfloat16", "what": "a kernel"}],
              "cells": cells}

    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    text = {c["fixture"] + "/" + c["implementation"]: cr.cell_text(c) for c in cells}
    expect(text["causal_lq_gt_lk/k32"] == "FAIL: 32/32 empty rows: LSE +inf", text)
    expect(text["gqa/k32"] == "pass (O only)", text)
    expect("the LSE looks like base 2" in text["extreme_scores/k32"], text)
    expect(text["causal_lq_gt_lk_bf16/k16"] == "pass", text)
    expect(text["gqa_bf16/k16"] == "unsupported: head dims", text)
    expect(text["gqa_mqa_bf16/k16"] == "not run (time budget)", text)

    md = cr.render(report)
    expect(md == cr.render(copy.deepcopy(json.loads(json.dumps(report)))),
           "the rendering is not a function of the JSON")
    full = md.split("### Float32 implementations")[1].split("### Half-precision")[0]
    half = md.split("### Half-precision implementations")[1].split("Summary:")[0]
    expect("| causal_lq_gt_lk | FAIL: 32/32 empty rows: LSE +inf |" in full, full)
    expect("| half_inputs_bf16 | pass |" in full and "| half_inputs_fp16 | pass |" in full, full)
    expect("| causal_lq_gt_lk | pass |" in half, half)  # the twin, under its float32 case
    expect("| half_inputs | pass |" in half and "| gqa | unsupported: head dims |" in half, half)
    expect("causal_lq_gt_lk_bf16" not in half, half)
    expect("- k32: 3 pass, 2 fail, 0 not run or unsupported" in md, md)
    expect("- k16: 2 pass, 0 fail, 2 not run or unsupported" in md, md)
    expect("- date: 2026-01-01" in md, md)

    # flashref's own backends in the backward table: judged by `flashref check --backend` on
    # the fixtures with /inputs/do, the forward table's cell reused where it has the backend,
    # listed only where check judged gradients (cuda: unavailable here, so never).
    cases = ["bwd_empty_row_in_tile", "causal_lq_gt_lk", "extreme_scores"]
    infos = {c: cr.fixture_info(fixture(c)) for c in cases}
    fwd_cpu = cr.judge_ours(args.flashref, args.testdata, infos, "cpu", "float32",
                            ["causal_lq_gt_lk"])[1]
    bwd_impls, bwd_cells = cr.ours_backward(
        args.flashref, args.testdata, infos, ["reference", "cpu", "cuda", "cpu"],
        lambda dtype: cases if dtype == "float32" else [], fwd_cpu)
    expect([i["name"] for i in bwd_impls] == ["flashref-reference", "flashref-cpu"], bwd_impls)
    expect(all(i["dtype"] == "float32" and "backward" in i["what"] for i in bwd_impls), bwd_impls)
    expect([(c["implementation"], c["fixture"]) for c in bwd_cells] ==
           [(n, f) for n in ("flashref-reference", "flashref-cpu")
            for f in ("bwd_empty_row_in_tile", "causal_lq_gt_lk")], bwd_cells)
    expect(fwd_cpu[0] in bwd_cells, "the forward table's cell of flashref-cpu was not reused")
    texts = [cr.backward_cell_text(c) for c in bwd_cells]
    expect(texts == ["pass (dq,dk,dv)"] * 4, texts)
    broken = copy.deepcopy(bwd_cells[0])
    broken["check"].update(verdict="fail", message="dq: 3 empty rows with a NaN gradient")
    expect(cr.backward_cell_text(broken) == "FAIL (dq,dk,dv): dq: 3 empty rows with a NaN gradient",
           cr.backward_cell_text(broken))
    with_bwd = copy.deepcopy(report)
    with_bwd["backward"] = {"implementations": [{"name": "b32", "dtype": "float32",
                                                 "what": "autograd"}] + bwd_impls,
                            "cells": bwd_cells + [dict(broken, implementation="b32")]}
    md_bwd = cr.render(with_bwd)
    bwd = md_bwd.split("### The backward pass")[1].split("Summary:")[0]
    expect("| case | b32 | flashref-reference | flashref-cpu |" in bwd, bwd)
    expect("| bwd_empty_row_in_tile | FAIL (dq,dk,dv): dq: 3 empty rows with a NaN gradient | "
           "pass (dq,dk,dv) | pass (dq,dk,dv) |" in bwd, bwd)
    expect("flashref's own backends that have a backward" in bwd, bwd)
    expect("flashref's own backends" not in md, "the sentence without flashref rows")
    expect("- flashref-reference backward: 2 pass, 0 fail, 0 not run or unsupported" in md_bwd,
           md_bwd)
    expect("- b32 backward: 0 pass, 1 fail, 0 not run or unsupported" in md_bwd, md_bwd)

    # render --markdown keeps the prose around the generated part; --check compares.
    js = os.path.join(args.work, "conformance.json")
    page = os.path.join(args.work, "page.md")
    with open(js, "w") as f:
        json.dump(report, f)
    with open(page, "w") as f:
        f.write("# prose before\n\n" + cr.BEGIN + "\nold\n" + cr.END + "\n\nprose after\n")
    script = [sys.executable, args.script]
    subprocess.run(script + ["render", js, "--markdown", page], check=True,
                   stdout=subprocess.DEVNULL)
    written = open(page).read()
    expect(written.startswith("# prose before\n\n") and written.endswith("\n\nprose after\n"),
           written)
    expect(cr.generated_part(written) == md, "render --markdown did not write the rendering")
    ok = subprocess.run(script + ["render", js, "--check", page], stdout=subprocess.DEVNULL)
    expect(ok.returncode == 0, "render --check refuses its own page")
    with open(page, "w") as f:
        f.write(written.replace("| pass |", "| PASS |", 1))
    bad = subprocess.run(script + ["render", js, "--check", page], stdout=subprocess.DEVNULL)
    expect(bad.returncode == 1, "render --check accepts an edited table")

    # The committed page is the rendering of the committed measurements.
    committed = os.path.join(args.docs, "conformance.json")
    if os.path.exists(committed):
        r = subprocess.run(script + ["render", committed, "--check",
                                     os.path.join(args.docs, "conformance.md")])
        expect(r.returncode == 0, "docs/conformance.md is not the rendering of its JSON")

    for f in failures:
        print("FAILED:", f)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
