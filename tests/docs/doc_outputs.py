#!/usr/bin/env python3
"""Keeps the command outputs shown in docs/*.md equal to what the tool prints.

Every fenced block that starts with ```console and whose first line is `$ flashref ...` holds
that command and its exact output. `--check` runs each command and fails on any difference;
`--update` rewrites the blocks in place. Blocks fenced as ```text are not checked (timings).
Figures the commands write under docs/figures/ are compared byte for byte as well: `--check`
runs the commands in a scratch folder and leaves the source tree untouched.

usage: doc_outputs.py (--check | --update) FLASHREF_BINARY DOC.md [DOC.md ...]
"""
import os
import re
import shlex
import subprocess
import sys
import tempfile

BLOCK = re.compile(r"```console\n\$ (flashref[^\n]*)\n(.*?)```", re.S)


def run(binary, command, cwd):
    argv = shlex.split(command)
    argv[0] = binary
    proc = subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    return proc.stdout


def main():
    if len(sys.argv) < 4 or sys.argv[1] not in ("--check", "--update"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    mode, binary, docs = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3:]
    failures = 0
    scratch = tempfile.TemporaryDirectory()
    for doc in docs:
        root = os.path.dirname(os.path.dirname(os.path.abspath(doc)))
        cwd = root
        if mode == "--check":
            cwd = scratch.name
            os.makedirs(os.path.join(cwd, "docs", "figures"), exist_ok=True)
            if not os.path.exists(os.path.join(cwd, "testdata")):
                os.symlink(os.path.join(root, "testdata"), os.path.join(cwd, "testdata"))
        text = open(doc, encoding="utf-8").read()
        out, pos, count = [], 0, 0
        for m in BLOCK.finditer(text):
            count += 1
            got = run(binary, m.group(1), cwd)
            if mode == "--check" and got != m.group(2):
                failures += 1
                print(f"{doc}: output of `{m.group(1)}` differs from the tool's:", file=sys.stderr)
                want_lines, got_lines = m.group(2).splitlines(), got.splitlines()
                for i in range(max(len(want_lines), len(got_lines))):
                    w = want_lines[i] if i < len(want_lines) else "<none>"
                    g = got_lines[i] if i < len(got_lines) else "<none>"
                    if w != g:
                        print(f"  line {i + 1}:\n    doc:  {w}\n    tool: {g}", file=sys.stderr)
                        break
            out.append(text[pos:m.start(2)] + got)
            pos = m.end(2)
        out.append(text[pos:])
        if mode == "--update":
            tmp = doc + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(out))
            os.replace(tmp, doc)
        if mode == "--check":
            figures = os.path.join(cwd, "docs", "figures")
            for name in sorted(os.listdir(figures)):
                committed = os.path.join(root, "docs", "figures", name)
                fresh = open(os.path.join(figures, name), "rb").read()
                if not os.path.exists(committed) or open(committed, "rb").read() != fresh:
                    failures += 1
                    print(f"{doc}: docs/figures/{name} differs from what the tool draws", file=sys.stderr)
        print(f"{doc}: {count} command outputs {'checked' if mode == '--check' else 'written'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
