"""flashref.attention on numpy arrays: the CLI's results, zero copy, layouts, empty rows."""

import threading

import numpy as np
import pytest

import flashref
from flashref import _core

from conftest import run_cli

h5py = pytest.importorskip("h5py")

NAMES = flashref.fixtures.names()


def random_problem(B=1, Hq=2, Hk=1, Lq=33, Lk=47, D=16, Dv=24, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Lq, D), dtype=np.float32)
    k = rng.standard_normal((B, Hk, Lk, D), dtype=np.float32)
    v = rng.standard_normal((B, Hk, Lk, Dv), dtype=np.float32)
    return q, k, v


def test_every_fixture_is_shipped():
    assert len(NAMES) >= 40
    for name in ("spec_masked_first_block", "blocksparse_empty_rows", "kv_len_zero", "gqa"):
        assert name in NAMES


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", NAMES)
def test_equals_the_cli_bit_for_bit(cli, tmp_path, name, backend):
    fx = flashref.fixtures.load(name)
    out = tmp_path / "r.h5"
    run_cli(cli, "run", "--problem", fx.path, "--out", out, "--backend", backend)
    o, lse = flashref.attention(fx.q, fx.k, fx.v, **fx.attention_kwargs(), backend=backend,
                                return_lse=True)
    with h5py.File(out, "r") as f:
        o_cli, lse_cli = f["o"][...], f["lse"][...]
    if backend == "cpu" and fx.input_dtype == "bfloat16":
        # The CLI labels a bfloat16 file's inputs as bfloat16, and the CPU backend may then take
        # its bf16 dot-product path (AVX-512 BF16, AMX); numpy float32 arrays carry no such label
        # and take the float32 path. Different arithmetic, so each must meet the fixture instead.
        assert flashref.check(fx, o_cli, lse_cli).passed
    else:
        np.testing.assert_array_equal(o, o_cli)
        np.testing.assert_array_equal(lse, lse_cli)
    assert flashref.check(fx, o, lse).passed


def test_empty_rows_are_zero_and_minus_inf():
    fx = flashref.fixtures.load("blocksparse_empty_rows")
    o, lse = flashref.attention(fx.q, fx.k, fx.v, **fx.attention_kwargs(), return_lse=True)
    empty = np.isneginf(fx.lse)
    assert empty.any()
    assert np.all(o[empty] == 0)
    assert np.all(np.isneginf(lse[empty]))
    assert not np.isnan(o).any()


def test_strided_views_are_read_in_place():
    q, k, v = random_problem(Lq=40, Lk=40)
    big = np.zeros((1, 2, 80, 48), np.float32)
    big[:, :, ::2, 8:24] = q
    qs = big[:, :, ::2, 8:24]  # strided in L and offset in D: no copy may be made
    seen = _core.describe(qs)
    assert seen["data"] == qs.ctypes.data
    assert seen["strides"] == [s // 4 for s in qs.strides]
    ks = np.asfortranarray(k)
    assert _core.describe(ks)["data"] == ks.ctypes.data
    vt = np.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert _core.describe(vt)["data"] == vt.ctypes.data
    expect = flashref.attention(q, k, v, backend="cpu")
    np.testing.assert_array_equal(flashref.attention(qs, ks, vt, backend="cpu"), expect)


def test_read_only_inputs_are_accepted():
    q, k, v = random_problem()
    for x in (q, k, v):
        x.flags.writeable = False
    o = flashref.attention(q, k, v)
    assert o.shape == (1, 2, 33, 24) and o.dtype == np.float32


def test_lse_is_allocated_only_when_asked_for():
    # The outputs are allocated by the core (numpy.empty, which tracemalloc sees): O alone
    # without return_lse, O and LSE with it.
    import tracemalloc

    q, k, v = random_problem(Hq=1, Lq=1024, Lk=8, D=4, Dv=4)
    o_bytes, lse_bytes = 1024 * 4 * 4, 1024 * 4
    tracemalloc.start()
    try:
        peaks = {}
        for return_lse in (False, True):
            flashref.attention(q, k, v, return_lse=return_lse)  # warm-up
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            result = flashref.attention(q, k, v, return_lse=return_lse)
            peaks[return_lse] = tracemalloc.get_traced_memory()[1] - before
            del result
    finally:
        tracemalloc.stop()
    assert o_bytes <= peaks[False] < o_bytes + lse_bytes
    assert peaks[True] >= o_bytes + lse_bytes


def test_outputs_are_new_arrays_of_the_inputs_kind():
    q, k, v = random_problem()
    o, lse = flashref.attention(q, k, v, return_lse=True)
    assert type(o) is np.ndarray and o.flags.c_contiguous and o.flags.writeable
    assert o.shape == (1, 2, 33, 24) and lse.shape == (1, 2, 33) and lse.dtype == np.float32
    assert not np.shares_memory(o, q) and not np.shares_memory(o, lse)
    o = flashref.attention(q, k, v)
    assert type(o) is np.ndarray


def test_blhd_layout_equals_bhld():
    q, k, v = random_problem(Hq=4, Hk=2)
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    o, lse = flashref.attention(q, k, v, causal="bottom_right", return_lse=True)
    ob, lseb = flashref.attention(t(q), t(k), t(v), causal="bottom_right", layout="blhd",
                                  return_lse=True)
    assert ob.shape == (1, 33, 4, 24)
    np.testing.assert_array_equal(ob, t(o))
    np.testing.assert_array_equal(lseb, lse)


def test_masks_and_options_reach_the_library():
    q, k, v = random_problem(Lq=64, Lk=64)
    dense = flashref.attention(q, k, v, backend="reference")
    mask = np.ones((1, 1, 4, 4), bool)
    full = flashref.attention(q, k, v, block_mask=mask, block_size=16, backend="reference")
    np.testing.assert_array_equal(full, dense)
    mask[0, 0, 1, :] = False  # query rows 16..31 see nothing
    o, lse = flashref.attention(q, k, v, block_mask=mask, block_size=(16, 16), return_lse=True)
    assert np.all(o[:, :, 16:32] == 0) and np.all(np.isneginf(lse[:, :, 16:32]))
    o, lse = flashref.attention(q, k, v, kv_len=[0], return_lse=True)
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    o1 = flashref.attention(q, k, v, scale=0.5)
    o2 = flashref.attention(q * np.float32(2.0), k, v)  # 0.5 = 2 / sqrt(D)
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-6)
    w = flashref.attention(q, k, v, window=(0, 0), backend="reference")
    np.testing.assert_allclose(w[:, :, :, :], np.repeat(v, 2, axis=1), rtol=1e-6, atol=1e-6)


def test_backends_are_listed():
    infos = {b.name: b for b in flashref.backends()}
    assert list(infos) == ["reference", "cpu", "cuda"]
    assert infos["reference"].available and infos["cpu"].available
    assert "float32" in infos["cpu"].dtypes
    if not infos["cuda"].available:
        assert infos["cuda"].reason


def test_merge_of_a_split_equals_the_whole():
    q, k, v = random_problem(Lk=50)
    o, lse = flashref.attention(q, k, v, backend="reference", return_lse=True)
    for j in (0, 1, 17, 49, 50):
        oa, la = flashref.attention(q, k[:, :, :j], v[:, :, :j], scale=0.25, backend="reference",
                                    return_lse=True)
        ob, lb = flashref.attention(q, k[:, :, j:], v[:, :, j:], scale=0.25, backend="reference",
                                    return_lse=True)
        om, lm = flashref.merge(oa, la, ob, lb)
        np.testing.assert_allclose(om, o, rtol=2e-5, atol=2e-5 * np.abs(v).max())
        np.testing.assert_allclose(lm, lse, rtol=0, atol=1e-5 * max(1, np.abs(lse).max()))


def test_merge_identity_is_zero_and_minus_inf():
    o = np.arange(12, dtype=np.float64).reshape(2, 6)
    lse = np.array([0.5, -2.0])
    zero, ninf = np.zeros_like(o), np.full_like(lse, -np.inf)
    om, lm = flashref.merge(o, lse, zero, ninf)
    np.testing.assert_array_equal(om, o)
    np.testing.assert_array_equal(lm, lse)
    om, lm = flashref.merge(zero, ninf, zero, ninf)
    assert np.all(om == 0) and np.all(np.isneginf(lm))


def test_threads_get_their_own_results():
    problems = [random_problem(seed=s, Lq=64, Lk=96) for s in range(8)]
    expect = [flashref.attention(*p, causal="top_left") for p in problems]
    got = [None] * len(problems)

    def work(i):
        for _ in range(5):
            got[i] = flashref.attention(*problems[i], causal="top_left")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e, g in zip(expect, got):
        np.testing.assert_array_equal(g, e)


def test_fixtures_load_from_several_threads():
    names = NAMES[:16]
    expect = {n: flashref.fixtures.load(n).o for n in names}
    got = {}

    def work(n):
        got[n] = flashref.fixtures.load(n).o

    threads = [threading.Thread(target=work, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in names:
        np.testing.assert_array_equal(got[n], expect[n])


def test_no_keys_at_all():
    q = np.ones((1, 2, 3, 4), np.float32)
    k, v = np.ones((1, 1, 0, 4), np.float32), np.ones((1, 1, 0, 5), np.float32)
    o, lse = flashref.attention(q, k, v, return_lse=True)
    assert o.shape == (1, 2, 3, 5) and np.all(o == 0) and np.all(np.isneginf(lse))


def test_the_gil_is_released_during_computation():
    q, k, v = random_problem(B=2, Hq=4, Hk=4, Lq=512, Lk=512, D=64, Dv=64)
    done = threading.Event()
    ticks = 0

    def run():
        flashref.attention(q, k, v, backend="reference")
        done.set()

    t = threading.Thread(target=run)
    t.start()
    while not done.is_set():
        ticks += 1
    t.join()
    # With the GIL held for the whole call this loop would run only between the call's start
    # and end (a handful of switches); released, it spins freely.
    assert ticks > 10000


def test_float64_on_the_reference_backend_is_the_naive_reference():
    fx = flashref.fixtures.load("blocksparse_empty_rows")
    q, k, v = (x.astype(np.float64) for x in (fx.q, fx.k, fx.v))
    o, lse = flashref.attention(q, k, v, **fx.attention_kwargs(), backend="reference",
                                return_lse=True)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    # The golden values are this reference's on the same inputs.
    np.testing.assert_array_equal(o, fx.o)
    np.testing.assert_array_equal(lse, fx.lse)
    bad = q.copy()
    bad[0, 0, 0, 0] = 0.1  # not a float32 value
    with pytest.raises(ValueError) as e:
        flashref.attention(bad, k, v, backend="reference")
    assert str(e.value) == ("q[0, 0, 0, 0]: expected a float64 value exactly representable in "
                            "float32 (the reference reads float32 inputs), got 0.1")
