"""The type stub of flashref._core names what the extension defines, no more, no less."""

import ast
from pathlib import Path

import flashref
from flashref import _core


def test_stub_matches_the_extension():
    stub = Path(flashref.__file__).with_name("_core.pyi")
    tree = ast.parse(stub.read_text())
    declared = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined = {n for n in dir(_core) if not n.startswith("_")}
    assert declared == defined
    assert (stub.parent / "py.typed").is_file()
