"""What every context-parallel executor takes and returns: the one executor signature.

An executor (one per strategy: `packattn.cp.allgather`, `.ring`, `.alltoall`, `.hybrid`, and
`packattn.cp.tree` for Tree plans) is a function ``run(q, k, v, plan, call) -> (out, lse)``:

* ``q, k, v``: this rank's rows (``plan.num_local`` of them, THD), checked by `packattn.cp.attention`;
* ``call``: the call's options (`Call`), checked there too;
* ``out (num_local, heads_q, d_v)`` in q's dtype, ``lse`` float32 ``(heads_q, num_local)`` when
  ``call.return_lse``, else None.

It is a collective: every rank of the plan's group runs it (and its backward) in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from packattn.cp.plan import CPPlan
from packattn.mask import Mask


@dataclass(frozen=True)
class Call:
    """The options of one `packattn.cp.attention` call, as the executors get them (see there)."""

    causal: bool | str | None = None
    window: tuple[int, int] | None = None
    chunk_size: int | None = None
    scale: float | None = None
    backend: str = "auto"
    return_lse: bool = False
    deterministic: bool = False
    overlap_groups: int | None = None  # strategy "allgather" only (`packattn.cp.allgather`)
    mask: Mask = field(init=False, repr=False, compare=False)  # made from the three above (bad ones fail here)

    def __post_init__(self):
        object.__setattr__(self, "mask", Mask.make(self.causal, self.window, self.chunk_size))

    def options(self) -> dict:
        """The keywords every local `packattn.attention` call of an executor passes on unchanged."""
        return {"scale": self.scale, "backend": self.backend, "deterministic": self.deterministic}


class Executor(Protocol):
    """The signature every executor has (module docstring)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                 call: Call) -> tuple[torch.Tensor, torch.Tensor | None]: ...
