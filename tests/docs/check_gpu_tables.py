#!/usr/bin/env python3
"""The GPU tables of docs/benchmarks.md are what scripts/gpu-tables prints from the committed
results of their round: each table it renders from a folder of docs/results/ that holds a GPU
round must appear, line for line, in the document. Likewise the summary of the targets: each
folder that a line `<!-- scripts/targets docs/results/FOLDER -->` of the document names must have
every table of `scripts/targets` on it in the document, below that line.

usage: check_gpu_tables.py SOURCE_DIR [RESULTS_SUBDIR...]   (default: every folder there)
"""

import re

GPU_FILES = ("bench_torch.json", "bench_torch_backward.json", "paired.json", "paired_backward.json")
TARGETS = re.compile(r"^<!-- scripts/targets docs/results/([^ ]+) -->$")

import os
import subprocess
import sys


def tables(text):
    """The markdown tables of `text`, each as its lines."""
    found, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append(current)
            current = []
    if current:
        found.append(current)
    return found


def contains(doc, t, start=0):
    n = len(t)
    return any(doc[i:i + n] == t for i in range(start, len(doc) - n + 1))


def rendered_tables(root, script, folder):
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", script), folder],
                         check=True, capture_output=True, text=True).stdout
    return tables(out)


def check_targets(root, doc):
    """Each folder the document names for scripts/targets: its tables below the naming line."""
    failures = 0
    named = [(i, m.group(1)) for i, line in enumerate(doc) if (m := TARGETS.match(line))]
    if not named:
        print("FAIL docs/benchmarks.md names no folder for scripts/targets "
              "(a line <!-- scripts/targets docs/results/FOLDER -->)")
        return 1
    for at, sub in named:
        rendered = rendered_tables(root, "targets", os.path.join(root, "docs", "results", sub))
        for t in rendered:
            if contains(doc, t, at):
                print(f"ok   {sub}: a target table of {len(t) - 2} rows is in docs/benchmarks.md")
            else:
                print(f"FAIL {sub}: docs/benchmarks.md lacks, below line {at + 1}, the target "
                      f"table that starts\n  {t[2]}")
                failures += 1
    return failures


def main():
    root, subdirs = sys.argv[1], sys.argv[2:]
    if not subdirs:
        results = os.path.join(root, "docs", "results")
        subdirs = sorted(d for d in os.listdir(results) if os.path.isdir(os.path.join(results, d)))
    with open(os.path.join(root, "docs", "benchmarks.md")) as f:
        doc = f.read().splitlines()
    failures = check_targets(root, doc)
    for sub in subdirs:
        folder = os.path.join(root, "docs", "results", sub)
        if not any(os.path.exists(os.path.join(folder, f)) for f in GPU_FILES):
            continue  # not a GPU round (a CPU run for scripts/targets)
        rendered = rendered_tables(root, "gpu-tables", folder)
        if not rendered:
            print(f"FAIL {sub}: gpu-tables printed no table")
            failures += 1
        for t in rendered:
            n = len(t)
            if contains(doc, t):
                print(f"ok   {sub}: a table of {n - 2} rows is in docs/benchmarks.md")
            else:
                print(f"FAIL {sub}: docs/benchmarks.md lacks the table that starts\n  {t[2]}")
                failures += 1
    if failures:
        sys.exit(1)
    print("every GPU table and target table matches its results")


if __name__ == "__main__":
    main()
