"""Runs the Python examples of docs/fixtures.md as a user would: in a folder with `testdata/`
(the committed fixtures) and `flashref` on PATH, every block marked `<!-- example: NAME.py -->`
in the order of the page; then every ```console block of the page whose first line is
`$ flashref ...`, comparing the command's output (stdout and stderr) with the block. With
--update the blocks are rewritten with what the tool prints instead.

Exit status 77 (skipped) when this python3 lacks h5py or numpy; 1 when an example fails or an
output differs; 0 otherwise."""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys

MARKER = re.compile(r"<!-- example: ([\w.-]+\.py) -->\n```python\n(.*?)```", re.S)
CONSOLE = re.compile(r"```console\n\$ (flashref[^\n]*)\n(.*?)```", re.S)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc", required=True)
    ap.add_argument("--testdata", required=True)
    ap.add_argument("--flashref", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--update", action="store_true", help="rewrite the console blocks")
    args = ap.parse_args()

    try:
        import h5py  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED: {sys.executable} cannot import h5py and numpy ({e}); "
              "install python3-h5py and python3-numpy")
        return 77

    text = open(args.doc, encoding="utf-8").read()
    examples = MARKER.findall(text)
    if not examples:
        print(f"{args.doc}: expected blocks marked '<!-- example: NAME.py -->', got none")
        return 1

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    os.symlink(os.path.abspath(args.testdata), os.path.join(args.work, "testdata"))
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(os.path.abspath(args.flashref)) + os.pathsep + env.get("PATH", "")
    for name, code in examples:
        script = os.path.join(args.work, name)
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        rc = subprocess.run([sys.executable, script], cwd=args.work, env=env).returncode
        if rc != 0:
            print(f"{args.doc}: example {name} exited with status {rc}")
            return 1

    failures, out, pos = 0, [], 0
    for m in CONSOLE.finditer(text):
        proc = subprocess.run(shlex.split(m.group(1)), cwd=args.work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.stdout != m.group(2) and not args.update:
            failures += 1
            print(f"{args.doc}: output of `{m.group(1)}` differs from the tool's:")
            want, got = m.group(2).splitlines(), proc.stdout.splitlines()
            for i in range(max(len(want), len(got))):
                w = want[i] if i < len(want) else "<none>"
                g = got[i] if i < len(got) else "<none>"
                if w != g:
                    print(f"  line {i + 1}:\n    doc:  {w}\n    tool: {g}")
                    break
        out.append(text[pos:m.start(2)] + proc.stdout)
        pos = m.end(2)
    out.append(text[pos:])
    if args.update:
        with open(args.doc + ".tmp", "w", encoding="utf-8") as f:
            f.write("".join(out))
        os.replace(args.doc + ".tmp", args.doc)
    print(f"{args.doc}: {len(examples)} examples run, "
          f"{len(CONSOLE.findall(text))} command outputs {'written' if args.update else 'checked'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
