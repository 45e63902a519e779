"""Extracts the Python example of docs/fixtures.md and runs it as a user would: in a folder
with `testdata/` (the committed fixtures) and `flashref` on PATH. Exit status 77 (skipped)
when this python3 lacks h5py or numpy; otherwise the example's own exit status."""

import argparse
import os
import re
import shutil
import subprocess
import sys

MARKER = "<!-- example: check_fixtures.py -->"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc", required=True)
    ap.add_argument("--testdata", required=True)
    ap.add_argument("--flashref", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()

    try:
        import h5py  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED: {sys.executable} cannot import h5py and numpy ({e}); "
              "install python3-h5py and python3-numpy")
        return 77

    text = open(args.doc, encoding="utf-8").read()
    at = text.find(MARKER)
    if at < 0:
        print(f"{args.doc}: expected the marker '{MARKER}', got none")
        return 1
    block = re.search(r"```python\n(.*?)```", text[at:], re.S)
    if block is None:
        print(f"{args.doc}: expected a ```python block after '{MARKER}', got none")
        return 1

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    os.symlink(os.path.abspath(args.testdata), os.path.join(args.work, "testdata"))
    script = os.path.join(args.work, "check_fixtures.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(block.group(1))
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(os.path.abspath(args.flashref)) + os.pathsep + env.get("PATH", "")
    return subprocess.run([sys.executable, script], cwd=args.work, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
