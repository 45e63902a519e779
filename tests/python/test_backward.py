"""flashref.attention_backward on numpy arrays: the CLI's gradients, the float64 golden ones."""

import numpy as np
import pytest

import flashref

from conftest import run_cli

h5py = pytest.importorskip("h5py")

NAMES = [n for n in flashref.fixtures.names() if flashref.fixtures.load(n).do is not None]


def test_the_fixtures_carry_the_backward():
    assert "blocksparse_empty_rows" in NAMES and "bwd_empty_row_in_tile" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_equals_the_cli_bit_for_bit(cli, tmp_path, name):
    fx = flashref.fixtures.load(name)
    out = tmp_path / "r.h5"
    run_cli(cli, "run", "--problem", fx.path, "--out", out, "--backend", "cpu", "--backward")
    kw = fx.attention_kwargs()
    o, lse = flashref.attention(fx.q, fx.k, fx.v, **kw, backend="cpu", return_lse=True)
    dq, dk, dv = flashref.attention_backward(fx.q, fx.k, fx.v, o, lse, fx.do, **kw,
                                             backend="cpu")
    with h5py.File(out, "r") as f:
        cli = {field: f[field][...] for field in ("o", "lse", "dq", "dk", "dv")}
    if fx.input_dtype == "bfloat16":
        # The CLI's forward may take the CPU's bf16 path on a bfloat16 file (see test_attention):
        # its O, and so its gradients, differ in the last bits; each must meet the fixture.
        assert flashref.check(fx, cli["o"], cli["lse"], dq=cli["dq"], dk=cli["dk"], dv=cli["dv"])
    else:
        for field, x in (("dq", dq), ("dk", dk), ("dv", dv)):
            np.testing.assert_array_equal(x, cli[field])
    assert flashref.check(fx, o, lse, dq=dq, dk=dk, dv=dv)


def test_float64_on_the_reference_backend_gives_the_golden_gradients():
    fx = flashref.fixtures.load("blocksparse_empty_rows")
    q, k, v, do = (x.astype(np.float64) for x in (fx.q, fx.k, fx.v, fx.do))
    kw = fx.attention_kwargs()
    o, lse = flashref.attention(q, k, v, **kw, backend="reference", return_lse=True)
    dq, dk, dv = flashref.attention_backward(q, k, v, o, lse, do, **kw, backend="reference")
    assert dq.dtype == np.float64
    np.testing.assert_array_equal(dq, fx.dq)
    np.testing.assert_array_equal(dk, fx.dk)
    np.testing.assert_array_equal(dv, fx.dv)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_deterministic_false_changes_nothing_on_a_host_backend(backend):
    """The opt-in of the CUDA backward's device path; host backends are deterministic anyway."""
    fx = flashref.fixtures.load("bwd_kv_len_cuts_tile")
    kw = fx.attention_kwargs()
    o, lse = flashref.attention(fx.q, fx.k, fx.v, **kw, backend=backend, return_lse=True)
    want = flashref.attention_backward(fx.q, fx.k, fx.v, o, lse, fx.do, **kw, backend=backend)
    got = flashref.attention_backward(fx.q, fx.k, fx.v, o, lse, fx.do, **kw, backend=backend,
                                      deterministic=False)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert flashref.check(fx, o, lse, dq=got[0], dk=got[1], dv=got[2])


def test_blhd_layout_equals_bhld():
    fx = flashref.fixtures.load("gqa")
    kw = fx.attention_kwargs()
    t = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))  # noqa: E731
    o, lse = flashref.attention(fx.q, fx.k, fx.v, **kw, return_lse=True, backend="cpu")
    grads = flashref.attention_backward(fx.q, fx.k, fx.v, o, lse, fx.do, **kw, backend="cpu")
    grads_b = flashref.attention_backward(t(fx.q), t(fx.k), t(fx.v), t(o), lse, t(fx.do), **kw,
                                          backend="cpu", layout="blhd")
    for g, gb in zip(grads, grads_b):
        np.testing.assert_array_equal(gb, t(g))


def test_a_wrong_check_of_a_gradient_is_named():
    fx = flashref.fixtures.load("blocksparse_empty_rows")
    dq = fx.dq.astype(np.float32)
    dq[0, 0, 0, 0] = np.nan
    report = flashref.check(fx, fx.o, fx.lse, dq=dq, dk=fx.dk, dv=fx.dv)
    assert not report and "dq" in report.message


def test_backward_errors():
    fx = flashref.fixtures.load("gqa")
    o, lse = flashref.attention(fx.q, fx.k, fx.v, return_lse=True)
    with pytest.raises(ValueError) as e:
        flashref.attention_backward(fx.q, fx.k, fx.v, o, None, fx.do)
    assert str(e.value) == "lse: expected the forward's LSE for the backward, got None"
    with pytest.raises(ValueError) as e:
        flashref.attention_backward(fx.q, fx.k, fx.v, o, lse, fx.do[:, :, :1])
    assert "\n" not in str(e.value) and str(e.value).split(":")[0] in ("do", "d_o", "dO")
