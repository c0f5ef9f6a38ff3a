"""What every backend built on our Triton kernels shares: availability (triton importable; CUDA,
or Triton's interpreter for tests), the device rule, and keeping ``backend="auto"`` off the slow
interpreter on CPU."""

from __future__ import annotations

import torch

from packattn import env
from packattn.backends.base import Backend


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
