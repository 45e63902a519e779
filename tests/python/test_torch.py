"""torch tensors in and out: CPU and CUDA, the custom op under torch.compile, zero copy.

Skipped where torch is not installed; the CUDA tests where no CUDA device is usable.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashref  # noqa: E402
import flashref.torch  # noqa: E402
from flashref import _core  # noqa: E402

CUDA = torch.cuda.is_available() and any(
    b.name == "cuda" and b.available for b in flashref.backends()
)
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device, or the CUDA backend not built")


def tensors(fx, device="cpu", dtype=torch.float32):
    q, k, v = (torch.from_numpy(np.array(x)).to(device=device, dtype=dtype) for x in (fx.q, fx.k, fx.v))
    kw = fx.attention_kwargs()
    if kw["block_mask"] is not None:
        kw["block_mask"] = torch.from_numpy(np.array(kw["block_mask"])).to(device)
    if kw["kv_len"] is not None:
        kw["kv_len"] = torch.from_numpy(np.array(kw["kv_len"])).to(device)
    return q, k, v, kw


def test_cpu_tensors_in_torch_out():
    fx = flashref.fixtures.load("blocksparse_empty_rows")
    q, k, v, kw = tensors(fx)
    o, lse = flashref.attention(q, k, v, **kw, backend="cpu", return_lse=True)
    assert isinstance(o, torch.Tensor) and o.device.type == "cpu" and o.dtype == torch.float32
    on, lsen = flashref.attention(fx.q, fx.k, fx.v, **fx.attention_kwargs(), backend="cpu",
                                  return_lse=True)
    np.testing.assert_array_equal(o.numpy(), on)
    np.testing.assert_array_equal(lse.numpy(), lsen)
    assert flashref.check(fx, o, lse)


def test_strided_tensors_are_read_in_place():
    base = torch.randn(1, 64, 4, 32)  # [B, L, H, D] storage
    q = base[:, :, :, :16].transpose(1, 2)  # strided [B, H, L, D] view
    seen = _core.describe(q)
    assert seen["data"] == q.data_ptr() and seen["strides"] == list(q.stride())
    k, v = torch.randn(1, 4, 64, 16), torch.randn(1, 4, 64, 16)
    torch.testing.assert_close(flashref.attention(q, k, v), flashref.attention(q.contiguous(), k, v),
                               rtol=0, atol=0)


def test_tensors_that_require_grad_are_read_without_a_copy():
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    assert _core.describe(q)["data"] == q.data_ptr()
    o = flashref.attention(q, k, v)
    assert o.shape == (1, 2, 16, 8) and not o.requires_grad


def test_tensors_are_read_through_torchs_c_exporter(monkeypatch):
    # The binding imports tensors with torch.utils.dlpack.to_dlpack (C code), not through
    # Tensor.__dlpack__ (Python code that queries devices and streams, microseconds per tensor).
    fx = flashref.fixtures.load("blocksparse_empty_rows")
    q, k, v, kw = tensors(fx)
    flashref.attention(q, k, v, **kw)  # the binding's first call looks torch's objects up

    calls = []
    dlpack = torch.Tensor.__dlpack__

    def counted(self, *args, **kwargs):
        calls.append(self.shape)
        return dlpack(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "__dlpack__", counted)
    o, lse = flashref.attention(q, k, v, **kw, backend="cpu", return_lse=True)
    dq, dk, dv = flashref.attention_backward(q, k, v, o, lse, torch.ones_like(o), **kw,
                                             backend="cpu")
    assert calls == []
    assert flashref.check(fx, o, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_outputs_are_new_tensors_on_q_s_device():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    o = flashref.attention(q, k, v)
    assert type(o) is torch.Tensor and o.is_contiguous() and o.dtype == torch.float32
    o, lse = flashref.attention(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 16) and lse.dtype == torch.float32
    assert o.data_ptr() not in (q.data_ptr(), lse.data_ptr())
    # blhd: O in q's layout; LSE [B, H, L].
    o, lse = flashref.attention(q, k, v, layout="blhd", return_lse=True)
    assert o.shape == (1, 2, 16, 8) and lse.shape == (1, 16, 2)
    # float64 on the reference backend: O and LSE float64; the gradients too.
    q64, k64, v64 = (x.double() for x in (q, k, v))
    o, lse = flashref.attention(q64, k64, v64, backend="reference", return_lse=True)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    grads = flashref.attention_backward(q64, k64, v64, o, lse, torch.ones_like(o),
                                        backend="reference")
    assert all(g.dtype == torch.float64 for g in grads)
    # mixed kinds: q decides (a numpy k is read in place, the result is a tensor).
    assert type(flashref.attention(q, k.numpy(), v)) is torch.Tensor
    with pytest.raises(TypeError) as e:
        flashref.attention(q, k.tolist(), v)
    assert str(e.value) == "k: expected a numpy array or a torch tensor, got list"


def test_custom_op_is_well_formed():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    args = (q, k, v, None, "bottom_right", -1, -1, None, 0, 0, None, "cpu", False, True)
    torch.library.opcheck(torch.ops.flashref.attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_custom_op_under_torch_compile():
    fx = flashref.fixtures.load("causal_lq_gt_lk")
    q, k, v, kw = tensors(fx)

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return flashref.torch.attention(q, k, v, **kw, return_lse=True)

    o, lse = f(q, k, v)
    assert flashref.check(fx, o, lse)


@needs_cuda
@pytest.mark.parametrize("name", ["blocksparse_empty_rows", "causal_lq_gt_lk", "gqa", "kv_len_zero",
                                  "local_window", "dv_ne_d"])
def test_cuda_float32_meets_the_fixtures(name):
    fx = flashref.fixtures.load(name)
    q, k, v, kw = tensors(fx, "cuda")
    o, lse = flashref.attention(q, k, v, **kw, return_lse=True)
    assert o.device.type == "cuda" and o.dtype == torch.float32
    assert flashref.check(fx, o, lse)


@needs_cuda
@pytest.mark.parametrize("suffix,dtype", [("_bf16", torch.bfloat16), ("_fp16", torch.float16)])
@pytest.mark.parametrize("case", ["blocksparse_empty_rows", "causal_square", "gqa"])
def test_cuda_half_inputs_meet_their_fixtures(case, suffix, dtype):
    fx = flashref.fixtures.load(case + suffix)
    q, k, v, kw = tensors(fx, "cuda", dtype)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the caller's current stream
        o, lse = flashref.attention(q, k, v, **kw, return_lse=True)
    stream.synchronize()
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert flashref.check(fx, o, lse)


@needs_cuda
def test_cuda_stream_is_the_current_one():
    from flashref._attention import _current_stream

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert _current_stream(torch, 0) == stream.cuda_stream
        assert _current_stream(torch, 0) == torch.cuda.current_stream(0).cuda_stream
    assert _current_stream(torch, 0) == torch.cuda.current_stream(0).cuda_stream


@needs_cuda
def test_cuda_blhd_layout_and_compile():
    q, k, v = (torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = flashref.attention(q, k, v, layout="blhd", causal="bottom_right")
    assert o.shape == (2, 128, 4, 64)
    ref = flashref.attention(*(x.transpose(1, 2) for x in (q, k, v)), causal="bottom_right")
    torch.testing.assert_close(o.transpose(1, 2), ref, rtol=0, atol=0)
    f = torch.compile(lambda q, k, v: flashref.torch.attention(q, k, v, layout="blhd",
                                                               causal="bottom_right"))
    torch.testing.assert_close(f(q, k, v), o, rtol=0, atol=0)


@needs_cuda
def test_cuda_tensors_on_a_host_backend_say_who_takes_them():
    q = torch.randn(1, 1, 8, 8, device="cuda")
    with pytest.raises(TypeError) as e:
        flashref.attention(q, q, q, backend="cpu")
    assert str(e.value) == "q: expected host memory for backend cpu, got cuda:0 (device memory: cuda)"
    with pytest.raises(TypeError) as e:
        flashref.attention(q, q.cpu(), q)
    assert str(e.value) == "k: expected the device of q (cuda:0), got cpu"


def test_half_tensors_on_the_cpu_say_who_takes_them():
    q = torch.randn(1, 1, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError) as e:
        flashref.attention(q, q, q)
    assert str(e.value).startswith("q: expected dtype float32 in host memory, got bfloat16 "
                                   "(bfloat16 inputs: in device memory on ")


def exact(shape, seed, requires_grad=True):
    """float64 values on a 1/64 grid: float32 holds them, and them after a ±2^-12 step."""
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(shape, generator=g, dtype=torch.float64) * 32) / 64
    return x.requires_grad_(requires_grad)


MASK = torch.tensor([[[[1, 0], [1, 1]]]], dtype=torch.bool)  # (1, 1, 2, 2) over 4 x 3 blocks


def masked(q, k, v, backend):
    # Lq = 8 > Lk = 6, bottom-right causal: rows 0 and 1 see no key (their gradients are 0).
    return flashref.torch.attention(q, k, v, causal="bottom_right", block_mask=MASK,
                                    block_size=(4, 3), backend=backend)


def test_gradcheck_float64_on_the_reference_backend():
    q, k, v = exact((1, 2, 8, 4), 0), exact((1, 1, 6, 4), 1), exact((1, 1, 6, 3), 2)
    assert torch.autograd.gradcheck(lambda q, k, v: masked(q, k, v, "reference"), (q, k, v),
                                    eps=2.0**-12, atol=1e-5, rtol=1e-3)


def test_autograd_on_the_cpu_meets_the_backward_tolerance():
    ref = [exact(s, i) for i, s in enumerate([(1, 2, 8, 4), (1, 1, 6, 4), (1, 1, 6, 3)])]
    cpu = [x.detach().float().requires_grad_() for x in ref]
    do = torch.round(torch.randn(1, 2, 8, 3, generator=torch.Generator().manual_seed(5)) * 64) / 64
    masked(*cpu, "cpu").backward(do)
    masked(*ref, "reference").backward(do.double())
    for name, got, want in zip("qkv", cpu, ref):
        g, r = got.grad.double(), want.grad
        allowed = 1e-4 * r.abs().max() + 1e-4 * r.abs()  # SPEC §9, float32 inputs
        assert bool(((g - r).abs() <= allowed).all()), name
    assert bool((cpu[0].grad[:, :, :2] == 0).all())  # the empty rows


def test_autograd_under_torch_compile():
    q, k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3))

    def loss(q, k, v):
        return flashref.torch.attention(q, k, v, causal="top_left").square().sum()

    loss(q, k, v).backward()
    eager = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch.compile(loss, fullgraph=True)(q, k, v).backward()
    for x, e in zip((q, k, v), eager):
        torch.testing.assert_close(x.grad, e, rtol=1e-6, atol=1e-7)


def test_deterministic_false_changes_nothing_on_the_cpu():
    """Host backends are deterministic whatever is asked: the opt-in gives the same bits, through
    flashref.attention_backward and through autograd."""
    q, k, v, do = (torch.randn(1, 2, 48, 16, generator=torch.Generator().manual_seed(s))
                   for s in range(4))
    kw = {"causal": "bottom_right", "window": (20, None)}
    o, lse = flashref.attention(q, k, v, **kw, return_lse=True)
    want = flashref.attention_backward(q, k, v, o, lse, do, **kw)
    got = flashref.attention_backward(q, k, v, o, lse, do, **kw, deterministic=False)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    got_np = flashref.attention_backward(*(x.numpy() for x in (q, k, v, o, lse, do)), **kw,
                                         deterministic=False)
    for g, w in zip(got_np, want):
        assert np.array_equal(g, w.numpy())
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flashref.torch.attention(*leaves, **kw, deterministic=False).backward(do)
    for x, w in zip(leaves, want):
        assert torch.equal(x.grad, w)


def test_backward_op_is_well_formed():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    o, lse = flashref.attention(q, k, v, return_lse=True)
    args = (q, k, v, o, lse, torch.randn_like(o), None, "none", -1, -1, None, 0, 0, None, "cpu",
            False, True)
    torch.library.opcheck(torch.ops.flashref.attention_backward.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    fwd = (q.requires_grad_(), k, v, None, "none", -1, -1, None, 0, 0, None, "cpu", False, True)
    torch.library.opcheck(torch.ops.flashref.attention.default, fwd,
                          test_utils=("test_autograd_registration",))
