"""packattn's environment switches: the only module of packattn that reads ``os.environ``.

`KNOBS` lists the user-facing switches; ``TRITON_INTERPRET`` (Triton's own switch) is read here too. The
hot path reads a switch on every call, so that one set at run time takes effect at the next call.
``os.environ.get`` encodes the key and decodes the value each time (~0.8-1.6 us); `get` looks the encoded
key up in the mapping ``os.environ`` keeps (``os.environ._data``, updated by every ``os.environ[...] = ...``,
``putenv`` through ``os.environ``, and pytest's ``monkeypatch.setenv``), ~20 ns (benchmarks/NOTES.md, v20);
where that mapping is not the CPython one it falls back to ``os.environ.get``.
"""

from __future__ import annotations

import os
import sys

_DATA = getattr(os.environ, "_data", None)
_ENCODE_KEY = getattr(os.environ, "encodekey", None)
_DECODE_VALUE = getattr(os.environ, "decodevalue", None)
_FAST = isinstance(_DATA, dict) and callable(_ENCODE_KEY) and callable(_DECODE_VALUE)
# The user-facing switches, each with what it does (the README's knob table lists exactly these).
KNOBS = {
    "PACKATTN_BACKEND": "the backend packattn.attention uses when the call names none (default: auto)",
    "PACKATTN_DISABLE": "comma-separated backends that auto dispatch passes over",
    "PACKATTN_LOG": "comma-separated log topics to print (dispatch)",
    "PACKATTN_CP_OVERLAP_GROUPS": "kv-head groups the context-parallel all-gather overlaps with attention (1: none)",
    "PACKATTN_PORTABLE": "=1: the triton backends run only the portable Triton kernels (no Gluon, no fast launch)",
}
# The names packattn reads, encoded up front: the cache of encoded keys then does not change when torch.compile
# traces the first call (dynamo guards on that dict's contents: a key added while tracing would recompile the
# next call). A name missing here still works; it is cached on its first read outside tracing.
NAMES = (*KNOBS, "TRITON_INTERPRET")
_keys: dict[str, object] = {name: _ENCODE_KEY(name) for name in NAMES} if _FAST else {}  # name -> encoded key


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, without re-encoding ``name`` on every call."""
    if not _FAST:
        return os.environ.get(name, default)
    key = _keys.get(name)
    if key is None:
        key = _ENCODE_KEY(name)
        if not _tracing():
            _keys[name] = key
    raw = _DATA.get(key)
    return default if raw is None else _DECODE_VALUE(raw)


def _tracing() -> bool:
    """torch.compile is tracing (checked without importing torch: packattn.jax reads this module too)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


LOG_TOPICS = ("dispatch",)  # what PACKATTN_LOG can turn on
_log_topics: dict[str, frozenset[str]] = {}  # raw value -> parsed


def log_topics() -> frozenset[str]:
    """The topics ``PACKATTN_LOG`` turns on: comma-separated names from `LOG_TOPICS` (unset, empty or "0":
    none). Read on every call, parsed once per distinct value; an unknown name is a ValueError listing them."""
    raw = get("PACKATTN_LOG", "") or ""
    topics = _log_topics.get(raw)
    if topics is None:
        topics = frozenset(t.strip() for t in raw.split(",") if t.strip() and t.strip() != "0")
        unknown = topics - set(LOG_TOPICS)
        if unknown:
            raise ValueError(f"PACKATTN_LOG={raw!r} names unknown topic(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(LOG_TOPICS)}")
        if len(_log_topics) >= 64:
            _log_topics.clear()
        _log_topics[raw] = topics
    return topics
