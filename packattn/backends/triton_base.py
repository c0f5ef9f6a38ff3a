"""The base of the backends that launch our Triton kernels: availability (triton importable; CUDA, or
Triton's interpreter for tests) and keeping ``backend="auto"`` off the slow interpreter on CPU. Where
the kernels may run: `packattn.ops.runtime.support`."""

from __future__ import annotations

import torch

from packattn.backends.base import Backend
from packattn.ops.runtime.support import interpreting


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
