"""Shared helpers of the Python package's tests."""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli():
    env = os.environ.get("FLASHREF_CLI")
    if env:
        return env
    for candidate in (ROOT / "build/default/tools/flashref", ROOT / "build/release/tools/flashref"):
        if candidate.is_file():
            return str(candidate)
    return shutil.which("flashref")


@pytest.fixture(scope="session")
def cli():
    """The flashref command-line tool built from this tree (FLASHREF_CLI names another)."""
    path = _cli()
    if path is None:
        pytest.skip("the flashref CLI is not built (scripts/test builds it)")
    return path


def run_cli(cli, *args, expect=0):
    r = subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == expect, r.stdout + r.stderr
    return r


# --- arrays that claim device memory, for the checks made before a device is touched --------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):  # DLPack's unversioned capsule, no deleter
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# DLPack type codes: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool.
_DL_DTYPES = {"float32": (2, 32), "float64": (2, 64), "float16": (2, 16), "bfloat16": (4, 16),
              "int32": (0, 32), "int64": (0, 64), "uint8": (1, 8), "bool": (6, 8)}
CUDA_DEVICE = 2  # kDLCUDA


class DeviceArray:
    """A DLPack producer that claims an array in device memory (CUDA device 0 by default) at an
    address nothing is allocated at. The binding's checks of dtypes, devices and shapes run on
    what DLPack describes and must refuse a bad call before any device is touched, so these
    exercise them on a machine without a GPU (a valid call gets as far as "no device")."""

    _next = 1 << 40  # distinct, 256-byte aligned, never dereferenced

    def __init__(self, shape, dtype="float32", device=(CUDA_DEVICE, 0), strides=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.device = device
        if strides is None:
            strides, step = [], 1
            for s in reversed(self.shape):
                strides.insert(0, step)
                step *= max(s, 1)
        self.strides = tuple(strides)
        self.data = DeviceArray._next
        DeviceArray._next += 1 << 30
        self._keep = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        n = len(self.shape)
        shape = (ctypes.c_int64 * n)(*self.shape)
        strides = (ctypes.c_int64 * n)(*self.strides)
        code, bits = _DL_DTYPES[self.dtype]
        mt = _DLManagedTensor()
        mt.dl_tensor.data = self.data
        mt.dl_tensor.device = _DLDevice(*self.device)
        mt.dl_tensor.ndim = n
        mt.dl_tensor.dtype = _DLDataType(code, bits, 1)
        mt.dl_tensor.shape = shape
        mt.dl_tensor.strides = strides
        self._keep.append((mt, shape, strides))  # alive as long as this object
        return _capsule_new(ctypes.addressof(mt), b"dltensor", None)
