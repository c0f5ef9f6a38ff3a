"""Backend selection: `Params` -> the first capable backend by priority, with a reason for every skip.

Environment (read through `packattn.env` on every call; the overrides are part of the cache key):

* ``PACKATTN_BACKEND=<name>`` forces one backend (an error lists why it cannot run, if it cannot);
* ``PACKATTN_DISABLE=<name>[,<name>...]`` switches backends off, e.g. a kernel in production;
* ``PACKATTN_LOG=dispatch``: one INFO line on the ``packattn.dispatch`` logger per new decision (the
  call, the backend, why each backend ahead of it was passed over), printed to stderr when logging is
  not configured. Decisions are cached per `Params`, so a training loop logs each kind of call once.

An unknown backend name in any of them is a ValueError that lists the known names. The backend
modules are imported on the first decision (`packattn.backends.registry`), not with this module.
"""

from __future__ import annotations

import logging
import operator
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from packattn import backends, env
from packattn.lengths import SHORT_SEQLEN, short_batch
from packattn.mask import Mask
from packattn.varlen import Varlen

if TYPE_CHECKING:
    from packattn.backends.base import Backend

log = logging.getLogger("packattn.dispatch")

# longest sequences in the dispatch key: exact up to 16 (the small-seq kernels care), then one bucket up to
# SHORT_SEQLEN (where FA4 gives way to our kernels' short-batch backward, `Fa4Backend.defers_to`), one above it
_LENGTH_BUCKET = 17
_TRACED_BUCKET = SHORT_SEQLEN + 1  # the bucket of a traced call outside the small-seq regime (`traced_buckets`)
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
    traced: bool = False  # the call is being traced by torch.compile (some backends cannot be)

    @staticmethod
    def bucket(length: int) -> int:
        if length < _LENGTH_BUCKET:
            return length
        return _LENGTH_BUCKET if length <= SHORT_SEQLEN else SHORT_SEQLEN + 1

    @staticmethod
    def traced_buckets(max_seqlen_q, max_seqlen_kv) -> tuple[int, int]:
        """`bucket` of both lengths while torch.compile traces, where they are symbolic (they vary per batch,
        and a branch on them becomes a guard, so a new packing would recompile). One branch is kept: one query
        over at most 16 keys (the small-seq regime) gives ``(1, 16)``; anything else the bucket above
        SHORT_SEQLEN, whatever the lengths (so auto dispatch does not defer short batches, `Backend.defers_to`)."""
        if max_seqlen_q <= 1 and max_seqlen_kv < _LENGTH_BUCKET:
            return 1, _LENGTH_BUCKET - 1
        return _TRACED_BUCKET, _TRACED_BUCKET

    @property
    def short_seqs(self) -> bool:
        """No sequence longer than `lengths.SHORT_SEQLEN` (queries or keys): `lengths.short_batch`."""
        return short_batch(self.max_seqlen_q, self.max_seqlen_kv)


def call_params(seqs, *, device_type: str, dtype: torch.dtype, heads_q: int, heads_kv: int, head_dim: int,
                head_dim_v: int | None = None, mask: Mask, dense: bool = False, return_lse: bool = False,
                deterministic: bool = False, requires_grad: bool = False) -> Params:
    """The `Params` of a call over the descriptor ``seqs``: a `Varlen` (``dense``: the uniform one of a
    bshd/sbhd batch) or a `packattn.Tree` (its own mask: ``mask`` is then the causal part of it). The one
    place that keys a call: `packattn.attention` and the tools that describe a call without its tensors
    (``packattn explain``, the demo). While torch.compile traces, the descriptor's per-batch host values are
    symbolic: they are read without branching (`Params.traced_buckets`) and the host copies of the lengths
    not at all (a tuple read is a guard), so one graph serves every packing."""
    traced = torch.compiler.is_compiling()
    if isinstance(seqs, Varlen):
        kind, pad, is_self = "dense" if dense else "varlen", seqs.pad_between_seqs, seqs.is_self
        host = not traced and seqs.lengths_q is not None
        if traced:
            max_q, max_kv = Params.traced_buckets(*seqs.traced_max_seqlens())
        else:
            max_q, max_kv = Params.bucket(seqs.max_seqlen_q), Params.bucket(seqs.max_seqlen_kv)
    else:
        kind, pad, is_self, host = "tree", False, True, True
        max_q = max_kv = _TRACED_BUCKET if traced else Params.bucket(seqs.max_depth)  # trees: never small-seq
    return Params(
        device_type=device_type, dtype=dtype, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
        head_dim_v=head_dim if head_dim_v is None else head_dim_v, kind=kind, pad_between_seqs=pad, is_self=is_self,
        host_lengths=host, max_seqlen_q=max_q, max_seqlen_kv=max_kv, mask=mask, return_lse=bool(return_lse),
        deterministic=bool(deterministic), requires_grad=bool(requires_grad), traced=traced)


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
    disabled = frozenset(n.strip() for n in disable.split(",") if n.strip())
    unknown = disabled and disabled - _names()
    if unknown:
        raise ValueError(f"PACKATTN_DISABLE={disable!r} names unknown backend(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(_names()))}")
    return backend.strip() or None, disabled


def _names() -> set[str]:
    return {b.name for b in backends.registry()}


_env_cache: dict = {}


def reasons(params: Params, requested: str = "auto") -> list[tuple[str, str | None]]:
    """``(backend name, reason it cannot run or None)`` for every backend, in priority order."""
    forced, disabled = _env()
    want = forced or (None if requested == "auto" else requested)
    out = []
    for backend in backends.registry():
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
    other = backends.get(deferral[0])
    if other.unavailable() or other.unsupported(params) or other.auto_skip(params):
        return None
    return f"{deferral[1]} (auto dispatch prefers {other.name})"


_cache: OrderedDict = OrderedDict()


def select(params: Params, requested: str = "auto") -> Backend:
    """The backend that runs a call with these params (cached per params + overrides)."""
    if torch.compiler.is_compiling():
        return backends.get(_select_outside_trace(*_constant_key(params), requested=requested))
    return _select(params, requested)


def _select(params: Params, requested: str) -> Backend:
    """`select` on the eager path (also what `_select_outside_trace` runs, eagerly, for a trace)."""
    forced, disabled = _env()
    # PACKATTN_PORTABLE changes what the triton backends run, so whether FA4 defers to them (`Fa4Backend.defers_to`)
    key = (params, requested, forced, disabled, env.get("PACKATTN_PORTABLE"))
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    _check_names(requested, forced)
    chosen = None
    listing = reasons(params, requested)
    for name, why in listing:
        if why is None:
            chosen = backends.get(name)
            break
        log.debug("packattn: skipping backend %s: %s", name, why)
    if chosen is None:
        lines = "\n".join(f"  {name}: {why}" for name, why in listing)
        raise NoBackendError(f"no packattn backend can run this call ({describe(params)}):\n{lines}")
    log.debug("packattn: using backend %s for %s", chosen.name, describe(params))
    if "dispatch" in env.log_topics():
        _log_decision(params, requested, chosen.name, listing)
    _cache[key] = chosen
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return chosen


def _constant_key(params: Params) -> tuple:
    """``params`` as constants (what a function marked constant for dynamo can take). A field that is symbolic
    (a dimension dynamo made dynamic: heads after a change of rank, ``is_self`` of a dense batch of dynamic
    lengths) is specialised here (``operator.index`` / a branch: a guard), as tracing `select` would have."""
    m = params.mask
    ints = (params.heads_q, params.heads_kv, params.head_dim, params.head_dim_v, params.max_seqlen_q,
            params.max_seqlen_kv)
    flags = (params.pad_between_seqs, params.is_self, params.host_lengths, params.return_lse, params.deterministic,
             params.requires_grad)
    heads_q, heads_kv, head_dim, head_dim_v, max_q, max_kv = (operator.index(n) for n in ints)
    pad, is_self, host, lse, deterministic, grad = (True if flag else False for flag in flags)
    return (params.device_type, params.dtype, heads_q, heads_kv, head_dim, head_dim_v, params.kind, pad, is_self,
            host, max_q, max_kv, (m.causal, m.window, m.chunk_size, m.align), lse, deterministic, grad,
            True if params.traced else False)


def _select_outside_trace(*key, requested: str) -> str:
    """The name of `select`'s backend, decided eagerly from inside a torch.compile trace: dynamo calls a function
    marked constant instead of tracing it and puts its result in the graph. So dispatch's cache, the lazily
    built registry, the environment and the backends' probes (imports included) are read without becoming
    guards: a cold cache, or eager calls between compiled ones, recompile nothing. The environment is read once,
    when the graph is traced."""
    fields = list(key)
    fields[12] = Mask(*fields[12])
    return _select(Params(*fields), requested).name


# what torch.compiler.assume_constant_result sets, set here without importing torch._dynamo (seconds) with packattn
_select_outside_trace._dynamo_marked_constant = True


def clear_cache() -> None:
    _cache.clear()


def describe(params: Params) -> str:
    """One line for logs and errors: what dispatch keyed the call on."""
    head_dims = str(params.head_dim) if params.head_dim_v == params.head_dim else f"{params.head_dim}/{params.head_dim_v}"
    return (
        f"{params.kind} {params.device_type} {str(params.dtype).replace('torch.', '')} "
        f"heads {params.heads_q}/{params.heads_kv} d={head_dims}, {params.mask.describe()}"
        + (", padded" if params.pad_between_seqs else "")
        + (", lse" if params.return_lse else "")
        + (", deterministic" if params.deterministic else "")
        + (", grad" if params.requires_grad else "")
        + f", longest {_length_class(params.max_seqlen_q)}"
        + ("" if params.max_seqlen_kv == params.max_seqlen_q else f"/{_length_class(params.max_seqlen_kv)}")
    )


def _length_class(bucketed: int) -> str:
    """A bucketed length (`Params.bucket`) as the range of real lengths it stands for."""
    if bucketed < _LENGTH_BUCKET:
        return str(bucketed)
    return f"{_LENGTH_BUCKET}-{SHORT_SEQLEN}" if bucketed <= SHORT_SEQLEN else f">{SHORT_SEQLEN}"


def _log_decision(params: Params, requested: str, chosen: str, listing) -> None:
    """The ``PACKATTN_LOG=dispatch`` line: logged at INFO on ``packattn.dispatch``; when neither that logger
    nor the root logger has a handler (logging not configured), a stderr handler is added to it once."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)
    passed = [f"{name}: {why}" for name, why in listing[: [n for n, _ in listing].index(chosen)]]
    log.info("packattn dispatch: %s (backend=%s) -> %s%s", describe(params), requested, chosen,
             f" (passed over: {'; '.join(passed)})" if passed else "")


def explain(params: Params, requested: str = "auto") -> tuple[str | None, list[tuple[str, str | None]]]:
    """``(the backend `select` picks, None when none can run the call; every backend's reason)``, computed
    afresh (the cache is neither read nor filled): what ``packattn explain`` prints."""
    _check_names(requested, _env()[0])
    listing = reasons(params, requested)
    return next((name for name, why in listing if why is None), None), listing


def _check_names(requested: str, forced: str | None) -> None:
    names = _names()
    for name, source in ((requested, "backend="), (forced, "PACKATTN_BACKEND=")):
        if name not in (None, "auto") and name not in names:
            raise ValueError(f"unknown backend {source}{name!r}; known: {', '.join(sorted(names))}")
