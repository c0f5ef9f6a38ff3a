"""Backend selection: `Params` -> the first capable backend by priority, with a reason for every skip.

Environment overrides (read on every call, part of the cache key):

* ``PACKATTN_BACKEND=<name>`` forces one backend (an error lists why it cannot run, if it cannot);
* ``PACKATTN_DISABLE=<name>[,<name>...]`` switches backends off, e.g. a kernel in production.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from packattn import env
from packattn.backends import REGISTRY
from packattn.backends.base import Backend
from packattn.backends.triton_varlen import SHORT_SEQLEN, short_batch
from packattn.mask import Mask

log = logging.getLogger("packattn.dispatch")

# longest sequences in the dispatch key: exact up to 16 (the small-seq kernels care), then one bucket up to
# SHORT_SEQLEN (where FA4 gives way to our kernels' short-batch backward, `Fa4Backend.defers_to`), one above it
_LENGTH_BUCKET = 17
_CACHE_SIZE = 256


@dataclass(frozen=True)
class Params:
    """Everything dispatch looks at. Hashable; built per call from host values only."""

    device_type: str
    dtype: torch.dtype
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    kind: str  # "varlen" | "dense" | "tree"
    pad_between_seqs: bool
    is_self: bool  # q and kv describe the same sequences
    host_lengths: bool  # per-sequence lengths are known on the host
    max_seqlen_q: int  # bucketed (`bucket`): exact to 16, 17 up to SHORT_SEQLEN, SHORT_SEQLEN + 1 above
    max_seqlen_kv: int  # bucketed likewise
    mask: Mask
    return_lse: bool
    deterministic: bool
    requires_grad: bool

    @staticmethod
    def bucket(length: int) -> int:
        if length < _LENGTH_BUCKET:
            return length
        return _LENGTH_BUCKET if length <= SHORT_SEQLEN else SHORT_SEQLEN + 1

    @property
    def short_seqs(self) -> bool:
        """No sequence longer than `triton_varlen.SHORT_SEQLEN` (queries or keys): `triton_varlen.short_batch`."""
        return short_batch(self.max_seqlen_q, self.max_seqlen_kv)


class NoBackendError(ValueError):
    """No backend can run the call; the message lists each backend's reason."""


def _env() -> tuple[str | None, frozenset[str]]:
    raw = env.get("PACKATTN_BACKEND", ""), env.get("PACKATTN_DISABLE", "")
    if torch.compiler.is_compiling():
        return _parse_env(*raw)
    parsed = _env_cache.get(raw)  # read on every call, parsed once per distinct value
    if parsed is None:
        if len(_env_cache) >= _CACHE_SIZE:
            _env_cache.clear()
        parsed = _env_cache[raw] = _parse_env(*raw)
    return parsed


def _parse_env(backend: str, disable: str) -> tuple[str | None, frozenset[str]]:
    return backend.strip() or None, frozenset(n.strip() for n in disable.split(",") if n.strip())


_env_cache: dict = {}


def reasons(params: Params, requested: str = "auto") -> list[tuple[str, str | None]]:
    """``(backend name, reason it cannot run or None)`` for every backend, in priority order."""
    forced, disabled = _env()
    want = forced or (None if requested == "auto" else requested)
    out = []
    for backend in REGISTRY:
        if backend.name in disabled:
            why = "disabled by PACKATTN_DISABLE"
        elif want is not None and backend.name != want:
            why = f"not the requested backend ({want})" + (" from PACKATTN_BACKEND" if forced else "")
        else:
            why = backend.unavailable() or backend.unsupported(params)
            if why is None and want is None:
                why = backend.auto_skip(params) or _deferred(backend, params, disabled)
        out.append((backend.name, why))
    return out


def _deferred(backend: Backend, params: Params, disabled: frozenset[str]) -> str | None:
    """Why auto dispatch passes over ``backend`` for the one it defers to (`Backend.defers_to`), if that one can
    run the call and is not disabled; None otherwise."""
    deferral = backend.defers_to(params)
    if deferral is None or deferral[0] in disabled:
        return None
    other = next(b for b in REGISTRY if b.name == deferral[0])
    if other.unavailable() or other.unsupported(params) or other.auto_skip(params):
        return None
    return f"{deferral[1]} (auto dispatch prefers {other.name})"


_cache: OrderedDict = OrderedDict()


def select(params: Params, requested: str = "auto") -> Backend:
    """The backend that runs a call with these params (cached per params + overrides)."""
    forced, disabled = _env()
    key = (params, requested, forced, disabled)
    compiling = torch.compiler.is_compiling()
    hit = _cache.get(key)
    if hit is not None:
        if not compiling:  # the cache is not touched while dynamo traces (it cannot replay the mutation)
            _cache.move_to_end(key)
        return hit
    names = {b.name for b in REGISTRY}
    for name, source in ((requested, "backend="), (forced, "PACKATTN_BACKEND=")):
        if name not in (None, "auto") and name not in names:
            raise ValueError(f"unknown backend {source}{name!r}; known: {', '.join(sorted(names))}")
    chosen = None
    listing = reasons(params, requested)
    for name, why in listing:
        if why is None:
            chosen = next(b for b in REGISTRY if b.name == name)
            break
        if not compiling:  # logging would break a torch.compile graph
            log.debug("packattn: skipping backend %s: %s", name, why)
    if chosen is None:
        lines = "\n".join(f"  {name}: {why}" for name, why in listing)
        raise NoBackendError(f"no packattn backend can run this call ({describe(params)}):\n{lines}")
    if not compiling:
        log.debug("packattn: using backend %s for %s", chosen.name, describe(params))
    if not compiling:
        _cache[key] = chosen
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return chosen


def clear_cache() -> None:
    _cache.clear()


def describe(params: Params) -> str:
    return (
        f"{params.kind} {params.device_type} {str(params.dtype).replace('torch.', '')} "
        f"heads {params.heads_q}/{params.heads_kv} d={params.head_dim}, {params.mask.describe()}"
        + (", padded" if params.pad_between_seqs else "")
        + (", lse" if params.return_lse else "")
        + (", deterministic" if params.deterministic else "")
    )
