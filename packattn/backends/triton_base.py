"""What every backend built on our Triton kernels shares: availability (triton importable; CUDA,
or Triton's interpreter for tests), the device rule, and keeping ``backend="auto"`` off the slow
interpreter on CPU; which installed Triton releases our Triton-internal code paths (the Gluon kernels,
`fast_launch`) are built for, and the reason they stay off on others."""

from __future__ import annotations

import importlib.metadata
import logging

import torch

from packattn import env
from packattn.backends.base import Backend


log = logging.getLogger("packattn.triton")

# Triton releases (major.minor) our Gluon kernels compile on: `scripts/ci_gluon_check.py` compiles them for
# sm_90a on the CPU in CI with the floor and the newest Triton of the declared range, and fails where a
# release listed here does not compile (Triton 3.7 dropped ``gl.thread_barrier``, which the kernels use).
GLUON_TRITON = ("3.6",)
# Triton releases whose compiled-kernel launcher `fast_launch` calls directly (its calling convention and
# specialisation key were checked on a GPU there: tests/gpu/test_triton_varlen_gpu.py).
FAST_LAUNCH_TRITON = ("3.6",)


def triton_version() -> str | None:
    """The installed Triton's version string (from its metadata, without importing it); None without Triton."""
    for dist in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release_unsupported(what: str, releases: tuple[str, ...], version: str | None, instead: str) -> str | None:
    """Why ``what`` cannot run on Triton ``version`` (None: its major.minor is one of ``releases``);
    ``instead``: what runs in its place."""
    if version is None:
        return f"{what} off: triton is not installed"
    if ".".join(version.split("+")[0].split(".")[:2]) in releases:
        return None
    return f"{what} off: built for Triton {' / '.join(releases)}, found {version}; {instead}"


def gluon_unsupported(version: str | None = None) -> str | None:
    """Why our Hopper Gluon kernels stay off with Triton ``version`` (default: the installed one); None: they run."""
    return release_unsupported("Gluon kernels", GLUON_TRITON, triton_version() if version is None else version,
                               "the Triton kernels run instead (same results, slower on Hopper)")


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


class TritonBackend(Backend):
    """Base of the backends that launch our Triton kernels."""

    def unavailable(self) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return f"triton is not installed ({e})"
        if not torch.cuda.is_available() and not interpreting():
            return "needs CUDA (on CPU only in Triton's interpreter, TRITON_INTERPRET=1, for tests)"
        return None

    def auto_skip(self, params) -> str | None:
        if params.device_type == "cpu":
            return f"Triton's interpreter on CPU is for tests: used only when asked for with backend='{self.name}'"
        return None
