"""The Python examples of README.md and docs/python.md run as written."""

import re
import sys

import pytest

from conftest import ROOT


def python_blocks(path):
    text = (ROOT / path).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("path", ["README.md", "docs/python.md"])
def test_examples_run(path, capsys):
    blocks = python_blocks(path)
    assert blocks, f"{path} has no Python example"
    scope = {"__name__": "docs_example"}
    for block in blocks:
        if re.search(r"^import torch", block, flags=re.M) and "torch" not in sys.modules:
            try:
                import torch  # noqa: F401
            except ImportError:
                continue  # the torch examples run where torch is installed
        exec(compile(block, f"{path} example", "exec"), scope)
    for name, fn in list(scope.items()):
        if name.startswith("test_") and callable(fn):
            fn()


def test_readme_example_prints_what_it_says(capsys):
    (block,) = python_blocks("README.md")
    exec(compile(block, "README.md example", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out.split() == ["0.0", "-inf"]
