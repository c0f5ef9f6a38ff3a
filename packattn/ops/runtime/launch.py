"""Launching the Triton kernels of the varlen family (`triton_varlen`, `triton_tree`, `small_seq`):
block sizes and launch options per kernel, GPU, dtype and head dim (`launch_config`), the constexprs and
input strides every launcher shares, and `_launch`, which retries a launch that ran out of shared memory
with fewer pipeline stages (the launch itself: `packattn.ops.runtime.fast_launch`).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from packattn.ops.runtime import fast_launch
from packattn.backends.triton_base import cuda_index, interpreting


# ---------------------------------------------------------------- launch configurations
@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # queries per block
    block_n: int  # keys per block
    num_warps: int
    num_stages: int


# (kernel, padded head dim BLOCK_D) -> config. fwd and dq run per query tile, dkdv per key tile.
# BLOCK_D 128 (head dims 96, 128): the best of a measured sweep on H200 (W1/W8, bf16,
# benchmarks/results/2026-11-22/tune_v1_h200.txt; ptxas spill counts did not predict those timings).
# Others not timed, only checked to compile for sm_90a and fit in shared memory without a GPU
# (scripts/check_triton_compile.py).
HOPPER_CONFIGS = {
    ("fwd", 32): LaunchConfig(128, 128, 4, 3),
    ("fwd", 64): LaunchConfig(128, 128, 8, 3),
    ("fwd", 128): LaunchConfig(128, 32, 4, 4),
    ("fwd", 256): LaunchConfig(64, 32, 8, 2),
    ("dq", 32): LaunchConfig(128, 64, 8, 2),
    ("dq", 64): LaunchConfig(128, 64, 8, 2),
    ("dq", 128): LaunchConfig(128, 64, 8, 3),
    ("dq", 256): LaunchConfig(64, 16, 8, 1),
    ("dkdv", 32): LaunchConfig(64, 128, 8, 2),
    ("dkdv", 64): LaunchConfig(64, 128, 8, 2),
    ("dkdv", 128): LaunchConfig(32, 64, 4, 3),
    ("dkdv", 256): LaunchConfig(16, 32, 8, 1),
}
# Forward when some sequence has >= `triton_varlen.LONG_SEQLEN` queries: for head dims 96/128, 8 warps with
# BLOCK_N 64 measured 18% faster than (128, 32, 4, 4) on W4 (one 32k document, chunks of 8192: 474 vs 402 TF/s),
# while (128, 32, 4, 4) stays best on W1/W8's mixes of shorter documents and W2 ties
# (benchmarks/results/2026-11-22/tune_w4_h200.txt, tune_fwd_dkdv_v7_h200.txt).
HOPPER_LONG_FWD_CONFIGS = {128: LaunchConfig(128, 64, 8, 3)}
# other CUDA GPUs (Ampere/Ada: less shared memory)
FALLBACK_CONFIGS = {
    ("fwd", 128): LaunchConfig(64, 64, 4, 2),
    ("fwd", 256): LaunchConfig(64, 32, 4, 1),
    ("dq", 128): LaunchConfig(64, 32, 4, 2),
    ("dq", 256): LaunchConfig(32, 32, 4, 1),
    ("dkdv", 128): LaunchConfig(32, 64, 4, 2),
    ("dkdv", 256): LaunchConfig(32, 32, 4, 1),
}
# float32 inputs (IEEE dots: no tensor cores, twice the bytes per tile) on any CUDA GPU
FP32_CONFIGS = {
    ("fwd", 128): LaunchConfig(64, 32, 4, 2),
    ("fwd", 256): LaunchConfig(32, 32, 4, 1),
    ("dq", 128): LaunchConfig(64, 32, 4, 2),
    ("dq", 256): LaunchConfig(32, 32, 4, 1),
    ("dkdv", 128): LaunchConfig(32, 64, 4, 2),
    ("dkdv", 256): LaunchConfig(32, 32, 4, 1),
}
# Triton's interpreter: small blocks, deliberately different M and N so mix-ups show in tests
INTERPRETER_CONFIGS = {"fwd": LaunchConfig(32, 16, 1, 1), "dq": LaunchConfig(32, 16, 1, 1),
                       "dkdv": LaunchConfig(16, 32, 1, 1)}
PREPROCESS_BLOCK_M = 64
_reduced_stages: dict = {}  # launches that ran out of shared memory -> num_stages that fit


def block_d(head_dim: int) -> int:
    return 1 << (head_dim - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def launch_config(kernel: str, head_dim: int, dtype: torch.dtype, device: torch.device,
                  long_seqs: bool = False) -> LaunchConfig:
    """Block sizes and launch options of ``kernel`` ("fwd", "dq", "dkdv"); the tile tables use the
    same block sizes, so both sides call this. ``long_seqs``: some sequence has at least
    ``triton_varlen.LONG_SEQLEN`` queries (the forward may pick other tiles then)."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER_CONFIGS[kernel]
    bd = block_d(head_dim)
    if dtype == torch.float32:
        table = FP32_CONFIGS
    else:
        table = HOPPER_CONFIGS if _is_hopper(cuda_index(device)) else FALLBACK_CONFIGS
        if kernel == "fwd" and long_seqs and table is HOPPER_CONFIGS and bd in HOPPER_LONG_FWD_CONFIGS:
            return HOPPER_LONG_FWD_CONFIGS[bd]
    return table.get((kernel, bd)) or table[(kernel, 128 if bd <= 128 else 256)]


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
def _mask_constexprs(window_left: int, window_right: int, chunk_size: int, top_left: bool) -> dict:
    """The mask constexprs every varlen-family kernel takes (Triton and Gluon, forward and backward)."""
    return {"HAS_LEFT": window_left >= 0, "HAS_RIGHT": window_right >= 0, "HAS_CHUNK": chunk_size > 0,
            "TOP_LEFT": top_left}


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride()[-1] == 1 else x.contiguous()  # (x.stride(-1) costs twice the host time)
