"""What the launchers of every kernel family share: `LaunchConfig` (a Triton kernel's blocks and launch
options; the tables are each family's ``configs``), `_launch`, which retries a launch that ran out of
shared memory with fewer pipeline stages (the launch itself: `packattn.ops.runtime.fast_launch`), `LOG2E` / `LN2`,
the mask's kernel arguments (`mask_constexprs`, `mask_scalars`, and `mask_options` / `mask_from_options`
across a custom op's schema), and the rule for a negative scale (`nonnegative_scale`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch

from packattn.mask import Mask
from packattn.ops.runtime import fast_launch
from packattn.ops.runtime.support import interpreting

LOG2E = 1.4426950408889634  # log2(e): the kernels take exp2 of scores scaled by scale * LOG2E
LN2 = 1.0 / LOG2E  # ln(2) (the float 0.6931471805599453): lse = (m + log2(l)) * LN2 from the base-2 state


# ---------------------------------------------------------------- launch configurations
@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # queries per block
    block_n: int  # keys per block
    num_warps: int
    num_stages: int


@contextlib.contextmanager
def overriding(module, values: dict, check=None):
    """Set names of a configs ``module`` (its tables and thresholds: existing upper-case names only) to
    ``values`` while the ``with`` block runs, then restore them; ``check()`` validates the new state (the old
    one is restored when it raises). The mechanism behind each family's ``configs.override``."""
    unknown = [name for name in values if not name.isupper() or not hasattr(module, name)]
    if unknown:
        raise ValueError(f"{module.__name__} has no table or threshold {', '.join(unknown)}")
    old = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        if check is not None:
            check()
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


_reduced_stages: dict = {}  # launches that ran out of shared memory -> num_stages that fit


def block_d(head_dim: int) -> int:
    return 1 << (head_dim - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _fix_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with ``int(ndarray of shape (1,))``, which
    numpy >= 2.4 refuses, so ``range(lo, hi, BLOCK)`` over loaded bounds fails there
    (triton-lang/triton#9171, fixed upstream the same way). Interpreter only; no effect on GPU code."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.zeros(1, dtype=np.int32))
        return  # this numpy still converts size-1 arrays
    except TypeError:
        pass
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _launch(kernel, grid, args, constexprs, config: LaunchConfig):
    """Launch; when a configuration runs out of shared memory, retry with fewer pipeline stages."""
    if grid[0] == 0:
        return
    if interpreting():
        _fix_interpreter_loop_bounds()
    from triton.runtime.errors import OutOfResources

    key = (getattr(kernel, "fn", kernel).__name__, tuple(sorted(constexprs.items())))
    stages = _reduced_stages.get(key, config.num_stages)
    while True:
        try:
            fast_launch.launch(kernel, grid, args, dict(constexprs, num_warps=config.num_warps, num_stages=stages))
            return
        except OutOfResources as e:
            if stages <= 1:
                raise
            stages -= 1
            _reduced_stages[key] = stages
            warnings.warn(f"packattn triton: {e}; retrying with num_stages={stages}", stacklevel=2)


# ---------------------------------------------------------------- what every launcher shares
def mask_constexprs(mask: Mask) -> dict:
    """The mask constexprs every varlen-family kernel takes (Triton and Gluon, forward and backward)."""
    return {"HAS_LEFT": mask.left >= 0, "HAS_RIGHT": mask.right >= 0, "HAS_CHUNK": mask.chunk_size is not None,
            "TOP_LEFT": mask.align == "top_left"}


def mask_scalars(mask: Mask) -> tuple[int, int, int]:
    """``(window_left, window_right, chunk_size)``: the mask's integer kernel arguments (-1 / -1 / 0: none)."""
    return mask.left, mask.right, mask.chunk_size or 0


NO_MASK = Mask()  # the tree kernels' mask arguments: no window, no chunk (the tree mask is a constexpr of its own)

# The integers of `mask_options`, in order (the arguments of `mask_from_options`): the first fields of each
# family's options list (e.g. `packattn.ops.varlen.op.FWD_OPTIONS`).
MASK_FIELDS = ("causal", "has_window", "window_left", "window_right", "chunk_size", "top_left")
MASK_OPTIONS = len(MASK_FIELDS)


def mask_options(mask: Mask) -> list[int]:
    """``mask`` as the integers a custom op's schema carries, `MASK_FIELDS` (`mask_from_options` rebuilds it)."""
    left, right = mask.window if mask.window is not None else (0, 0)
    return [int(mask.causal), int(mask.window is not None), left, right, mask.chunk_size or 0,
            int(mask.align == "top_left")]


@functools.lru_cache(maxsize=256)
def mask_from_options(causal: int, has_window: int, window_left: int, window_right: int, chunk_size: int,
                      top_left: int) -> Mask:
    """The `Mask` of `mask_options` (cached: the ops rebuild it on every call); the arguments are `MASK_FIELDS`."""
    return Mask(causal=bool(causal), window=(window_left, window_right) if has_window else None,
                chunk_size=chunk_size or None, align="top_left" if top_left else "bottom_right")


def nonnegative_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float, bool]:
    """``(q, scale, negated)`` with ``scale >= 0``: the kernels need it, and ``(q, -s)`` gives the same scores as
    ``(-q, s)``; ``negated``: q was negated (a gradient of the original q is the negated one)."""
    if scale < 0:
        return -q, -scale, True
    return q, scale, False


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride()[-1] == 1 else x.contiguous()  # (x.stride(-1) costs twice the host time)
