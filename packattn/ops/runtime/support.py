"""What every family of our Triton kernels shares about where it may run: the installed Triton's
version and the releases our Triton-internal code paths (the Gluon kernels, `fast_launch`) are built
for, Triton's interpreter, the device rule, ``PACKATTN_PORTABLE``, and logging a fallback once."""

from __future__ import annotations

import functools
import importlib.metadata
import logging

import torch

from packattn import env

log = logging.getLogger("packattn.triton")

# Triton releases (major.minor) our Gluon kernels run on, each checked on a GPU (benchmarks/NOTES.md):
# `scripts/ci_gluon_check.py` compiles them for sm_90a on the CPU in CI with the floor and the newest Triton of the
# declared range, and fails where a release listed here does not compile. Names Gluon moved between releases go
# through `gluon_compat`.
GLUON_TRITON = ("3.6", "3.9")
# Triton releases whose compiled-kernel launcher `fast_launch` calls directly (its calling convention and
# specialisation key were checked on a GPU there: tests/gpu/test_triton_varlen_gpu.py).
FAST_LAUNCH_TRITON = ("3.6", "3.9")


def triton_version() -> str | None:
    """The installed Triton's version string (from its metadata, without importing it); None without Triton."""
    for dist in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def triton_release(version: str | None) -> str | None:
    """The major.minor of Triton ``version`` ("3.6.1+git0123" -> "3.6"); None for None."""
    return None if version is None else ".".join(version.split("+")[0].split(".")[:2])


def release_unsupported(what: str, releases: tuple[str, ...], version: str | None, instead: str) -> str | None:
    """Why ``what`` cannot run on Triton ``version`` (None: its major.minor is one of ``releases``);
    ``instead``: what runs in its place."""
    if version is None:
        return f"{what} off: triton is not installed"
    if triton_release(version) in releases:
        return None
    return f"{what} off: built for Triton {' / '.join(releases)}, found {version}; {instead}"


def gluon_unsupported(version: str | None = None) -> str | None:
    """Why our Hopper Gluon kernels stay off with Triton ``version`` (default: the installed one); None: they run."""
    return release_unsupported("Gluon kernels", GLUON_TRITON, triton_version() if version is None else version,
                               "the Triton kernels run instead (same results, slower on Hopper)")


@functools.lru_cache(maxsize=None)
def installed_gluon_unsupported() -> str | None:
    """`gluon_unsupported` of the installed Triton, looked up once (reading its metadata costs host time)."""
    return gluon_unsupported()


_logged: set[str] = set()


def log_once(reason: str) -> None:
    """Log ``reason`` (a fallback to the portable path) once per process at WARNING on ``packattn.triton``;
    never while torch.compile traces (a logging call would break the graph)."""
    if reason in _logged or torch.compiler.is_compiling():
        return
    _logged.add(reason)
    log.warning(reason)


def interpreting() -> bool:
    """Triton's CPU interpreter is on (must be set before the kernel modules are imported)."""
    return env.get("TRITON_INTERPRET") == "1"


def portable() -> bool:
    """``PACKATTN_PORTABLE=1``: the triton backends run only the portable Triton kernels (no Gluon kernels,
    no fast launches)."""
    return env.get("PACKATTN_PORTABLE") == "1"


def sm90_kernels_off() -> str | None:
    """Why the sm_90 Gluon kernels run on no device now, whatever the tensors:
    ``PACKATTN_PORTABLE=1``, Triton's interpreter, or a Triton they are not built for; None: they may run
    where `packattn.ops.runtime.sm90.sm90_runs` says so per call (it checks these inline: it runs on every
    call). For choices made before a call, e.g. dispatch preferring the triton backend for its sm_90 kernels."""
    if portable():
        return "PACKATTN_PORTABLE=1: only the portable Triton kernels run"
    if interpreting():
        return "Triton's interpreter runs only the portable Triton kernels"
    return installed_gluon_unsupported()


def cuda_index(device: torch.device | None) -> int:
    """The index of CUDA ``device``: its own, or the current device's for a bare "cuda" or None."""
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device()


def device_unsupported(device_type: str) -> str | None:
    """CUDA tensors, or CPU tensors under Triton's interpreter."""
    if device_type == "cpu":
        if not interpreting():
            return "needs CUDA tensors, got cpu (CPU runs only in Triton's interpreter, TRITON_INTERPRET=1)"
    elif device_type != "cuda":
        return f"needs CUDA tensors, got {device_type}"
    return None
