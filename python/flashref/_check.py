"""flashref.check: the judge of `flashref check` on a result held in Python."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Union

import numpy as np

from . import _core
from .fixtures import Fixture, load


class CheckReport:
    """The verdict of one result against one fixture, worded as ``flashref check`` words it.

    ``bool(report)`` is ``report.passed``; ``str(report)`` is the CLI's table row with the
    tolerances applied, so ``assert report, report`` shows why a result fails.
    """

    def __init__(self, row: Any):
        self._row = row

    @property
    def passed(self) -> bool:
        """True when every row meets the contract."""
        return self._row.verdict == "pass"

    @property
    def verdict(self) -> str:
        """``"pass"`` or ``"fail"``."""
        return self._row.verdict

    @property
    def message(self) -> str:
        """Why the result fails (empty when it passes with an LSE judged)."""
        return self._row.message

    @property
    def hints(self) -> List[str]:
        """Convention slips recognised in a failing result (a base-2 LSE, half storage)."""
        return list(self._row.hints)

    @property
    def gradients_judged(self) -> str:
        """The gradients judged, ``"dq,dk,dv"`` or a part of it, ``"-"`` for none."""
        return self._row.gradients_judged

    @property
    def fixture(self) -> str:
        return self._row.fixture

    @property
    def counts(self) -> Dict[str, Any]:
        """Rows, empty rows, NaN/inf/wrong rows, bad elements and the error ratios."""
        return dict(self._row.counts)

    @property
    def tolerance(self) -> Dict[str, float]:
        return {"atol": self._row.atol, "rtol": self._row.rtol, "atol_lse": self._row.atol_lse}

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        return self._row.table()

    def __repr__(self) -> str:
        return f"CheckReport({self.fixture}: {self.verdict.upper()})\n{self._row.table()}"


def _as_float64(x: Any, layout: str):
    """x as C-contiguous float64 numpy, with the name of the dtype it was stored in."""
    if type(x).__module__.startswith("torch"):
        dtype = str(x.dtype).replace("torch.", "")
        x = x.detach().to("cpu").double().numpy()
    else:
        x = np.asarray(x)
        dtype = x.dtype.name
    if layout == "blhd" and x.ndim == 4:
        x = x.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(x, dtype=np.float64), dtype


def _as_float32(x: Any, layout: str):
    """A gradient as C-contiguous float32 numpy, [B, H, L, X]."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().to("cpu").float().numpy()
    x = np.asarray(x)
    if layout == "blhd" and x.ndim == 4:
        x = x.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(x, dtype=np.float32)


def check(
    fixture: Union[Fixture, str, "os.PathLike[str]"],
    o: Any,
    lse: Any = None,
    *,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    layout: str = "bhld",
    judged: str = "candidate",
    keep_worst: int = 5,
) -> CheckReport:
    """Judge a result against a fixture with the fixture's own tolerances.

    Parameters
    ----------
    fixture : Fixture, str or path-like
        A loaded fixture, the name of a shipped one or a fixture file.
    o : array_like or torch.Tensor
        The result's output, ``[B, Hq, Lq, Dv]`` (``[B, Lq, Hq, Dv]`` with ``layout="blhd"``),
        any float dtype, any device.
    lse : array_like or torch.Tensor, optional
        ``[B, Hq, Lq]``, natural log. Without it O is judged alone.
    dq, dk, dv : array_like or torch.Tensor, optional
        Gradients of ``sum(O * fixture.do)``, shaped as q, k and v (in ``layout``); each one
        given is judged against the fixture's golden gradient (SPEC §9).
    layout : {"bhld", "blhd"}
        How ``o`` is stored.
    judged : str
        The name of what is judged, for the report's table.
    keep_worst : int
        Failing rows kept in the report.

    Returns
    -------
    CheckReport
        Same verdict and wording as ``flashref check --candidate``.
    """
    if not isinstance(fixture, Fixture):
        fixture = load(fixture)
    if layout not in ("bhld", "blhd"):
        raise ValueError(f"layout: expected 'bhld' or 'blhd', got {layout!r}")
    o64, o_dtype = _as_float64(o, layout)
    lse64, lse_dtype = (None, "") if lse is None else _as_float64(lse, "bhld")
    grads = [None if g is None else _as_float32(g, layout) for g in (dq, dk, dv)]
    row = _core.check(fixture.handle, o64, lse64, *grads, o_dtype, lse_dtype, judged, keep_worst)
    return CheckReport(row)
