"""The backward on device memory: what the binding refuses before a device is touched.

Every test here runs without a GPU and without torch: the arrays are DLPack descriptions of
device memory at addresses nothing is allocated at (conftest.DeviceArray), so each call must
fail on its dtypes, devices or shapes before the CUDA entry. Where no CUDA device is usable, a
valid call gets as far as the backend's "not available" and no further. The same calls on
real CUDA tensors, with results, are in test_torch_cuda_backward.py.
"""

import numpy as np
import pytest

import flashref
from flashref import _core

from conftest import CUDA_DEVICE, DeviceArray

CUDA_AVAILABLE = any(b.name == "cuda" and b.available for b in flashref.backends())


def one_line(e):
    text = str(e.value)
    assert "\n" not in text
    return text


def problem(dtype="bfloat16", B=1, Hq=2, Hk=1, Lq=8, Lk=12, D=64, Dv=64, blhd=False,
            o_dtype=None, do_dtype=None, grad_dtype=None):
    """The tensors of a backward in device memory, as a dict of DeviceArray by field."""

    def shape(H, L, X):
        return (B, L, H, X) if blhd else (B, H, L, X)

    grad_dtype = grad_dtype or dtype
    return {
        "q": DeviceArray(shape(Hq, Lq, D), dtype),
        "k": DeviceArray(shape(Hk, Lk, D), dtype),
        "v": DeviceArray(shape(Hk, Lk, Dv), dtype),
        "o": DeviceArray(shape(Hq, Lq, Dv), o_dtype or dtype),
        "lse": DeviceArray((B, Hq, Lq), "float32"),
        "do": DeviceArray(shape(Hq, Lq, Dv), do_dtype or dtype),
        "dq": DeviceArray(shape(Hq, Lq, D), grad_dtype),
        "dk": DeviceArray(shape(Hk, Lk, D), grad_dtype),
        "dv": DeviceArray(shape(Hk, Lk, Dv), grad_dtype),
    }


def backward(t, *, backend="automatic", blhd=False, causal="none", block_mask=None, block_size=(0, 0),
             kv_len=None, window=(-1, -1)):
    return _core.attention_backward_into(
        t["q"], t["k"], t["v"], t["o"], t["lse"], t["do"], t["dq"], t["dk"], t["dv"], None,
        causal, window[0], window[1], block_mask, block_size[0], block_size[1], kv_len, backend,
        blhd, True, 0,
    )


def refused(error, t, **kwargs):
    with pytest.raises(error) as e:
        backward(t, **kwargs)
    return one_line(e)


def test_the_arrays_are_seen_as_cuda_memory():
    t = problem()
    seen = _core.describe(t["q"])
    assert seen["device"] == "cuda:0" and seen["dtype"] == "bfloat16"
    assert seen["data"] == t["q"].data and seen["shape"] == [1, 2, 8, 64]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_host_backend_says_who_takes_device_memory(backend):
    assert refused(TypeError, problem(), backend=backend) == (
        f"q: expected host memory for backend {backend}, got cuda:0 (device memory: cuda)")


def test_a_device_other_than_cuda():
    t = problem()
    for field in t:  # all on one device, so that the device of q is what is refused
        t[field].device = (10, 0)  # kDLROCM
    assert refused(TypeError, t) == "q: expected host or CUDA memory, got DLPack device type 10"


@pytest.mark.parametrize("field", ["k", "v", "o", "lse", "do", "dq", "dk", "dv"])
def test_every_tensor_on_the_device_of_q(field):
    t = problem()
    t[field].device = (CUDA_DEVICE, 1)
    assert refused(TypeError, t) == f"{field}: expected the device of q (cuda:0), got cuda:1"
    t = problem()
    t[field] = np.zeros(t[field].shape, np.float32)
    assert refused(TypeError, t) == f"{field}: expected the device of q (cuda:0), got cpu"


def test_the_masks_on_the_device_of_q():
    t = problem()
    mask = np.ones((1, 1, 1, 1), np.uint8)
    assert refused(TypeError, t, block_mask=mask, block_size=(8, 12)) == (
        "block_mask: expected the device of q (cuda:0), got cpu")
    kv = np.array([5], np.int32)
    assert refused(TypeError, t, kv_len=kv) == "kv_len: expected the device of q (cuda:0), got cpu"


def test_dtypes_of_the_inputs():
    assert refused(TypeError, problem("float64")) == (
        "q: expected dtype float32, bfloat16 or float16, got float64")
    t = problem()
    t["k"] = DeviceArray(t["k"].shape, "float16")
    assert refused(TypeError, t) == "k: expected dtype bfloat16 (the dtype of q), got float16"
    t = problem()
    t["v"] = DeviceArray(t["v"].shape, "float32")
    assert refused(TypeError, t) == "v: expected dtype bfloat16 (the dtype of q), got float32"
    assert refused(TypeError, problem(o_dtype="float16")) == (
        "o: expected dtype float32 or bfloat16, got float16")
    t = problem()
    t["lse"] = DeviceArray(t["lse"].shape, "bfloat16")
    assert refused(TypeError, t) == "lse: expected dtype float32, got bfloat16"


def test_dtypes_of_the_gradients():
    assert refused(TypeError, problem(do_dtype="float16")) == (
        "do: expected dtype float32 or bfloat16 (the dtype of q), got float16")
    assert refused(TypeError, problem("float16", do_dtype="float64")) == (
        "do: expected dtype float32 or float16 (the dtype of q), got float64")
    assert refused(TypeError, problem(grad_dtype="float64")) == (
        "dq: expected dtype float32 or bfloat16 (the dtype of q), got float64")
    assert refused(TypeError, problem("float32", grad_dtype="bfloat16")) == (
        "dq: expected dtype float32 (the dtype of q), got bfloat16")
    assert refused(TypeError, problem("float32", o_dtype="float16")) == (
        "o: expected dtype float32, got float16")
    for field in ("dk", "dv"):
        t = problem()
        t[field] = DeviceArray(t[field].shape, "float32")
        assert refused(TypeError, t) == (
            f"{field}: expected dtype bfloat16 (the dtype of dq), got float32")


def test_mask_dtypes():
    t = problem()
    mask = DeviceArray((1, 1, 1, 1), "float32")
    assert refused(TypeError, t, block_mask=mask, block_size=(8, 12)) == (
        "block_mask: expected dtype uint8 or bool, got float32")
    assert refused(TypeError, t, kv_len=DeviceArray((1,), "int64")) == (
        "kv_len: expected dtype int32, got int64")


def test_ranks():
    t = problem()
    t["q"] = DeviceArray((2, 8, 64), "bfloat16")
    assert refused(ValueError, t).startswith("q: expected 4 dimensions (B, H, L, D), got 3")
    t = problem(blhd=True)
    t["dk"] = DeviceArray((12, 1, 64), "bfloat16")
    assert refused(ValueError, t, blhd=True).startswith(
        "dk: expected 4 dimensions (B, L, H, D), got 3")


def test_the_forward_lse_is_required():
    t = problem()
    t["lse"] = None
    assert refused(ValueError, t) == "lse: expected the forward's LSE for the backward, got None"


def test_shapes_by_the_library_rules():
    """validate_backward's rules and messages, as on host memory, before the device."""
    t = problem()
    t["do"] = DeviceArray((1, 2, 7, 64), "bfloat16")
    assert refused(ValueError, t) == "d_o: expected shape [1, 2, 8, 64], got [1, 2, 7, 64]"
    t = problem()
    t["dk"] = DeviceArray((1, 2, 12, 64), "bfloat16")
    assert refused(ValueError, t) == "dk: expected shape [1, 1, 12, 64], got [1, 2, 12, 64]"
    t = problem()
    t["dv"] = DeviceArray((1, 1, 12, 32), "bfloat16")
    assert refused(ValueError, t) == "dv: expected shape [1, 1, 12, 64], got [1, 1, 12, 32]"
    t = problem()
    t["o"] = DeviceArray((1, 2, 8, 32), "bfloat16")
    assert refused(ValueError, t).startswith("o: expected shape [1, 2, 8, 64]")
    t = problem()
    t["lse"] = DeviceArray((1, 2, 9), "float32")
    assert refused(ValueError, t).startswith("lse: expected shape [1, 2, 8]")
    assert refused(ValueError, problem(Hq=3, Hk=2)).startswith("k: expected a head count dividing")
    # blhd: the shapes are read as [B, L, H, D]
    t = problem(blhd=True)
    t["dq"] = DeviceArray((1, 2, 8, 64), "bfloat16")  # [B, H, L, D] storage given for blhd
    assert refused(ValueError, t, blhd=True) == (
        "dq: expected shape [1, 2, 8, 64], got [1, 8, 2, 64]")


def test_masks_by_the_library_rules():
    t = problem()  # Lq = 8, Lk = 12: blocks of 8 x 8 make a 1 x 2 grid
    mask = DeviceArray((1, 2, 1, 1), "bool")
    assert refused(ValueError, t, block_mask=mask, block_size=(8, 8)) == (
        "block_mask: expected shape [1, 2, 1, 2], got [1, 2, 1, 1]")
    mask = DeviceArray((1, 2, 1, 2), "uint8")
    assert refused(ValueError, t, block_mask=mask, block_size=(0, 8)).startswith("block_q: ")
    assert refused(ValueError, t, kv_len=DeviceArray((2,), "int32")) == (
        "kv_len: expected shape [1], got [2]")
    assert refused(ValueError, t, window=(-2, 0)).startswith("window_left: ")


def test_no_device_after_every_check():
    """A valid call passes every check and stops at the backend: no device, or not built."""
    if CUDA_AVAILABLE:
        pytest.skip("a CUDA device is present (test_torch_cuda_backward.py runs the backward)")
    valid = [
        (problem(), {}),
        (problem("float16", o_dtype="float32", do_dtype="float32", grad_dtype="float32"), {}),
        (problem("float32", D=24, Dv=40), {"causal": "bottom_right"}),
        (problem(Hq=4, Hk=2, Lq=40, Lk=24, blhd=True), {"blhd": True, "window": (3, 2)}),
        (problem(B=2), {"block_mask": DeviceArray((2, 1, 1, 2), "bool"), "block_size": (8, 8),
                        "kv_len": DeviceArray((2,), "int32")}),
    ]
    for t, kwargs in valid:
        assert refused(ValueError, t, **kwargs).startswith(
            "backend: expected an available backend, got 'cuda' (")


def test_the_forward_checks_dtypes_before_the_device():
    """The forward's device path refuses a dtype before it looks for a device, as the backward."""
    t = problem()
    t["k"] = DeviceArray(t["k"].shape, "float32")
    with pytest.raises(TypeError) as e:
        _core.attention_into(t["q"], t["k"], t["v"], t["o"], t["lse"], None, "none", -1, -1,
                             None, 0, 0, None, "automatic", False, 0)
    assert one_line(e) == "k: expected dtype bfloat16 (the dtype of q), got float32"
