"""flashref — tiled attention with block-sparse and causal masks, defined by an exact reference.

The package calls flashref's C++ library on numpy arrays and torch tensors in place:

- :func:`attention` — O (and LSE) of ``softmax(scale * Q K^T) V`` under the masks; rows that see
  no key give ``O = 0`` and ``LSE = -inf``, never NaN.
- :func:`attention_backward` — dQ, dK, dV from the forward's O and LSE (SPEC §9).
- :func:`merge` — combine two partial results over disjoint key sets.
- :mod:`flashref.fixtures` — the golden HDF5 fixtures shipped with the package.
- :func:`check` — judge any kernel's result against a fixture, as ``flashref check`` does.
- :mod:`flashref.torch` — a ``torch.library`` custom op (``torch.compile``, autograd).

See docs/python.md in the source tree.
"""

from . import fixtures
from ._attention import BackendInfo, attention, attention_backward, backends, merge
from ._check import CheckReport, check

__version__ = "0.1.0"

__all__ = [
    "BackendInfo",
    "CheckReport",
    "attention",
    "attention_backward",
    "backends",
    "check",
    "fixtures",
    "merge",
]
