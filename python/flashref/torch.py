"""flashref as a PyTorch operator: ``torch.ops.flashref.attention``, for ``torch.compile``.

``flashref.torch.attention`` takes the arguments of :func:`flashref.attention` on torch tensors
and goes through a ``torch.library`` custom op with a fake (meta) implementation, so that a
compiled model keeps it as one opaque call.
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
) -> Tuple[Tensor, Tensor]:
    return _attention._attention_torch(
        q, k, v, scale, causal, window_left, window_right, block_mask, block_q, block_k,
        kv_len, backend, blhd, True,
    )


@_attention_op.register_fake
def _attention_fake(q, k, v, scale, causal, window_left, window_right, block_mask, block_q,
                    block_k, kv_len, backend, blhd):
    o_shape, lse_shape = _attention._out_shapes(q, v, blhd)
    dtype, lse_dtype = _attention._torch_dtypes(q, backend)
    return q.new_empty(o_shape, dtype=dtype), q.new_empty(lse_shape, dtype=lse_dtype)


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
):
    """:func:`flashref.attention` as the custom op ``torch.ops.flashref.attention``.

    Same parameters and results as :func:`flashref.attention` on torch tensors; the call is
    traceable by ``torch.compile`` (a fake implementation gives the output shapes and dtypes).

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
        blhd,
    )
    return (o, lse) if return_lse else o
