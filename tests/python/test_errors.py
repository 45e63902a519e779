"""Every error path: ValueError or TypeError with the library's one-line message."""

import numpy as np
import pytest

import flashref


def problem(Hq=2, Hk=1, Lq=8, Lk=8, D=4):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, Hq, Lq, D), dtype=np.float32)
    k = rng.standard_normal((1, Hk, Lk, D), dtype=np.float32)
    v = rng.standard_normal((1, Hk, Lk, D), dtype=np.float32)
    return q, k, v


def one_line(e):
    text = str(e.value)
    assert "\n" not in text
    return text


def test_wrong_rank():
    q, k, v = problem()
    with pytest.raises(ValueError) as e:
        flashref.attention(q[0], k, v)
    assert one_line(e).startswith("q: expected 4 dimensions (B, H, L, D), got 3")
    with pytest.raises(ValueError) as e:
        flashref.attention(q, k[0], v)
    assert one_line(e).startswith("k: expected 4 dimensions")


def test_wrong_dtype_names_the_field_and_who_takes_it():
    q, k, v = problem()
    with pytest.raises(TypeError) as e:
        flashref.attention(q.astype(np.float64), k, v)
    assert one_line(e) == ("q: expected dtype float32 in host memory, got float64 (float64 "
                           "inputs: the reference backend, backend=\"reference\")")
    with pytest.raises(TypeError) as e:
        flashref.attention(q, k, v.astype(np.float16))
    assert one_line(e).startswith("v: expected dtype float32 in host memory, got float16 "
                                  "(float16 inputs: in device memory on ")


def test_not_an_array():
    q, k, v = problem()
    with pytest.raises(TypeError) as e:
        flashref.attention(q.tolist(), k, v)
    assert one_line(e) == "q: expected a numpy array or a torch tensor, got list"
    with pytest.raises(TypeError) as e:
        flashref.attention(q, k.tolist(), v)
    assert one_line(e) == "k: expected a numpy array or a torch tensor, got list"
    with pytest.raises(TypeError) as e:
        flashref.attention(q, k, v, block_mask=object(), block_size=4)
    assert one_line(e) == ("block_mask: expected a numpy array or a torch tensor, got ndarray "
                          "of dtype object")
    o, lse = flashref.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError) as e:
        flashref.attention_backward(q, k, v, o, lse, "do")
    assert one_line(e) == "do: expected a numpy array or a torch tensor, got str"


def test_the_library_validates_the_problem():
    q, k, v = problem(Hq=3, Hk=2)
    with pytest.raises(ValueError) as e:
        flashref.attention(q, k, v)
    assert one_line(e).startswith("k: ")
    q, k, v = problem()
    with pytest.raises(ValueError) as e:
        flashref.attention(q, k, v[:, :, :5])
    assert one_line(e).startswith("v: expected")
    with pytest.raises(ValueError) as e:
        flashref.attention(q, k, v, block_mask=np.ones((1, 2, 2, 1), np.uint8), block_size=4)
    assert one_line(e) == "block_mask: expected shape [1, 2, 2, 2], got [1, 2, 2, 1]"
    with pytest.raises(ValueError) as e:
        flashref.attention(q, k, v, kv_len=[9])
    assert one_line(e).startswith("kv_len")
    with pytest.raises(ValueError) as e:
        flashref.attention(q, k, v, kv_len=[1, 2])
    assert one_line(e) == "kv_len: expected shape [1], got [2]"


def test_options():
    q, k, v = problem()
    cases = [
        ({"causal": "bottom"}, "causal: expected None, 'bottom_right' or 'top_left', got 'bottom'"),
        ({"backend": "gpu"}, "backend: expected one of auto, reference, cpu, cuda, got 'gpu'"),
        ({"layout": "bshd"}, "layout: expected 'bhld' or 'blhd', got 'bshd'"),
        ({"window": 3}, "window: expected None or (left, right), each an int >= 0 or None, got 3"),
        ({"window": (-2, 0)}, "window: expected sizes >= 0 or None, got (-2, 0)"),
        ({"block_size": 4}, "block_size: expected None without a block_mask, got 4"),
        ({"block_mask": np.ones((1, 1, 2, 2), bool)},
         "block_size: expected an int or (block_q, block_k) with a block_mask, got None"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as e:
            flashref.attention(q, k, v, **kwargs)
        assert one_line(e) == message
    with pytest.raises(ValueError) as e:
        flashref.attention(q, k, v, block_mask=np.ones((1, 1, 2, 2), bool), block_size=0)
    assert one_line(e).startswith("block_q")


def test_mask_dtypes():
    q, k, v = problem()
    with pytest.raises(TypeError) as e:
        flashref.attention(q, k, v, block_mask=np.ones((1, 1, 2, 2), np.float32), block_size=4)
    assert one_line(e) == "block_mask: expected dtype uint8 or bool, got float32"


def test_unavailable_backend_says_why():
    infos = {b.name: b for b in flashref.backends()}
    if infos["cuda"].available:
        pytest.skip("a CUDA device is present")
    q, k, v = problem()
    with pytest.raises(ValueError) as e:
        flashref.attention(q, k, v, backend="cuda")
    assert one_line(e).startswith("backend: expected an available backend, got 'cuda' (")


def test_fixture_errors(tmp_path):
    with pytest.raises(ValueError) as e:
        flashref.fixtures.load("no_such_case")
    assert one_line(e).startswith("fixture: expected one of the ")
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5")
    with pytest.raises(ValueError) as e:
        flashref.fixtures.load(bad)
    assert str(bad) in one_line(e)


def test_check_errors():
    fx = flashref.fixtures.load("gqa")
    with pytest.raises(ValueError) as e:
        flashref.check(fx, fx.o[:, :1])
    assert one_line(e).startswith("o: expected shape [")
    with pytest.raises(ValueError) as e:
        flashref.check(fx, fx.o, fx.lse[..., :3])
    assert one_line(e).startswith("lse: expected shape [")


def test_merge_errors():
    o = np.zeros((2, 3, 4), np.float32)
    lse = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError) as e:
        flashref.merge(o, lse[:, :2], o, lse)
    assert one_line(e) == ("lse_a: expected shape [2, 3] (o_a without its last dimension), "
                           "got [2, 2]")
    with pytest.raises(ValueError) as e:
        flashref.merge(o, lse, o[:1], lse)
    assert one_line(e).startswith("o_b: expected shape [2, 3, 4]")
    with pytest.raises(TypeError) as e:
        flashref.merge(o, lse, o.astype(np.float64), lse)
    assert one_line(e) == "o_b: expected dtype float32 (the dtype of o_a), got float64"
    with pytest.raises(TypeError) as e:
        flashref.merge(o.astype(np.int32), lse, o, lse)
    assert one_line(e) == "o_a: expected dtype float32 or float64, got int32"
