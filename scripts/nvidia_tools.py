"""Paths of the NVIDIA tools Triton itself uses, for the sm_90a compile-check scripts (no kernel imports here)."""

from __future__ import annotations

import subprocess


def bundled_ptxas(arch: int = 90) -> str:
    """The ptxas Triton compiles ``arch`` with (from 3.9 on sm_90 its newer "ptxas-blackwell": the older one refuses
    the PTX version Triton emits; `TRITON_PTXAS_PATH` overrides both, as it does for Triton)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def disassemble(cubin_path: str) -> str:
    """``nvdisasm -c`` of a cubin with the nvdisasm Triton uses; CalledProcessError if it fails (an empty listing
    would read as a kernel without setmaxnreg and pass every register check)."""
    from triton import knobs

    return subprocess.run([knobs.nvidia.nvdisasm.path, "-c", cubin_path], capture_output=True, text=True,
                          check=True).stdout


def cuobjdump_sass(cubin_path: str) -> str:
    """``cuobjdump -sass`` of a cubin (branch targets as addresses) with the cuobjdump Triton uses;
    CalledProcessError if it fails."""
    from triton import knobs

    return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", cubin_path], capture_output=True, text=True,
                          check=True).stdout
