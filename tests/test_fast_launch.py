"""`packattn.ops.runtime.fast_launch`: its specialisation key is at least as fine as Triton's (equal keys
mean equal Triton specialisations), the launcher's argument order, and the slow path under the
interpreter. The launch itself runs on GPUs only (tests/gpu/test_triton_varlen_gpu.py compares
fast and slow launches bitwise)."""

from __future__ import annotations

import itertools

import pytest
import torch

from packattn.ops.runtime import fast_launch

triton = pytest.importorskip("triton")


def _native_specialisation():
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:  # another Triton layout: nothing to compare with
        pytest.skip("triton's native specialisation is not importable")
    return lambda x: native_specialize_impl(CUDABackend, x, False, True, True)


def _descriptors():
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        return []
    out = []
    for dtype, gdtype in ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16)):
        base = torch.empty(4096, dtype=dtype)
        for block in ([64, 128], [128, 128], [64, 64]):
            layout = gl.NVMMASharedLayout.get_default_for(block, gdtype)
            for rows, cols, offset in ((16, 256, 0), (15, 256, 8), (16, 128, 0)):
                out.append(TensorDescriptor(base[offset:], [rows, cols], [cols, 1], block, layout))
    return out


def _samples():
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**32, -1, -16, -(2**31), -(2**31) - 1,
            -(2**31) - 16]
    tensors = [torch.empty(64, dtype=dtype)[offset:] for dtype in (torch.bfloat16, torch.float16, torch.float32,
                                                                    torch.int32)
               for offset in (0, 1, 4, 8, 16)]
    return {"int": ints, "float": [0.0, 1.0, 0.5, 1e30], "bool": [True, False], "tensor": tensors,
            "desc": _descriptors()}


def test_equal_keys_mean_equal_triton_specialisations():
    spec = _native_specialisation()
    checked = 0
    for kind, values in _samples().items():
        for a, b in itertools.combinations(values, 2):
            if fast_launch.arg_key(a) == fast_launch.arg_key(b):
                assert spec(a) == spec(b), (kind, a if kind != "tensor" else a.data_ptr() % 16, b)
                checked += 1
    assert checked > 20  # the comparison ran on real pairs


def test_keys_tell_apart_what_triton_tells_apart():
    """The key is not coarser than needed either: pairs Triton specialises differently have different keys
    (follows from the test above) and the kinds of argument do not collide."""
    samples = _samples()
    keys = {kind: {fast_launch.arg_key(x) for x in values} for kind, values in samples.items()}
    assert len(keys["int"]) >= 4  # 1, divisible by 16, other, 64-bit
    assert len(keys["tensor"]) == 8  # four dtypes x aligned / not
    for a, b in itertools.combinations(keys, 2):
        assert not keys[a] & keys[b], (a, b)


def test_unmodelled_arguments_take_the_slow_path():
    with pytest.raises(fast_launch._Unkeyable):
        fast_launch.arg_key("a string")
    with pytest.raises(fast_launch._Unkeyable):
        fast_launch.arg_key(object())


def test_launcher_arguments_follow_the_signature():
    """`_entry` hands the launcher the positional arguments then every later parameter in signature
    order, from the keywords or the defaults (what JITFunction.run passes)."""

    def kernel(a, b, c, X: int = 3, Y: int = 4, Z: int = 5):
        pass

    class Jit:
        signature = __import__("inspect").signature(kernel)

    class Compiled:
        run, function, packed_metadata = "launcher", "function", "packed"

    entry = fast_launch._entry(Jit(), Compiled(), 3, dict(Z=50, X=30, num_warps=4))
    assert entry == ("launcher", "function", "packed", (30, 4, 50))
    entry = fast_launch._entry(Jit(), Compiled(), 4, dict(Y=40))
    assert entry[3] == (40, 5)


def test_interpreter_and_portable_disable_fast_launches(monkeypatch):
    monkeypatch.setattr(fast_launch, "_RELEASE_OFF", None)  # (a checked Triton release: tests/test_packaging.py)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fast_launch.enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("PACKATTN_PORTABLE", "1")
    assert not fast_launch.enabled()
    monkeypatch.delenv("PACKATTN_PORTABLE")
    assert fast_launch.enabled()


def test_slow_path_launches_under_the_interpreter():
    """Under the interpreter `launch` is ``kernel[grid](...)``: the kernel runs (tests' CPU machines)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU interpreter run only")
    from packattn.ops.varlen.bwd_triton import bwd_preprocess_kernel

    out = torch.randn(5, 2, 16)
    dout = torch.randn(5, 2, 16)
    lse = torch.zeros(2, 5)
    delta = torch.empty_like(lse)
    fast_launch.launch(bwd_preprocess_kernel, (1, 2), (out, dout, lse, delta, delta, 5, *out.stride()[:2],
                                                       *dout.stride()[:2], delta.stride(0)),
                       dict(HEAD_DIM=16, BLOCK_D=16, BLOCK_M=8, HAS_DLSE=False))
    torch.testing.assert_close(delta, (out * dout).sum(-1).T)
