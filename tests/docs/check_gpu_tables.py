#!/usr/bin/env python3
"""The GPU tables of docs/benchmarks.md are what scripts/gpu-tables prints from the committed
results of their round: each table it renders from a folder of docs/results/ must appear, line
for line, in the document.

usage: check_gpu_tables.py SOURCE_DIR [RESULTS_SUBDIR...]   (default: every folder there)
"""

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


def main():
    root, subdirs = sys.argv[1], sys.argv[2:]
    if not subdirs:
        results = os.path.join(root, "docs", "results")
        subdirs = sorted(d for d in os.listdir(results) if os.path.isdir(os.path.join(results, d)))
    with open(os.path.join(root, "docs", "benchmarks.md")) as f:
        doc = f.read().splitlines()
    failures = 0
    for sub in subdirs:
        folder = os.path.join(root, "docs", "results", sub)
        out = subprocess.run([sys.executable, os.path.join(root, "scripts", "gpu-tables"), folder],
                             check=True, capture_output=True, text=True).stdout
        rendered = tables(out)
        if not rendered:
            print(f"FAIL {sub}: gpu-tables printed no table")
            failures += 1
        for t in rendered:
            n = len(t)
            if any(doc[i:i + n] == t for i in range(len(doc) - n + 1)):
                print(f"ok   {sub}: a table of {n - 2} rows is in docs/benchmarks.md")
            else:
                print(f"FAIL {sub}: docs/benchmarks.md lacks the table that starts\n  {t[2]}")
                failures += 1
    if failures:
        sys.exit(1)
    print("every GPU table matches its results")


if __name__ == "__main__":
    main()
