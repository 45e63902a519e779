"""flashref.attention and flashref.merge over numpy arrays and torch tensors, without copies."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core

_CAUSAL = {
    None: "none",
    False: "none",
    "none": "none",
    True: "bottom_right",
    "bottom_right": "bottom_right",
    "top_left": "top_left",
}
_BACKEND = {
    "auto": "automatic",
    "automatic": "automatic",
    "reference": "reference",
    "cpu": "cpu",
    "cuda": "cuda",
}
_LAYOUT = {"bhld": False, "blhd": True}


class BackendInfo(NamedTuple):
    """One backend of the library: whether it is built and usable now, and its input dtypes."""

    name: str
    built: bool
    available: bool
    reason: str
    dtypes: Tuple[str, ...]


def backends() -> list[BackendInfo]:
    """The concrete backends (reference, cpu, cuda), in that order.

    Returns
    -------
    list of BackendInfo
        ``available`` is False with a ``reason`` when a backend is not built into this package
        or, for CUDA, when no device is present. ``dtypes`` lists the input dtypes the backend
        has a path of its own for.
    """
    return [
        BackendInfo(b["name"], b["built"], b["available"], b["reason"], tuple(b["dtypes"]))
        for b in _core.backends()
    ]


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _options(causal, window, block_mask, block_size, backend, layout):
    """The keyword arguments of attention() as the core takes them (ValueError on a bad one).

    Plain lookups and checks only, so that torch.compile traces it without a graph break.
    """
    causal_s = _CAUSAL.get(causal) if causal is None or isinstance(causal, (str, bool)) else None
    if causal_s is None:
        raise ValueError(f"causal: expected None, 'bottom_right' or 'top_left', got {causal!r}")
    backend_s = _BACKEND.get(backend) if isinstance(backend, str) else None
    if backend_s is None:
        raise ValueError(f"backend: expected one of auto, reference, cpu, cuda, got {backend!r}")
    blhd = _LAYOUT.get(layout) if isinstance(layout, str) else None
    if blhd is None:
        raise ValueError(f"layout: expected 'bhld' or 'blhd', got {layout!r}")
    if window is None:
        left = right = -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(
                f"window: expected None or (left, right), each an int >= 0 or None, got {window!r}"
            )
        left = -1 if window[0] is None else int(window[0])
        right = -1 if window[1] is None else int(window[1])
        if left < -1 or right < -1:
            raise ValueError(f"window: expected sizes >= 0 or None, got {window!r}")
    if block_mask is None:
        if block_size is not None:
            raise ValueError(f"block_size: expected None without a block_mask, got {block_size!r}")
        block_q = block_k = 0
    elif block_size is None:
        raise ValueError(
            "block_size: expected an int or (block_q, block_k) with a block_mask, got None"
        )
    elif isinstance(block_size, (int, np.integer)):
        block_q = block_k = int(block_size)
    elif isinstance(block_size, (tuple, list)) and len(block_size) == 2:
        block_q, block_k = int(block_size[0]), int(block_size[1])
    else:
        raise ValueError(f"block_size: expected an int or (block_q, block_k), got {block_size!r}")
    return causal_s, left, right, block_q, block_k, backend_s, blhd


def _out_shapes(q, v, blhd: bool):
    if q.ndim != 4:
        dims = "(B, L, H, D)" if blhd else "(B, H, L, D)"
        raise ValueError(
            f"q: expected 4 dimensions {dims}, got {q.ndim} (shape {_shape_text(q.shape)})"
        )
    if v.ndim != 4:
        dims = "(B, L, H, Dv)" if blhd else "(B, H, L, Dv)"
        raise ValueError(
            f"v: expected 4 dimensions {dims}, got {v.ndim} (shape {_shape_text(v.shape)})"
        )
    B, d1, d2 = q.shape[0], q.shape[1], q.shape[2]
    Dv = v.shape[3]
    Hq, Lq = (d2, d1) if blhd else (d1, d2)
    return (B, d1, d2, Dv), (B, Hq, Lq)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and "torch" in sys.modules


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Optional[float] = None,
    causal: Union[None, str] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    block_mask: Any = None,
    block_size: Union[None, int, Tuple[int, int]] = None,
    kv_len: Any = None,
    backend: str = "auto",
    layout: str = "bhld",
    return_lse: bool = False,
):
    """Attention with flashref's meaning of every masked and empty case.

    Parameters
    ----------
    q, k, v : numpy.ndarray or torch.Tensor
        Query ``[B, Hq, Lq, D]``, key ``[B, Hk, Lk, D]`` and value ``[B, Hk, Lk, Dv]`` (with
        ``layout="blhd"``: ``[B, L, H, D]``), any strides; read in place, never copied.
        ``Hq`` must be a multiple of ``Hk`` (GQA/MQA). float32 on every backend; torch tensors
        on a CUDA device may also be bfloat16 or float16; with ``backend="reference"``, float64
        arrays holding float32 values (the naive float64 reference, for gradient checks).
    scale : float, optional
        Score scale; default ``1 / sqrt(D)``.
    causal : {None, "bottom_right", "top_left"}, optional
        Causal mask: key ``j`` is visible to query ``i`` iff ``j <= i + (Lk - Lq)``
        (bottom-right) or ``j <= i`` (top-left). ``True`` means ``"bottom_right"``.
    window : (int or None, int or None), optional
        Local window ``(left, right)`` around the (bottom-right aligned) diagonal; ``None`` on a
        side leaves it unbounded.
    block_mask : array, optional
        Boolean or uint8 ``[Bm, Hm, ceil(Lq / block_q), ceil(Lk / block_k)]`` with ``Bm`` in
        ``{1, B}`` and ``Hm`` in ``{1, Hq}``; non-zero means visible.
    block_size : int or (int, int), optional
        ``block_q`` and ``block_k`` of the block mask (any positive sizes); required with it.
    kv_len : array of int32, optional
        ``[B]`` key lengths: keys ``j >= kv_len[b]`` are invisible.
    backend : {"auto", "reference", "cpu", "cuda"}
        ``"auto"`` runs CUDA tensors on the CUDA backend, host memory on CUDA when it is built
        and a device is present, else on the CPU backend.
    layout : {"bhld", "blhd"}
        How q, k, v and the returned O are stored: ``[B, H, L, D]`` or ``[B, L, H, D]``.
    return_lse : bool
        Also return the log-sum-exp of each row.

    Returns
    -------
    o : same kind as q
        ``[B, Hq, Lq, Dv]`` (``[B, Lq, Hq, Dv]`` with ``layout="blhd"``): a numpy array for numpy
        inputs, a torch tensor on q's device for torch inputs (computed on the current CUDA
        stream). float32, or q's dtype for bfloat16/float16 CUDA tensors, float64 for float64
        inputs on the reference backend.
    lse : same kind as q, float32 (float64 as O is), only with ``return_lse=True``
        ``[B, Hq, Lq]``, natural log; ``-inf`` on rows with no visible key (where ``O = 0``).

    Raises
    ------
    ValueError
        A malformed problem; the message names the field, the expected and the actual value.
    TypeError
        A dtype or device the chosen backend does not take; the message says which would.
    """
    causal_s, left, right, block_q, block_k, backend_s, blhd = _options(
        causal, window, block_mask, block_size, backend, layout
    )
    if type(q) is np.ndarray:
        # The core allocates O (and LSE) as numpy arrays: float32, float64 for float64 inputs on
        # the reference backend, which computes in float64 (see gradcheck).
        if block_mask is not None or kv_len is not None:
            block_mask, kv_len = _numpy_masks(block_mask, kv_len)
        return _core.attention(
            q, k, v, scale, causal_s, left, right, block_mask, block_q, block_k, kv_len,
            backend_s, blhd, return_lse, 0,
        )
    if _is_torch(q):
        return _attention_torch(
            q, k, v, scale, causal_s, left, right, block_mask, block_q, block_k, kv_len,
            backend_s, blhd, return_lse,
        )
    raise TypeError(f"q: expected a numpy array or a torch tensor, got {type(q).__name__}")


def _numpy_masks(block_mask, kv_len):
    if block_mask is not None and type(block_mask) is not np.ndarray:
        block_mask = np.asarray(block_mask)
    if kv_len is not None and (type(kv_len) is not np.ndarray or kv_len.dtype != np.int32):
        kv_len = np.asarray(kv_len, dtype=np.int32)
    return block_mask, kv_len


def _torch_masks(q, block_mask, kv_len):
    import torch

    if block_mask is not None:
        block_mask = torch.as_tensor(block_mask, device=q.device)
    if kv_len is not None:
        kv_len = torch.as_tensor(kv_len, dtype=torch.int32, device=q.device)
    return block_mask, kv_len


def _attention_torch(q, k, v, scale, causal_s, left, right, block_mask, block_q, block_k,
                     kv_len, backend_s, blhd, return_lse):
    # The core reads the tensors through torch's C DLPack exporter and allocates O (and LSE)
    # with torch.empty on q's device, in the dtypes of _torch_dtypes.
    if block_mask is not None or kv_len is not None:
        block_mask, kv_len = _torch_masks(q, block_mask, kv_len)
    args = (q, k, v, scale, causal_s, left, right, block_mask, block_q, block_k, kv_len,
            backend_s, blhd, return_lse)
    if q.is_cuda:
        return _on_device(q, _core.attention, args)
    return _core.attention(*args, 0)


def _on_device(q, entry, args):
    """entry(*args, stream) with q's device current, on its current stream (the caller's)."""
    import torch

    index = q.get_device()
    stream = _current_stream(torch, index)
    if index == torch.cuda.current_device():
        return entry(*args, stream)
    with torch.cuda.device(index):
        return entry(*args, stream)


def _current_stream(torch, index):
    """The handle (cudaStream_t) of the current stream of CUDA device `index`:
    ``torch.cuda.current_stream(index).cuda_stream``, read by the C function behind it where torch
    has one (torch.cuda.current_stream builds a Stream object on every call)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(index)
    return torch.cuda.current_stream(index).cuda_stream


def _torch_dtypes(q, backend_s):
    """The dtypes of O and LSE for q: on a CUDA device O has q's dtype (float32, bfloat16,
    float16); in host memory float32, or float64 on the reference backend. (The core allocates
    the outputs by the same rule; flashref.torch's fake implementations use this one.)"""
    import torch

    if q.device.type == "cuda":
        return q.dtype, torch.float32
    if q.dtype == torch.float64 and backend_s == "reference":
        return torch.float64, torch.float64
    return torch.float32, torch.float32


def attention_backward(
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    do: Any,
    *,
    scale: Optional[float] = None,
    causal: Union[None, str] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    block_mask: Any = None,
    block_size: Union[None, int, Tuple[int, int]] = None,
    kv_len: Any = None,
    backend: str = "auto",
    layout: str = "bhld",
    deterministic: bool = True,
):
    """The backward pass: the gradients of ``sum(O * dO)`` with respect to q, k and v.

    Parameters
    ----------
    q, k, v, scale, causal, window, block_mask, block_size, kv_len, layout
        The forward's inputs, as for :func:`attention`.
    o, lse : array_like
        The forward's results (``attention(..., return_lse=True)``), read, not recomputed: the
        probabilities are rebuilt from LSE (rows with ``LSE = -inf`` get zero gradients).
    do : array_like
        The upstream gradient, shaped as ``o``.
    backend : {"auto", "reference", "cpu", "cuda"}
        ``"auto"`` runs CUDA tensors on the CUDA backend (the only one that takes device
        memory) and host memory on the first available backend with a backward pass.
    deterministic : bool
        ``True`` (the default): the same gradient bits on every run (the CUDA backward on
        compute capability 9.0 adds dQ's parts in fixed point where the rows see 2048 keys
        or more on average, with a block mask where they can see 8192: docs/backends.md).
        ``False`` lets it add them as float32 in whatever order they finish (bf16 / fp16,
        D = 64 or 128, from 2048 keys; 8192 with a block mask): faster there, dQ within the
        same tolerance but not bitwise repeatable, dK and dV unchanged. Elsewhere it changes
        nothing.

    Returns
    -------
    dq, dk, dv : same kind as q
        Shaped as q, k and v: numpy arrays for numpy inputs, torch tensors on q's device for
        torch inputs (on a CUDA device: computed on the current CUDA stream, every input read
        in place). dtype: q's for CUDA tensors (float32, bfloat16 or float16, as O of
        :func:`attention`), else float32 (float64 for float64 inputs on the reference
        backend).

    Notes
    -----
    On CUDA tensors, o and do may be float32 or q's dtype, lse is float32. bfloat16 and
    float16 inputs with D = Dv in {64, 128}, unit stride along D and 16-byte rows run a
    tensor-core backward when do has q's dtype (the wgmma one on compute capability 9.0),
    others the float32-arithmetic SIMT kernel.
    The device entry does not scan its inputs for NaN or inf (the host entry does); see
    docs/backends.md.

    Raises
    ------
    ValueError, TypeError
        As :func:`attention`; also for a backend without a backward pass, and for a device
        tensor on a host backend (``backend="cpu"`` or ``"reference"``).
    """
    causal_s, left, right, block_q, block_k, backend_s, blhd = _options(
        causal, window, block_mask, block_size, backend, layout
    )
    if type(q) is np.ndarray:
        if block_mask is not None or kv_len is not None:
            block_mask, kv_len = _numpy_masks(block_mask, kv_len)
        return _core.attention_backward(
            q, k, v, o, lse, do, scale, causal_s, left, right, block_mask, block_q, block_k,
            kv_len, backend_s, blhd, bool(deterministic), 0,
        )
    if _is_torch(q):
        return _attention_backward_torch(
            q, k, v, o, lse, do, scale, causal_s, left, right, block_mask, block_q, block_k,
            kv_len, backend_s, blhd, bool(deterministic),
        )
    raise TypeError(f"q: expected a numpy array or a torch tensor, got {type(q).__name__}")


def _attention_backward_torch(q, k, v, o, lse, do, scale, causal_s, left, right, block_mask,
                              block_q, block_k, kv_len, backend_s, blhd, deterministic=True):
    # dq, dk, dv allocated by the core as O is (_torch_dtypes); on a CUDA device the device entry,
    # in place, on the caller's current stream of q's device.
    if block_mask is not None or kv_len is not None:
        block_mask, kv_len = _torch_masks(q, block_mask, kv_len)
    args = (q, k, v, o, lse, do, scale, causal_s, left, right, block_mask, block_q, block_k,
            kv_len, backend_s, blhd, deterministic)
    if q.is_cuda:
        return _on_device(q, _core.attention_backward, args)
    return _core.attention_backward(*args, 0)


def merge(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any):
    """Merge two partial results over disjoint key sets (SPEC §5).

    ``LSE = logaddexp(LSE_a, LSE_b)`` and ``O = O_a exp(LSE_a - LSE) + O_b exp(LSE_b - LSE)``,
    with the identity ``(0, -inf)``: merging with an empty part returns the other part, and two
    empty parts give ``(0, -inf)`` — never NaN.

    Parameters
    ----------
    o_a, o_b : array_like, shape ``[..., Dv]``
        The partial outputs, float32 or float64 (both the same).
    lse_a, lse_b : array_like, shape ``[...]``
        Their natural-log LSE, ``-inf`` for an empty part.

    Returns
    -------
    o, lse : numpy.ndarray (torch.Tensor for torch inputs, on the CPU)
        The merged result, in the inputs' dtype.
    """
    torch_in = _is_torch(o_a)
    if torch_in:
        o_a, lse_a, o_b, lse_b = (t.detach().cpu().numpy() for t in (o_a, lse_a, o_b, lse_b))
    arrays = [np.ascontiguousarray(x) for x in (o_a, lse_a, o_b, lse_b)]
    o_a, lse_a, o_b, lse_b = arrays
    if o_a.ndim < 1 or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"lse_a: expected shape {_shape_text(o_a.shape[:-1])} (o_a without its last "
            f"dimension), got {_shape_text(lse_a.shape)}"
        )
    if o_b.shape != o_a.shape:
        raise ValueError(
            f"o_b: expected shape {_shape_text(o_a.shape)} (that of o_a), got "
            f"{_shape_text(o_b.shape)}"
        )
    if lse_b.shape != lse_a.shape:
        raise ValueError(
            f"lse_b: expected shape {_shape_text(lse_a.shape)} (that of lse_a), got "
            f"{_shape_text(lse_b.shape)}"
        )
    o = np.empty_like(o_a)
    lse = np.empty_like(lse_a)
    _core.merge_into(o_a, lse_a, o_b, lse_b, o, lse)
    if torch_in:
        import torch

        return torch.from_numpy(o), torch.from_numpy(lse)
    return o, lse
