"""`Varlen`: the descriptor of a packed (THD) batch, built once per step on the host.

Sequence ``i`` has ``len_q[i]`` query rows and ``len_kv[i]`` key rows. Without padding the
sequences are laid back to back and ``cu_seqlens_*`` are both the logical cumulative lengths
and the physical offsets. With padding between sequences (``pad_between_seqs``), sequence ``i``
starts at physical row ``cu_seqlens_*_padded[i]`` and its slot ends at
``cu_seqlens_*_padded[i + 1]``; rows of the slot past the real length belong to no sequence.

Every length an attention call needs (``max_seqlen_*``, ``total_*``) is a host int, so no
attention call syncs the GPU to learn one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_INT32_MAX = 2**31 - 1


def _as_host_lengths(name: str, lengths) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(lengths.shape)}")
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {lengths.dtype}")
        lengths = lengths.tolist()
    elif hasattr(lengths, "tolist") and hasattr(lengths, "ndim"):  # a numpy array
        if lengths.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got {lengths.ndim}-D")
        if lengths.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {lengths.dtype}")
        lengths = lengths.tolist()
    if not isinstance(lengths, Sequence) or isinstance(lengths, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(lengths).__name__}")
    out = []
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int):
            try:
                import numpy as np  # numpy ints are fine

                ok = isinstance(n, np.integer)
            except ImportError:  # pragma: no cover
                ok = False
            if not ok:
                raise TypeError(f"{name}[{i}] must be an int, got {n!r}")
        n = int(n)
        if n < 0:
            raise ValueError(f"{name}[{i}] is negative ({n})")
        out.append(n)
    return out


def _cumsum(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _check_fits_int32(name: str, total: int) -> None:
    if total > _INT32_MAX:
        raise ValueError(f"{name} total {total} overflows int32 offsets")


def _check_cu(name: str, cu: list[int]) -> None:
    if not cu or cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[:3]}...")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"{name} is not monotonic: {name}[{i}] = {cu[i]} < {name}[{i - 1}] = {cu[i - 1]}")
    _check_fits_int32(name, cu[-1])


def _check_padded(name: str, cu: list[int], cu_padded: list[int]) -> None:
    _check_cu(name + "_padded", cu_padded)
    if len(cu_padded) != len(cu):
        raise ValueError(f"{name}_padded has {len(cu_padded)} entries but {name} has {len(cu)}")
    for i in range(len(cu) - 1):
        real = cu[i + 1] - cu[i]
        slot = cu_padded[i + 1] - cu_padded[i]
        if slot < real:
            raise ValueError(
                f"{name}_padded gives sequence {i} a slot of {slot} rows, smaller than its length {real}"
            )


def _cu_tensor_to_host(name: str, t: torch.Tensor) -> list[int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1 or t.numel() < 1:
        raise ValueError(f"{name} must be 1-D with at least one entry, got shape {tuple(t.shape)}")
    return t.tolist()


@dataclass(eq=False)
class Varlen:
    """A packed batch of ``num_seqs`` (query, key) sequence pairs; see the module docstring."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor | None
    cu_seqlens_kv_padded: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_kv: int
    total_q: int
    total_kv: int
    num_seqs: int
    # host copies of the real lengths when the builder had them (None otherwise)
    lengths_q: tuple[int, ...] | None = None
    lengths_kv: tuple[int, ...] | None = None
    # host copies of each sequence's first physical row (None when unknown)
    host_starts_q: tuple[int, ...] | None = None
    host_starts_kv: tuple[int, ...] | None = None
    # True when q and kv describe the same sequences (self-attention)
    is_self: bool = False
    _on_device: dict = field(default_factory=dict, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        mark_dynamic(self.cu_seqlens_q, self.cu_seqlens_kv, self.cu_seqlens_q_padded, self.cu_seqlens_kv_padded)
        self._set_max_seqlens(self.max_seqlen_q, self.max_seqlen_kv)

    def _set_max_seqlens(self, max_seqlen_q: int, max_seqlen_kv: int) -> None:
        self.max_seqlen_q, self.max_seqlen_kv = max_seqlen_q, max_seqlen_kv
        # + 2: torch.compile specialises dynamic dimensions of size 0 and 1
        self._max_seqlens_shape = torch.empty((), dtype=torch.int8).expand(max_seqlen_q + 2, max_seqlen_kv + 2)
        mark_dynamic(self._max_seqlens_shape, dims=(0, 1))

    def traced_max_seqlens(self) -> tuple:
        """``(max_seqlen_q, max_seqlen_kv)`` as torch.compile should read them: from the shape of a stride-0
        tensor made with the descriptor and marked dynamic (`mark_dynamic`), so the first graph is general in
        them. Int attributes would be constants of the first graph (one packing); only a recompile would
        generalise them."""
        return self._max_seqlens_shape.shape[0] - 2, self._max_seqlens_shape.shape[1] - 2

    @property
    def pad_between_seqs(self) -> bool:
        return self.cu_seqlens_q_padded is not None or self.cu_seqlens_kv_padded is not None

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_q.device

    # ---------------------------------------------------------------- builders
    @classmethod
    def from_lengths(cls, lengths_q, lengths_kv=None, *, pad_to_multiple: int | None = None, device=None) -> Varlen:
        """Build from host lengths (0 allowed). ``lengths_kv=None`` means self-attention.

        ``pad_to_multiple=m`` lays each sequence in a slot rounded up to a multiple of ``m``
        (padding between sequences); the rows past each real length belong to no sequence.
        """
        lq = _as_host_lengths("lengths_q", lengths_q)
        is_self = lengths_kv is None
        lk = lq if is_self else _as_host_lengths("lengths_kv", lengths_kv)
        if len(lk) != len(lq):
            raise ValueError(f"lengths_q has {len(lq)} sequences but lengths_kv has {len(lk)}")
        if pad_to_multiple is not None:
            if isinstance(pad_to_multiple, bool) or not isinstance(pad_to_multiple, int) or pad_to_multiple < 1:
                raise ValueError(f"pad_to_multiple must be a positive int, got {pad_to_multiple!r}")
        cu_q, cu_k = _cumsum(lq), _cumsum(lk)
        _check_fits_int32("lengths_q", cu_q[-1])
        _check_fits_int32("lengths_kv", cu_k[-1])
        cu_qp = cu_kp = None
        if pad_to_multiple is not None and pad_to_multiple > 1:
            m = pad_to_multiple
            cu_qp = _cumsum([-(-n // m) * m for n in lq])
            cu_kp = cu_qp if is_self else _cumsum([-(-n // m) * m for n in lk])
            _check_fits_int32("padded lengths_q", cu_qp[-1])
            _check_fits_int32("padded lengths_kv", cu_kp[-1])
        return cls._build(cu_q, cu_k, cu_qp, cu_kp, lq, lk, is_self, device)

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_kv: torch.Tensor | None = None,
        *,
        max_seqlen_q: int,
        max_seqlen_kv: int | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
    ) -> Varlen:
        """Wrap cumulative-length tensors a caller already has.

        The tensors are validated once here (one device-to-host copy per batch when they live
        on a GPU); attention calls with the result never sync.
        """
        is_self = cu_seqlens_kv is None or cu_seqlens_kv is cu_seqlens_q
        if is_self and cu_seqlens_kv_padded is None:
            cu_seqlens_kv_padded = cu_seqlens_q_padded
        is_self = is_self and cu_seqlens_kv_padded is cu_seqlens_q_padded
        cu_q = _cu_tensor_to_host("cu_seqlens_q", cu_seqlens_q)
        cu_k = cu_q if cu_seqlens_kv is None else _cu_tensor_to_host("cu_seqlens_kv", cu_seqlens_kv)
        if len(cu_k) != len(cu_q):
            raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} sequences but cu_seqlens_kv has {len(cu_k) - 1}")
        _check_cu("cu_seqlens_q", cu_q)
        _check_cu("cu_seqlens_kv", cu_k)
        cu_qp = None if cu_seqlens_q_padded is None else _cu_tensor_to_host("cu_seqlens_q_padded", cu_seqlens_q_padded)
        cu_kp = None if cu_seqlens_kv_padded is None else _cu_tensor_to_host("cu_seqlens_kv_padded", cu_seqlens_kv_padded)
        lq = [cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)]
        lk = [cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1)]
        for name, given, lengths in (("max_seqlen_q", max_seqlen_q, lq), ("max_seqlen_kv", max_seqlen_kv, lk)):
            if given is None and name == "max_seqlen_kv":
                continue  # derived below
            if isinstance(given, bool) or not isinstance(given, int):
                raise TypeError(f"{name} must be an int, got {given!r}")
            if lengths and given < max(lengths):
                raise ValueError(f"{name}={given} is smaller than the longest sequence ({max(lengths)})")
        out = cls._build(cu_q, cu_k, cu_qp, cu_kp, lq, lk, is_self, cu_seqlens_q.device)
        out._set_max_seqlens(max_seqlen_q, max_seqlen_q if max_seqlen_kv is None and is_self
                             else (max_seqlen_kv or out.max_seqlen_kv))
        return out

    @classmethod
    def _build(cls, cu_q, cu_k, cu_qp, cu_kp, lq, lk, is_self, device) -> Varlen:
        if cu_qp is not None:
            _check_padded("cu_seqlens_q", cu_q, cu_qp)
        if cu_kp is not None:
            _check_padded("cu_seqlens_kv", cu_k, cu_kp)
        device = torch.device("cpu") if device is None else torch.device(device)

        def t(values):
            return None if values is None else torch.tensor(values, dtype=torch.int32, device=device)

        tq = t(cu_q)
        tk = tq if is_self else t(cu_k)
        tqp = t(cu_qp)
        tkp = tqp if (is_self and cu_kp is cu_qp) else t(cu_kp)
        return cls(
            cu_seqlens_q=tq,
            cu_seqlens_kv=tk,
            cu_seqlens_q_padded=tqp,
            cu_seqlens_kv_padded=tkp,
            max_seqlen_q=max(lq, default=0),
            max_seqlen_kv=max(lk, default=0),
            total_q=(cu_qp or cu_q)[-1],
            total_kv=(cu_kp or cu_k)[-1],
            num_seqs=len(lq),
            lengths_q=tuple(lq),
            lengths_kv=tuple(lk),
            host_starts_q=tuple((cu_qp or cu_q)[:-1]),
            host_starts_kv=tuple((cu_kp or cu_k)[:-1]),
            is_self=is_self,
        )

    @classmethod
    def uniform(cls, batch: int, seqlen_q: int, seqlen_kv: int, device) -> Varlen:
        """``batch`` sequences of equal lengths laid back to back (a dense batch), built without host copies."""
        def cu(n):
            return torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=device) if n > 0 else torch.zeros(
                batch + 1, dtype=torch.int32, device=device
            )

        tq = cu(seqlen_q)
        is_self = seqlen_q == seqlen_kv
        # host copies of the lengths would make a traced graph depend on the batch size: none while compiling
        host = not torch.compiler.is_compiling()
        return cls(
            cu_seqlens_q=tq,
            cu_seqlens_kv=tq if is_self else cu(seqlen_kv),
            cu_seqlens_q_padded=None,
            cu_seqlens_kv_padded=None,
            max_seqlen_q=seqlen_q,
            max_seqlen_kv=seqlen_kv,
            total_q=batch * seqlen_q,
            total_kv=batch * seqlen_kv,
            num_seqs=batch,
            lengths_q=(seqlen_q,) * batch if host else None,
            lengths_kv=(seqlen_kv,) * batch if host else None,
            host_starts_q=tuple(i * seqlen_q for i in range(batch)) if host else None,
            host_starts_kv=tuple(i * seqlen_kv for i in range(batch)) if host else None,
            is_self=is_self,
        )

    # ---------------------------------------------------------------- derived, cached per batch
    def to(self, device) -> Varlen:
        """This descriptor with its tensors on ``device`` (copied once, then cached)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.device == device:
            return self
        key = str(device)
        if key not in self._on_device:
            def mv(x):
                return None if x is None else x.to(device, non_blocking=True)

            other = Varlen(
                cu_seqlens_q=mv(self.cu_seqlens_q),
                cu_seqlens_kv=None,
                cu_seqlens_q_padded=mv(self.cu_seqlens_q_padded),
                cu_seqlens_kv_padded=None,
                max_seqlen_q=self.max_seqlen_q,
                max_seqlen_kv=self.max_seqlen_kv,
                total_q=self.total_q,
                total_kv=self.total_kv,
                num_seqs=self.num_seqs,
                lengths_q=self.lengths_q,
                lengths_kv=self.lengths_kv,
                host_starts_q=self.host_starts_q,
                host_starts_kv=self.host_starts_kv,
                is_self=self.is_self,
            )
            other.cu_seqlens_kv = other.cu_seqlens_q if self.cu_seqlens_kv is self.cu_seqlens_q else mv(self.cu_seqlens_kv)
            same_pad = self.cu_seqlens_kv_padded is self.cu_seqlens_q_padded
            other.cu_seqlens_kv_padded = other.cu_seqlens_q_padded if same_pad else mv(self.cu_seqlens_kv_padded)
            mark_dynamic(other.cu_seqlens_kv, other.cu_seqlens_kv_padded)
            self._on_device[key] = other
        return self._on_device[key]

    def cached(self, key, build):
        """Per-batch metadata (row maps, block masks...) built once and reused by every layer.

        While torch.compile traces, ``build()`` is returned without touching the cache: a lookup would
        guard the graph on this batch's cache and a store would outlive the trace."""
        if torch.compiler.is_compiling():
            return build()
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def starts_q(self) -> torch.Tensor:
        """Physical row where each query sequence starts (N,)."""
        return (self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None else self.cu_seqlens_q)[:-1]

    @property
    def starts_kv(self) -> torch.Tensor:
        return (self.cu_seqlens_kv_padded if self.cu_seqlens_kv_padded is not None else self.cu_seqlens_kv)[:-1]

    @property
    def seqlens_q(self) -> torch.Tensor:
        return self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]

    @property
    def seqlens_kv(self) -> torch.Tensor:
        return self.cu_seqlens_kv[1:] - self.cu_seqlens_kv[:-1]

    @property
    def offsets_q(self) -> torch.Tensor:
        """Physical row where each query sequence starts, then the end of the last slot (N + 1,)."""
        return self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None else self.cu_seqlens_q

    @property
    def offsets_kv(self) -> torch.Tensor:
        return self.cu_seqlens_kv_padded if self.cu_seqlens_kv_padded is not None else self.cu_seqlens_kv

    def row_map_q(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For each physical query row: (sequence index or -1 for padding, position in its sequence)."""
        return self.cached("row_map_q", lambda: _row_map(self.offsets_q, self.cu_seqlens_q, self.total_q))

    def row_map_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cached("row_map_kv", lambda: _row_map(self.offsets_kv, self.cu_seqlens_kv, self.total_kv))

    def padding_rows(self, side: str) -> torch.Tensor | None:
        """Physical rows of ``side`` ("q" or "kv") that belong to no sequence: int64 on this
        descriptor's device, built from the host lengths and starts (no GPU sync), cached; None
        when the descriptor has no host copies (kernels then zero whole outputs instead)."""
        lengths, starts, total = ((self.lengths_q, self.host_starts_q, self.total_q) if side == "q"
                                  else (self.lengths_kv, self.host_starts_kv, self.total_kv))
        if lengths is None or starts is None:
            return None

        def build():
            used = torch.zeros(total, dtype=torch.bool)
            for start, length in zip(starts, lengths):
                used[start: start + length] = True
            return (~used).nonzero().flatten().to(self.device, non_blocking=True)

        return self.cached(("padding_rows", side), build)

    def __repr__(self) -> str:
        pad = ", pad_between_seqs" if self.pad_between_seqs else ""
        return (
            f"Varlen(num_seqs={self.num_seqs}, total_q={self.total_q}, total_kv={self.total_kv}, "
            f"max_seqlen_q={self.max_seqlen_q}, max_seqlen_kv={self.max_seqlen_kv}{pad}, device={self.device})"
        )


def mark_dynamic(*tensors: torch.Tensor | None, dims: tuple[int, ...] = (0,)) -> None:
    """Tell torch.compile that ``dims`` of these per-batch tensors vary (``torch._dynamo.maybe_mark_dynamic``),
    so the first graph it traces over a descriptor serves every packing. Done only where torch.compile is
    already loaded (``torch._dynamo`` takes seconds to import; a program that compiles has loaded it by the
    time it builds its batches) and not while tracing; otherwise the second graph generalises instead."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None:
            dynamo.maybe_mark_dynamic(t, list(dims))


def lengths_then_zero(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 ``(N + 1,)``: the length of each of the N sequences of ``cu_seqlens``, then a 0.

    It keeps the N + 1 entries of ``cu_seqlens`` (no N-entry slice): under torch.compile a dimension
    of size 1 is a special case, so a batch of one sequence would otherwise get a graph of its own."""
    cu = cu_seqlens.long()
    return (cu.roll(-1) - cu).clamp_min(0)


def _row_map(offsets: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence id (-1 = padding) and position of every physical row, with device ops only, from the
    physical ``offsets`` and the real ``cu_seqlens`` (N + 1 entries each, `lengths_then_zero`)."""
    rows = torch.arange(total, dtype=torch.int64, device=offsets.device)
    offsets = offsets.long()
    # sequence whose slot holds each row: last start <= row (empty sequences share a start; take the last)
    seq = torch.searchsorted(offsets, rows, right=True) - 1
    seq_c = seq.clamp_min(0)
    pos = rows - offsets[seq_c]
    valid = (seq >= 0) & (pos < lengths_then_zero(cu_seqlens)[seq_c])
    seq = torch.where(valid, seq, torch.full_like(seq, -1))
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    return seq, pos
