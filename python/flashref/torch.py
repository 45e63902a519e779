"""flashref as a PyTorch operator: ``torch.ops.flashref.attention``, for ``torch.compile``.

``flashref.torch.attention`` takes the arguments of :func:`flashref.attention` on torch tensors
and goes through a ``torch.library`` custom op with a fake (meta) implementation, so that a
compiled model keeps it as one opaque call. Its gradient is the library's backward pass
(``torch.ops.flashref.attention_backward``, a custom op too): autograd and ``torch.compile``
training both go through it, on CPU tensors (the CPU or reference backend) and on CUDA tensors
(the CUDA backward's device entry, in place, on the current stream; the gradients in the
inputs' dtype). LSE is returned as a non-differentiable output.
"""

from typing import Optional, Tuple

import torch

from . import _attention

Tensor = torch.Tensor


@torch.library.custom_op("flashref::attention", mutates_args=())
def _attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: Optional[float],
    causal: str,
    window_left: int,
    window_right: int,
    block_mask: Optional[Tensor],
    block_q: int,
    block_k: int,
    kv_len: Optional[Tensor],
    backend: str,
    blhd: bool,
    deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    # `deterministic` is the backward's (kept by _setup_context); the forward is the same.
    return _attention._attention_torch(
        q, k, v, scale, causal, window_left, window_right, block_mask, block_q, block_k,
        kv_len, backend, blhd, True,
    )


@_attention_op.register_fake
def _attention_fake(q, k, v, scale, causal, window_left, window_right, block_mask, block_q,
                    block_k, kv_len, backend, blhd, deterministic):
    o_shape, lse_shape = _attention._out_shapes(q, v, blhd)
    dtype, lse_dtype = _attention._torch_dtypes(q, backend)
    return q.new_empty(o_shape, dtype=dtype), q.new_empty(lse_shape, dtype=lse_dtype)


@torch.library.custom_op("flashref::attention_backward", mutates_args=())
def _attention_backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    scale: Optional[float],
    causal: str,
    window_left: int,
    window_right: int,
    block_mask: Optional[Tensor],
    block_q: int,
    block_k: int,
    kv_len: Optional[Tensor],
    backend: str,
    blhd: bool,
    deterministic: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    return _attention._attention_backward_torch(
        q, k, v, o, lse, do, scale, causal, window_left, window_right, block_mask, block_q,
        block_k, kv_len, backend, blhd, deterministic,
    )


@_attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, o, lse, do, scale, causal, window_left, window_right,
                             block_mask, block_q, block_k, kv_len, backend, blhd, deterministic):
    dtype = _attention._torch_dtypes(q, backend)[0]
    return (q.new_empty(q.shape, dtype=dtype), k.new_empty(k.shape, dtype=dtype),
            v.new_empty(v.shape, dtype=dtype))


def _setup_context(ctx, inputs, output):
    (q, k, v, scale, causal, wl, wr, block_mask, block_q, block_k, kv_len, backend, blhd,
     deterministic) = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, block_mask, kv_len)
    ctx.options = (scale, causal, wl, wr, block_q, block_k, backend, blhd, deterministic)
    ctx.mark_non_differentiable(lse)  # the library's backward is that of O


def _backward(ctx, grad_o, grad_lse):
    if grad_o is None:  # O did not reach the loss
        return (None,) * 14
    q, k, v, o, lse, block_mask, kv_len = ctx.saved_tensors
    scale, causal, wl, wr, block_q, block_k, backend, blhd, deterministic = ctx.options
    dq, dk, dv = _attention_backward_op(
        q, k, v, o, lse, grad_o, scale, causal, wl, wr, block_mask, block_q, block_k, kv_len,
        backend, blhd, deterministic,
    )
    return (dq, dk, dv) + (None,) * 11


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    causal: Optional[str] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    block_mask: Optional[Tensor] = None,
    block_size=None,
    kv_len: Optional[Tensor] = None,
    backend: str = "auto",
    layout: str = "bhld",
    return_lse: bool = False,
    deterministic: bool = True,
):
    """:func:`flashref.attention` as the custom op ``torch.ops.flashref.attention``.

    Same parameters and results as :func:`flashref.attention` on torch tensors; the call is
    traceable by ``torch.compile`` (a fake implementation gives the output shapes and dtypes).
    ``deterministic`` is that of :func:`flashref.attention_backward`, for the gradient autograd
    takes through the library's backward (``False``: faster on the Hopper kernel where it
    applies, dQ not bitwise repeatable).

    Returns
    -------
    o : torch.Tensor
    lse : torch.Tensor, only with ``return_lse=True``
    """
    causal_s, left, right, block_q, block_k, backend_s, blhd = _attention._options(
        causal, window, block_mask, block_size, backend, layout
    )
    if block_mask is not None and not isinstance(block_mask, Tensor):
        block_mask = torch.as_tensor(block_mask, device=q.device)
    if kv_len is not None and not isinstance(kv_len, Tensor):
        kv_len = torch.as_tensor(kv_len, dtype=torch.int32, device=q.device)
    o, lse = _attention_op(
        q, k, v, scale, causal_s, left, right, block_mask, block_q, block_k, kv_len, backend_s,
        blhd, bool(deterministic),
    )
    return (o, lse) if return_lse else o
