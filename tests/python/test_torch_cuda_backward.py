"""flashref.attention_backward on torch CUDA tensors: the CUDA backward's device entry, in place.

Gradients are judged against the fixtures' golden ones (flashref.check) and against the CPU
backend on the same inputs with SPEC §9's rule; the tests check that nothing is copied (data
pointers, torch's allocator), that the work runs on the caller's current stream, and that
flashref.torch.attention's autograd uses it. Skipped without torch or without a usable CUDA
device (test_backward_device.py checks the refusals on any machine).
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
pytestmark = pytest.mark.skipif(not CUDA, reason="no CUDA device, or the CUDA backend not built")

# SPEC §9: |x - ref| <= rtol max|ref| + rtol |ref|, by input dtype.
RTOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}


def assert_spec9(got, ref, dtype, name=""):
    """got (any device, any float dtype) within SPEC §9's tolerance of ref."""
    g = got.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    assert g.shape == r.shape, name
    rtol = RTOL[dtype]
    allowed = rtol * r.abs().max() + rtol * r.abs()
    bad = ~((g - r).abs() <= allowed)
    assert not bool(bad.any()), (
        f"{name}: {int(bad.sum())} of {g.numel()} outside SPEC §9 ({dtype}), max error "
        f"{float((g - r).abs().max()):.3g}, max|ref| {float(r.abs().max()):.3g}")


def fixture_tensors(fx, dtype=torch.float32):
    """A fixture's q, k, v, do on the GPU in dtype, and its masks as CUDA tensors."""
    q, k, v, do = (torch.from_numpy(np.array(x)).to("cuda", dtype) for x in (fx.q, fx.k, fx.v,
                                                                             fx.do))
    kw = fx.attention_kwargs()
    for key in ("block_mask", "kv_len"):
        if kw[key] is not None:
            kw[key] = torch.from_numpy(np.array(kw[key])).to("cuda")
    return q, k, v, do, kw


def on_cpu(kw):
    return {key: (x.cpu() if isinstance(x, torch.Tensor) else x) for key, x in kw.items()}


def cpu_backward(q, k, v, o, lse, do, **kw):
    """The CPU backend's gradients of the same inputs (widened to float32, exactly)."""
    f = lambda x: x.detach().to("cpu", torch.float32)  # noqa: E731
    return flashref.attention_backward(f(q), f(k), f(v), f(o), f(lse), f(do), **on_cpu(kw),
                                       backend="cpu")


def random_problem(dtype, B=2, Hq=4, Hk=2, Lq=96, Lk=128, D=64, Dv=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, Hk, Lk, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, Hk, Lk, Dv, device="cuda", generator=g).to(dtype)
    do = torch.randn(B, Hq, Lq, Dv, device="cuda", generator=g).to(dtype)
    return q, k, v, do


GRAD_FIXTURES = ["blocksparse_empty_rows", "blocksparse_odd_blocks", "bwd_empty_row_in_tile",
                 "bwd_gqa_empty_row_one_head", "bwd_kv_len_cuts_tile", "bwd_large_scores",
                 "bwd_unseen_key", "causal_lq_gt_lk_top_left", "decode_lq1", "dv_ne_d",
                 "gqa_mqa", "kv_len_zero", "local_window_causal"]


@pytest.mark.parametrize("name", GRAD_FIXTURES)
def test_float32_gradients_meet_the_fixtures_and_the_cpu(name):
    fx = flashref.fixtures.load(name)
    q, k, v, do, kw = fixture_tensors(fx)
    o, lse = flashref.attention(q, k, v, **kw, return_lse=True)
    dq, dk, dv = flashref.attention_backward(q, k, v, o, lse, do, **kw)
    for x, like in ((dq, q), (dk, k), (dv, v)):
        assert isinstance(x, torch.Tensor) and x.device == like.device
        assert x.dtype == torch.float32 and x.shape == like.shape
    assert flashref.check(fx, o, lse, dq=dq, dk=dk, dv=dv)
    for name_, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv),
                                cpu_backward(q, k, v, o, lse, do, **kw)):
        assert_spec9(got, want, torch.float32, name_)


@pytest.mark.parametrize("name,dtype", [("half_inputs_bf16", torch.bfloat16),
                                        ("half_inputs_fp16", torch.float16)])
def test_half_gradients_meet_their_fixtures(name, dtype):
    fx = flashref.fixtures.load(name)
    q, k, v, do, kw = fixture_tensors(fx, dtype)
    o, lse = flashref.attention(q, k, v, **kw, return_lse=True)
    dq, dk, dv = flashref.attention_backward(q, k, v, o, lse, do, **kw)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)  # as O: the input dtype
    assert flashref.check(fx, o, lse, dq=dq, dk=dk, dv=dv)
    for name_, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv),
                                cpu_backward(q, k, v, o, lse, do, **kw)):
        assert_spec9(got, want, dtype, name_)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("masks", ["causal", "block_sparse"])
def test_half_gradients_equal_the_cpu_within_spec9(dtype, D, masks):
    q, k, v, do = random_problem(dtype, D=D, Dv=D, seed=D)
    if masks == "causal":
        kw = {"causal": "bottom_right", "window": (40, None)}
    else:  # a query-block row with no visible key (empty rows) and keys no row sees
        mask = torch.rand(2, 1, 3, 4, generator=torch.Generator().manual_seed(1)) < 0.6
        mask[0, 0, 1] = False
        mask[:, :, :, 3] = False
        kw = {"block_mask": mask.cuda(), "block_size": (32, 32),
              "kv_len": torch.tensor([128, 77], dtype=torch.int32, device="cuda")}
    o, lse = flashref.attention(q, k, v, **kw, return_lse=True)
    grads = flashref.attention_backward(q, k, v, o, lse, do, **kw)
    ref = cpu_backward(q, k, v, o, lse, do, **kw)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert got.dtype == dtype
        assert_spec9(got, want, dtype, name)
        assert bool(((want == 0) <= (got.cpu() == 0)).all()), name  # exact zeros stay exact
    if masks == "block_sparse":
        assert bool((grads[0][0, :, 32:64] == 0).all())  # the empty rows: dQ = 0
        assert bool((grads[1][:, :, 96:] == 0).all()) and bool((grads[2][:, :, 96:] == 0).all())


@pytest.mark.parametrize("D", [64, 128])
def test_deterministic_false_on_long_keys(D):
    """From 4096 keys the Hopper backward may form dQ beside dK and dV (deterministic=False):
    dQ within SPEC §9 of the CPU's, dK and dV the default's bits; through autograd too."""
    q, k, v, do = random_problem(torch.bfloat16, B=1, Hq=2, Hk=1, Lq=64, Lk=4160, D=D, Dv=D,
                                 seed=20 + D)
    kw = {"causal": "bottom_right", "kv_len": torch.tensor([4100], dtype=torch.int32,
                                                            device="cuda")}
    o, lse = flashref.attention(q, k, v, **kw, return_lse=True)
    default = flashref.attention_backward(q, k, v, o, lse, do, **kw)
    fast = flashref.attention_backward(q, k, v, o, lse, do, **kw, deterministic=False)
    ref = cpu_backward(q, k, v, o, lse, do, **kw)
    for name, got, want in zip(("dq", "dk", "dv"), fast, ref):
        assert_spec9(got, want, torch.bfloat16, name)
    torch.testing.assert_close(fast[1], default[1], rtol=0, atol=0)
    torch.testing.assert_close(fast[2], default[2], rtol=0, atol=0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flashref.torch.attention(*leaves, **kw, deterministic=False).backward(do)
    assert_spec9(leaves[0].grad, ref[0], torch.bfloat16, "dq (autograd)")
    torch.testing.assert_close(leaves[1].grad, default[1], rtol=0, atol=0)


def test_float32_o_and_do_with_half_inputs():
    """o and do may be float32 beside bfloat16 inputs (the SIMT kernel reads them)."""
    q, k, v, do = random_problem(torch.bfloat16, seed=3)
    o, lse = flashref.attention(q, k, v, causal="top_left", return_lse=True)
    grads = flashref.attention_backward(q, k, v, o.float(), lse, do.float(), causal="top_left")
    ref = cpu_backward(q, k, v, o, lse, do, causal="top_left")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert got.dtype == torch.bfloat16
        assert_spec9(got, want, torch.bfloat16, name)


def test_strided_views_are_read_in_place():
    """[B, L, H, D] storage read as [B, H, L, D] views (and as blhd): no copy, same bits."""
    store = [x.transpose(1, 2).contiguous() for x in random_problem(torch.bfloat16, seed=4)]
    q, k, v, do = (x.transpose(1, 2) for x in store)  # strided views of the blhd storage
    assert not q.is_contiguous()
    seen = _core.describe(q)
    assert seen["data"] == q.data_ptr() and seen["strides"] == list(q.stride())
    o, lse = flashref.attention(q, k, v, return_lse=True)
    o = o.transpose(1, 2).contiguous().transpose(1, 2)  # O strided as well
    grad_bytes = sum(x.numel() * x.element_size() for x in (q, k, v))

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dq, dk, dv = flashref.attention_backward(q, k, v, o, lse, do)
    torch.cuda.synchronize()
    # torch's allocator saw the three gradients and nothing else: no copy of an input (the
    # workspace comes from the CUDA runtime's stream-ordered pool, not from torch).
    assert torch.cuda.max_memory_allocated() - before == grad_bytes

    contiguous = flashref.attention_backward(*(x.contiguous() for x in (q, k, v, o)), lse,
                                             do.contiguous())
    blhd = flashref.attention_backward(*store[:3], o.transpose(1, 2), lse, store[3],
                                       layout="blhd")
    for got, want, b in zip((dq, dk, dv), contiguous, blhd):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(b.transpose(1, 2), want, rtol=0, atol=0)


def test_runs_on_the_callers_current_stream():
    """The backward reads do after the caller's earlier work on the same stream is done: on
    another stream it would read do before the delayed copy that fills it."""
    q, k, v, want_do = random_problem(torch.bfloat16, seed=5)
    o, lse = flashref.attention(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        do = torch.zeros_like(want_do)
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time on this stream
        do.copy_(want_do)
        dq, dk, dv = flashref.attention_backward(q, k, v, o, lse, do)
        assert torch.cuda.current_stream() == side
    side.synchronize()
    ref = flashref.attention_backward(q, k, v, o, lse, want_do)
    for got, want in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert float(dq.abs().max()) > 0


def test_autograd_on_cuda_uses_the_device_backward():
    fx = flashref.fixtures.load("half_inputs_bf16")
    q, k, v, do, kw = fixture_tensors(fx, torch.bfloat16)
    for x in (q, k, v):
        x.requires_grad_()
    o, lse = flashref.torch.attention(q, k, v, **kw, return_lse=True)
    o.backward(do)
    for x in (q, k, v):
        assert x.grad is not None and x.grad.dtype == torch.bfloat16 and x.grad.is_cuda
    assert flashref.check(fx, o, lse, dq=q.grad, dk=k.grad, dv=v.grad)
    direct = flashref.attention_backward(q, k, v, o, lse, do, **kw)
    for x, want in zip((q, k, v), direct):
        torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def test_autograd_with_a_broadcast_upstream_gradient():
    """o.sum().backward() hands the backward an upstream gradient expanded from a scalar."""
    q, k, v, _ = random_problem(torch.float16, seed=6)
    for x in (q, k, v):
        x.requires_grad_()
    o, lse = flashref.torch.attention(q, k, v, causal="bottom_right", return_lse=True)
    o.sum().backward()
    ref = cpu_backward(q, k, v, o, lse, torch.ones_like(o), causal="bottom_right")
    for name, x, want in zip(("dq", "dk", "dv"), (q, k, v), ref):
        assert_spec9(x.grad, want, torch.float16, name)


def test_autograd_under_torch_compile_on_cuda():
    q, k, v, _ = random_problem(torch.bfloat16, Lq=128, seed=7)
    for x in (q, k, v):
        x.requires_grad_()

    def loss(q, k, v):
        return flashref.torch.attention(q, k, v, causal="top_left").float().square().sum()

    loss(q, k, v).backward()
    eager = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch.compile(loss, fullgraph=True)(q, k, v).backward()
    for x, e in zip((q, k, v), eager):
        torch.testing.assert_close(x.grad, e, rtol=0, atol=0)


def test_backward_op_is_well_formed_on_cuda():
    q, k, v, do = random_problem(torch.bfloat16, B=1, Hq=2, Hk=1, Lq=32, Lk=32, seed=8)
    o, lse = flashref.attention(q, k, v, return_lse=True)
    args = (q, k, v, o, lse, do, None, "none", -1, -1, None, 0, 0, None, "cuda", False, True)
    torch.library.opcheck(torch.ops.flashref.attention_backward.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_errors_on_cuda_tensors():
    q, k, v, do = random_problem(torch.bfloat16, B=1, Hq=2, Hk=1, Lq=32, Lk=32, seed=9)
    o, lse = flashref.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError) as e:
        flashref.attention_backward(q, k, v, o, lse, do, backend="cpu")
    assert str(e.value) == ("q: expected host memory for backend cpu, got cuda:0 "
                            "(device memory: cuda)")
    with pytest.raises(TypeError) as e:
        flashref.attention_backward(q, k, v, o, lse, do.cpu())
    assert str(e.value) == "do: expected the device of q (cuda:0), got cpu"
    with pytest.raises(TypeError) as e:
        flashref.attention_backward(q, k, v, o, lse, do.half())
    assert str(e.value) == "do: expected dtype float32 or bfloat16 (the dtype of q), got float16"
    with pytest.raises(ValueError) as e:
        flashref.attention_backward(q, k, v, o, lse[:, :, :5], do)
    assert str(e.value).startswith("lse: expected shape [1, 2, 32]")
    with pytest.raises(ValueError) as e:
        flashref.attention_backward(q, k, v, o, None, do)
    assert str(e.value) == "lse: expected the forward's LSE for the backward, got None"
