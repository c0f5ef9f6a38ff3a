"""Reading packattn's environment switches on the hot path.

The launchers read their A/B switches (``PACKATTN_TRITON_BWD``, ``PACKATTN_GLUON_*_CONFIG``,
``TRITON_INTERPRET``, ...) on every call, so that a switch set at run time takes effect at the next
call. ``os.environ.get`` encodes the key and decodes the value each time (~0.8-1.6 us); a W8
forward + backward read ~30 of them, a measurable share of its host time (benchmarks/NOTES.md,
v20). `get` looks the encoded key up in the mapping ``os.environ`` keeps (``os.environ._data``,
updated by every ``os.environ[...] = ...``, ``putenv`` through ``os.environ``, and pytest's
``monkeypatch.setenv``), ~20 ns; where that mapping is not the CPython one it falls back to
``os.environ.get``.
"""

from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None)
_ENCODE_KEY = getattr(os.environ, "encodekey", None)
_DECODE_VALUE = getattr(os.environ, "decodevalue", None)
_FAST = isinstance(_DATA, dict) and callable(_ENCODE_KEY) and callable(_DECODE_VALUE)
_keys: dict[str, object] = {}  # name -> encoded key


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, without re-encoding ``name`` on every call."""
    if not _FAST:
        return os.environ.get(name, default)
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = _ENCODE_KEY(name)
    raw = _DATA.get(key)
    return default if raw is None else _DECODE_VALUE(raw)
