"""Numerics that do not depend on the CPU a compile runs on.

torch's CPU FFT and matrix products go through MKL on x86-64, and MKL picks
its code path from the CPU (SSE4.2, AVX2, AVX-512 on Intel; a generic one on
other vendors), so the same clip's features would round differently on
different machines. Every process that featurizes for a compile sets MKL's
conditional numerical reproducibility to COMPATIBLE, the one code path every
x86-64 CPU runs, before MKL's first call (``require``), and featurizes on one
thread: MKL then gives the same bits on every x86-64 CPU. The rest of the
featurizer is exact element-wise arithmetic, max reductions, the compiled
kernels (compiler/audio/_kernels.c, built without fused multiply-adds), or float64
set-up tables (windows, filterbanks, resampling filters) rounded once to the
working type; docs/compile.md states what is and is not covered.

``environment`` is what shaped an archive's bytes, recorded in its provenance;
``resume_key`` is the part a resumed compile must share with the compile it
resumes (refused otherwise: the two would mix numerics in one archive).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CompileError
from . import kernels

# mkl_cbwr_set / mkl_cbwr_get (MKL's C API, exported by libtorch_cpu under mkl_serv_*)
_BRANCH = 1  # MKL_CBWR_BRANCH: ask for the code path
_COMPATIBLE = 2  # MKL_CBWR_COMPATIBLE
_BRANCH_NAMES = {
    0: "OFF",
    1: "AUTO",
    2: "COMPATIBLE",
    3: "SSE2",
    4: "SSE3",
    5: "SSSE3",
    6: "SSE4_1",
    7: "SSE4_2",
    8: "AVX",
    9: "AVX2",
    10: "AVX512_MIC",
    11: "AVX512",
    12: "AVX512_MIC_E1",
    13: "AVX512_E1",
}


def has_mkl() -> bool:
    """Whether this torch build runs its CPU FFT and products through MKL."""
    return bool(torch.backends.mkl.is_available())  # type: ignore[no-untyped-call]


@functools.cache
def _mkl() -> Any:
    """MKL's control functions in this torch build, or None where torch has no MKL."""
    if not has_mkl():
        return None
    for path in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu*")):
        try:
            lib = ctypes.CDLL(str(path))
            cbwr_set, cbwr_get = lib.mkl_serv_cbwr_set, lib.mkl_serv_cbwr_get
        except (OSError, AttributeError):
            continue
        cbwr_set.argtypes, cbwr_set.restype = [ctypes.c_int], ctypes.c_int
        cbwr_get.argtypes, cbwr_get.restype = [ctypes.c_int], ctypes.c_int
        return lib
    return None


def mkl_mode() -> str | None:
    """MKL's code path setting in this process (``COMPATIBLE`` once ``require`` ran),
    or None where torch has no MKL (its FFT is then pocketfft, the same code on
    every CPU of an architecture)."""
    lib = _mkl()
    if lib is None:
        return "unknown" if has_mkl() else None
    branch = int(lib.mkl_serv_cbwr_get(_BRANCH))
    return _BRANCH_NAMES.get(branch, str(branch))


def prefer() -> None:
    """``require`` where it can be had, silently otherwise: the compiler's import asks
    for the COMPATIBLE path as early as it can, and ``require`` refuses later, where
    a compile featurizes, if it did not take."""
    with contextlib.suppress(CompileError):
        require()


def require() -> None:
    """Puts MKL on its COMPATIBLE code path in this process, or refuses to featurize.

    MKL takes the setting only before its first call; a process that already ran
    MKL on another path (a matrix product before the compile started) cannot be
    switched, and the compile stops rather than write bytes another machine would
    not reproduce.
    """
    if os.environ.get("MKL_CBWR") != "COMPATIBLE":  # processes started from here inherit it
        os.environ["MKL_CBWR"] = "COMPATIBLE"
    lib = _mkl()
    if lib is None:
        if has_mkl():
            raise CompileError(
                "this torch build has MKL but does not export its reproducibility control "
                "(mkl_cbwr_set); its features would depend on the CPU. Install torch from "
                "PyPI or conda-forge builds that export it"
            )
        return
    if mkl_mode() == "COMPATIBLE":
        return
    lib.mkl_serv_cbwr_set(_COMPATIBLE)
    if mkl_mode() != "COMPATIBLE":
        raise CompileError(
            f"MKL already ran in this process on its {mkl_mode()} code path, and a compile "
            "needs the COMPATIBLE one (the same features on every CPU); MKL takes it only "
            "before its first call. Compile in a process of its own (dlop-compile, or "
            "workers > 1, whose processes start fresh), or import dlop.compiler before "
            "running any torch matrix product or FFT"
        )


@functools.cache
def _mkl_version() -> str | None:
    lib = _mkl()
    if lib is None:
        return None
    try:
        fn = lib.MKL_Get_Version_String
    except AttributeError:
        return "unknown"
    buf = ctypes.create_string_buffer(256)
    fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_int], None
    fn(buf, len(buf))
    return buf.value.decode(errors="replace").strip()


def environment() -> dict[str, Any]:
    """The numeric environment of this process, as a compile records it."""
    return {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "fft": "mkl" if has_mkl() else "pocketfft",
        "mkl": _mkl_version(),
        "mkl_cbwr": mkl_mode(),
        "compiled_kernels": kernels.native is not None,
        # the vector unit torch's own kernels use here: recorded, not part of resume_key
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def target() -> dict[str, Any]:
    """``environment`` as a featurizing process has it once ``require`` ran (the driver
    of a compile whose workers featurize may not have run it itself)."""
    env = environment()
    if env["mkl_cbwr"] is not None:
        env["mkl_cbwr"] = "COMPATIBLE"
    return env


# What two processes must share to write the same bytes for the same input.
RESUME_KEYS = ("machine", "torch", "numpy", "fft", "mkl", "mkl_cbwr", "compiled_kernels")


def resume_key(env: dict[str, Any]) -> dict[str, Any]:
    return {k: env.get(k) for k in RESUME_KEYS}


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``key: a -> b`` for each resume key on which two environments differ."""
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in RESUME_KEYS if a.get(k) != b.get(k)]
