"""The golden fixtures shipped with the package, read by flashref's C++ reader.

Each fixture is one case of the contract: the inputs, the masks, the float64 golden O and LSE,
and the tolerances a result must meet (docs/fixtures.md describes the HDF5 layout).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from . import _core

_DATA = Path(__file__).resolve().parent / "fixtures_data"


@dataclass(frozen=True)
class Fixture:
    """One golden case: inputs, masks, golden results and tolerances (read-only numpy arrays).

    Attributes
    ----------
    name, description : str
        The case and what it pins.
    path : str
        The HDF5 file it was read from.
    q, k, v : numpy.ndarray, float32
        ``[B, Hq, Lq, D]``, ``[B, Hk, Lk, D]``, ``[B, Hk, Lk, Dv]``; every value exactly
        representable in ``input_dtype``.
    o, lse : numpy.ndarray, float64
        The golden ``[B, Hq, Lq, Dv]`` output and ``[B, Hq, Lq]`` natural-log LSE (``-inf`` on
        rows with no visible key).
    scale : float
    causal : str or None
        ``None``, ``"bottom_right"`` or ``"top_left"``.
    window : (int or None, int or None) or None
    block_mask : numpy.ndarray of uint8 or None
    block_size : (int, int) or None
    kv_len : numpy.ndarray of int32 or None
    input_dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    atol, rtol, atol_lse : float
        The tolerances (``atol`` already scaled by ``max|V|``).
    trace : dict of numpy.ndarray or None
        For the spec cases: ``m``, ``s``, ``exp_old`` per tile of the spec function.
    do : numpy.ndarray, float32, or None
        The backward's upstream gradient ``[B, Hq, Lq, Dv]``.
    dq, dk, dv : numpy.ndarray, float64, or None
        The golden gradients of ``sum(O * do)``, shaped as q, k and v.
    """

    name: str
    description: str
    path: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    lse: np.ndarray
    scale: float
    causal: Optional[str]
    window: Optional[Tuple[Optional[int], Optional[int]]]
    block_mask: Optional[np.ndarray]
    block_size: Optional[Tuple[int, int]]
    kv_len: Optional[np.ndarray]
    input_dtype: str
    atol: float
    rtol: float
    atol_lse: float
    trace: Optional[Dict[str, np.ndarray]]
    do: Optional[np.ndarray] = None
    dq: Optional[np.ndarray] = None
    dk: Optional[np.ndarray] = None
    dv: Optional[np.ndarray] = None
    handle: Any = field(default=None, repr=False, compare=False)

    def attention_kwargs(self) -> Dict[str, Any]:
        """The masks and scale as keyword arguments of :func:`flashref.attention`."""
        return {
            "scale": self.scale,
            "causal": self.causal,
            "window": self.window,
            "block_mask": self.block_mask,
            "block_size": self.block_size,
            "kv_len": self.kv_len,
        }


def names() -> List[str]:
    """The names of the fixtures shipped with the package, sorted."""
    return sorted(p.stem for p in _DATA.glob("*.h5"))


def path(name: str) -> str:
    """The file of a shipped fixture (ValueError naming the known cases when there is none)."""
    p = _DATA / f"{name}.h5"
    if not p.is_file():
        known = names()
        raise ValueError(
            f"fixture: expected one of the {len(known)} shipped cases (e.g. {known[0]}), "
            f"got {name!r}"
        )
    return str(p)


def load(name_or_path: Union[str, "os.PathLike[str]"]) -> Fixture:
    """Read a fixture with flashref's C++ reader.

    Parameters
    ----------
    name_or_path : str or path-like
        The name of a shipped case (see :func:`names`) or the path of any fixture file.

    Returns
    -------
    Fixture

    Raises
    ------
    ValueError
        No such case or file, or a malformed fixture (the message names the file and field).
    """
    text = os.fspath(name_or_path)
    is_path = text.endswith(".h5") or os.sep in text or os.path.exists(text)
    h = _core.read_fixture(text if is_path else path(text))
    a = h.arrays()
    wl, wr = h.window_left, h.window_right
    window = None if wl < 0 and wr < 0 else (None if wl < 0 else wl, None if wr < 0 else wr)
    block = h.block_q > 0
    trace = None
    if "trace_m" in a:
        trace = {"m": a["trace_m"], "s": a["trace_s"], "exp_old": a["trace_exp_old"]}
    return Fixture(
        name=h.name,
        description=h.description,
        path=h.path,
        q=a["q"],
        k=a["k"],
        v=a["v"],
        o=a["o"],
        lse=a["lse"],
        scale=h.scale,
        causal=None if h.causal == "none" else h.causal,
        window=window,
        block_mask=a.get("block_mask") if block else None,
        block_size=(h.block_q, h.block_k) if block else None,
        kv_len=a.get("kv_len"),
        input_dtype=h.input_dtype,
        atol=h.atol,
        rtol=h.rtol,
        atol_lse=h.atol_lse,
        trace=trace,
        do=a.get("do"),
        dq=a.get("dq"),
        dk=a.get("dk"),
        dv=a.get("dv"),
        handle=h,
    )
