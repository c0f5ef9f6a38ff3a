"""The measured-cost table that ``backend="auto"`` ranks backends by (`dispatch`), one JSON file per GPU
architecture: ``packattn/data/costs_<arch>.json`` (``sm90``: H100 and H200), written by ``packattn tune``
(`packattn.bench.tune`), which records the device, the torch / triton / FlashAttention-4 versions, the date
and the command line in the file's ``meta``.

A row is keyed on what dispatch keys a call on (`Key`): q/k and v head dims, GQA group (query heads per
key/value head), length regime (`regime`, of the longest of queries and keys, from the bucketed lengths of
`dispatch.Params`), mask kind (`mask_kind`) and forward-only vs with gradients. Its value is the time in ms of
each backend measured on the row's shapes (summed over them).

The regimes (`lengths.REGIME_BOUNDS`, their ranges `REGIME_LENGTHS`) count the forward's 128-row tiles of the
longest sequence, and ``packattn tune`` measures each on documents as long as it allows (short at 320 tokens too;
`bench.tune.tune_grid`):
``small`` (<= `lengths.SMALL_SEQLEN` = 16 rows, the small-seq kernels' range), ``tiny`` (<= `lengths.TINY_SEQLEN`
= 128: one tile; 128-token documents), ``mid`` (<= `lengths.MID_SEQLEN` = 256: two tiles; 256-token documents),
``short`` (<= `lengths.SHORT_SEQLEN` = 512: three or four tiles; 512- and 320-token documents), ``long`` (above; W1's
document lengths). Backends rank differently in each: at d = 64 MHA with gradients the triton backend leads at
200 tokens where FA4 leads at 512.

How a row *covers* a call (`lookup`), each rule a reason in ``packattn explain`` when it fails:

* the call runs on a CUDA device whose architecture has a table (none for the CPU);
* its dtype is fp16 or bf16 (the table is measured in bf16; fp16 runs the same kernels);
* it is a varlen or dense batch (trees are not measured);
* head dims, regime, mask kind and gradients match the row exactly, except that a call of a regime the table
  has no such row for is ranked by the row of its stand-in regime (`STAND_INS`): a table with no ``mid`` row
  for a call ranks it by its ``short`` row, and ``packattn explain`` says so;
* the GQA group is the measured group nearest to the call's on a log2 scale (ties: the smaller group).

Heads, token counts, padding between sequences, ``return_lse`` and ``deterministic`` are not in the key:
they decide which backends can run a call (`Backend.unsupported`), not how the ones that can are ranked.
`decide` ranks the backends that can run the call by the covering row; a row that measured none of them
decides nothing, and the priority rule of `dispatch` applies. An empty table therefore changes nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from packattn import lengths

SCHEMA = 1  # a schema-1 table may have no ``mid`` rows: `STAND_INS` covers those calls
REGIMES = tuple(name for name, _ in lengths.REGIME_BOUNDS)
# the longest sequence of each regime, as ``packattn explain`` names it
REGIME_LENGTHS = {name: lengths.regime_range(name) for name in REGIMES}
# regime -> the regime whose row ranks its calls where the table has no row of its own for them: the one measured
# at the nearest longer length (a table with no ``mid`` row for a call ranks it by its ``short`` row)
STAND_INS = {"mid": "short"}
MASKS = ("causal", "causal_top_left", "none", "window", "chunk")
META_KEYS = ("device", "torch", "triton", "fa4", "packattn", "date", "command", "dtype")


@dataclass(frozen=True)
class Key:
    """What a row is measured for and what a call is looked up by."""

    head_dim: int
    head_dim_v: int
    group: int
    regime: str
    mask: str
    grad: bool

    def describe(self) -> str:
        dims = str(self.head_dim) if self.head_dim_v == self.head_dim else f"{self.head_dim}/{self.head_dim_v}"
        return f"d={dims} group {self.group} {self.regime} {self.mask} {'fwd+bwd' if self.grad else 'fwd'}"


@dataclass(frozen=True)
class Row:
    key: Key
    ms: dict  # backend name -> ms (the sum over ``shapes``)
    shapes: tuple = ()  # what was measured: [{"lengths": ..., "heads": [q, kv], "ms": {...}}, ...]
    refused: dict = field(default_factory=dict)  # backend -> why tune skipped it


@dataclass(frozen=True)
class Table:
    arch: str
    meta: dict
    rows: tuple
    source: str  # the file it was read from

    def describe(self) -> str:
        if not self.rows:
            return f"{Path(self.source).name} (empty: nothing measured)"
        return f"{Path(self.source).name} ({self.meta.get('device')}, {self.meta.get('date')})"


@dataclass(frozen=True)
class Decision:
    """`decide`'s answer. ``choice`` is None when no row decided (then ``why`` says why: the priority rule
    applies); else the fastest measured backend of ``row`` that can run the call, and ``passed`` the reason
    for each other backend that could have run it."""

    choice: str | None
    why: str
    table: Table | None = None
    row: Row | None = None
    passed: dict = field(default_factory=dict)
    stand_in: str = ""  # why ``row`` is of another regime than the call's (`STAND_INS`), else ""

    def describe(self) -> str:
        """One line: which row decided (key, device, date, the times; a stand-in row says so), or that the
        priority rule did."""
        if self.choice is None:
            return f"the priority rule ({self.why})"
        times = ", ".join(f"{name} {ms:.3g} ms" for name, ms in sorted(self.row.ms.items(), key=lambda t: t[1]))
        note = f", {self.stand_in}" if self.stand_in else ""
        return f"cost table {self.table.describe()}, row {self.row.key.describe()}{note}: {times}"


# ------------------------------------------------------------------------------------ loading
def validate(data, source: str = "the cost table") -> None:
    """Raise ValueError naming the first problem of a parsed table: schema, arch, meta (every `META_KEYS`
    entry; device, versions, date and command non-empty once the table has rows) and rows (keys in range, times
    positive, no key twice)."""
    def bad(what: str):
        raise ValueError(f"{source}: {what}")

    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        bad(f"not a schema {SCHEMA} cost table (schema: {data.get('schema') if isinstance(data, dict) else data!r})")
    if not isinstance(data.get("arch"), str) or not data["arch"].startswith("sm"):
        bad(f"arch {data.get('arch')!r} is not an sm<major><minor> name")
    meta, rows = data.get("meta"), data.get("rows")
    if not isinstance(meta, dict) or not isinstance(rows, list):
        bad("needs a 'meta' object and a 'rows' list")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        bad(f"meta lacks {', '.join(missing)}")
    if rows:
        empty = [k for k in ("device", "torch", "triton", "packattn", "date", "command")
                 if not isinstance(meta[k], str) or not meta[k]]
        if empty:
            bad(f"meta {', '.join(empty)} must name what the rows were measured with")
    if meta["fa4"] is not None and not isinstance(meta["fa4"], str):
        bad("meta fa4 is the FlashAttention-4 version or null (not installed)")
    seen = set()
    for number, row in enumerate(rows):
        key = _row_key(row, lambda what, number=number: bad(f"row {number}: {what}"))
        if key in seen:
            bad(f"row {number}: {key.describe()} appears twice")
        seen.add(key)


def _row_key(row, bad) -> Key:
    if not isinstance(row, dict):
        bad("not an object")
    for name in ("head_dim", "head_dim_v", "group"):
        if not isinstance(row.get(name), int) or isinstance(row.get(name), bool) or row[name] < 1:
            bad(f"{name} must be a positive int, got {row.get(name)!r}")
    if row.get("regime") not in REGIMES:
        bad(f"regime {row.get('regime')!r} is not one of {', '.join(REGIMES)}")
    if row.get("mask") not in MASKS:
        bad(f"mask {row.get('mask')!r} is not one of {', '.join(MASKS)}")
    if not isinstance(row.get("grad"), bool):
        bad(f"grad must be true or false, got {row.get('grad')!r}")
    ms = row.get("ms")
    if not isinstance(ms, dict) or not ms:
        bad("ms must map at least one backend to its time")
    for name, value in ms.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            bad(f"ms[{name!r}] must be a positive number of milliseconds, got {value!r}")
    return Key(row["head_dim"], row["head_dim_v"], row["group"], row["regime"], row["mask"], row["grad"])


def load(path) -> Table:
    """Read and validate a table file (ValueError naming the problem)."""
    path = path if hasattr(path, "read_text") else Path(path)  # a path, or a package resource (`packaged_path`)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON cost table ({e})") from None
    validate(data, str(path))
    rows = tuple(Row(_row_key(r, None), dict(r["ms"]), tuple(r.get("shapes", ())), dict(r.get("refused", {})))
                 for r in data["rows"])
    return Table(data["arch"], dict(data["meta"]), rows, str(path))


def packaged_path(arch: str):
    """Where the table of ``arch`` ships inside the package (it may not exist)."""
    return resources.files("packattn").joinpath("data", f"costs_{arch}.json")


_tables: dict[str, Table | None] = {}  # arch -> the packaged table (None: none ships for it)
_override: list = []  # [Table] while `use` has replaced the packaged tables


def table(arch: str) -> Table | None:
    """The table dispatch reads for ``arch``: the one `use` set, else the packaged file (read once)."""
    if _override:
        return _override[0] if _override[0].arch == arch else None
    if arch not in _tables:
        path = packaged_path(arch)
        _tables[arch] = load(path) if path.is_file() else None
    return _tables[arch]


def use(source) -> Table | None:
    """Make dispatch read ``source`` (a path or a `Table`) instead of the packaged tables, for every arch but the
    table's own none; ``None`` goes back to the packaged ones. Returns the table. Decisions already cached by
    `dispatch` stay: call ``dispatch.clear_cache()`` after (`packattn tune --check`, tests)."""
    _override.clear()
    _tables.clear()
    if source is None:
        return None
    loaded = source if isinstance(source, Table) else load(source)
    _override.append(loaded)
    return loaded


# ------------------------------------------------------------------------------------ lookup
def device_arch(params) -> str | None:
    """``sm<major><minor>`` of the current CUDA device for a CUDA call, else None (the CPU has no table)."""
    if params.device_type != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def regime(max_seqlen_q: int, max_seqlen_kv: int) -> str:
    """The length regime of bucketed (or real) longest lengths, queries or keys (`REGIME_LENGTHS`)."""
    return lengths.regime(max(max_seqlen_q, max_seqlen_kv))


def mask_kind(mask, is_self: bool) -> str:
    """``chunk`` (chunks, with or without a window), ``window`` (any window, causal or not), ``causal``
    (bottom-right, or top-left on self-attention where the two are the same mask), ``causal_top_left``
    (cross-attention) or ``none``."""
    if mask.chunk_size is not None:
        return "chunk"
    if mask.window is not None:
        return "window"
    if mask.causal:
        return "causal" if mask.align == "bottom_right" or is_self else "causal_top_left"
    return "none"


def call_key(params) -> tuple[Key | None, str]:
    """``(the key of a call, "")``, or ``(None, why the table cannot cover it)``."""
    if params.kind == "tree":
        return None, "tree calls are not in the table"
    if str(params.dtype) not in ("torch.bfloat16", "torch.float16"):
        return None, f"the table is measured in bf16 (covers fp16/bf16), not {str(params.dtype).replace('torch.', '')}"
    group = max(1, params.heads_q // max(1, params.heads_kv))
    return Key(params.head_dim, params.head_dim_v, group, regime(params.max_seqlen_q, params.max_seqlen_kv),
               mask_kind(params.mask, params.is_self), params.requires_grad), ""


def lookup(params) -> tuple[Table | None, Row | None, str]:
    """``(table, the row covering the call, "" or why it is a stand-in row)`` or ``(table or None, None, why
    none covers it)``."""
    arch = device_arch(params)
    if arch is None:
        return None, None, ("no CUDA device in this process" if params.device_type == "cuda"
                            else f"no cost table for {params.device_type}")
    found = table(arch)
    if found is None:
        return None, None, f"no cost table for {arch}"
    key, why = call_key(params)
    if key is None:
        return found, None, why
    row, note = covering(found, key)
    return found, row, note


def covering(found: Table, key: Key, stand_ins: dict | None = None) -> tuple[Row | None, str]:
    """``(the row of ``found`` covering a call of ``key``, "" or why it is of the stand-in regime)``, or ``(None,
    why none covers it)``: same head dims, mask kind and gradients, the key's regime (else its stand-in's:
    ``stand_ins``, default `STAND_INS`), the nearest measured group."""
    stand_in = (STAND_INS if stand_ins is None else stand_ins).get(key.regime)
    for regime_name in (key.regime, stand_in) if stand_in else (key.regime,):
        same = [r for r in found.rows if (r.key.head_dim, r.key.head_dim_v, r.key.regime, r.key.mask, r.key.grad)
                == (key.head_dim, key.head_dim_v, regime_name, key.mask, key.grad)]
        if same:
            best = min(same, key=lambda r: (abs(math.log2(r.key.group) - math.log2(key.group)), r.key.group))
            return best, "" if regime_name == key.regime else (
                f"standing in for the {key.regime} regime (longest {REGIME_LENGTHS[key.regime]}; the table has no "
                f"{key.regime} row here)")
    also = f" (nor a {stand_in} row to stand in)" if stand_in else ""
    return None, f"{found.describe()} has no row for {key.describe()}{also}"


def decide(params, candidates: list[str]) -> Decision:
    """Rank ``candidates`` (the backends that can run the call, in priority order) by the covering row: the
    fastest one it measured (the first in priority order on a tie). Each other candidate is passed over with
    its time against the pick's, or as not measured. No covering row, or one that measured no candidate: a
    Decision without a choice (the priority rule decides)."""
    found, row, why = lookup(params)
    if row is None:
        return Decision(None, why, found)
    return rank(found, row, candidates, _stale(found), why)


def rank(found: Table, row: Row, candidates: list[str], stale: dict, stand_in: str = "") -> Decision:
    """`decide` once ``row`` covers the call: ``stale`` the backends whose times do not apply (`_stale`),
    ``stand_in`` why the row is of another regime (`covering`), else ""."""
    measured = [name for name in candidates if name in row.ms and name not in stale]
    if not measured:
        unusable = [name for name in candidates if name in row.ms]
        what = (f"times only {', '.join(unusable)}, not what runs here ({stale[unusable[0]]})" if unusable else
                f"measured none of {', '.join(candidates) or 'the backends that can run it'}")
        return Decision(None, f"{found.describe()}, row {row.key.describe()}, {what}", found, row, stand_in=stand_in)
    choice = min(measured, key=lambda name: (row.ms[name], measured.index(name)))
    where = f"cost table row {row.key.describe()}"
    passed = {}
    for name in candidates:
        if name == choice:
            continue
        if name in stale and name in row.ms:
            passed[name] = f"its {row.ms[name]:.3g} ms in the {where} are not what runs here: {stale[name]}"
        elif name in row.ms:
            passed[name] = f"{row.ms[name]:.3g} ms vs {choice} {row.ms[choice]:.3g} ms in the {where}"
        else:
            passed[name] = f"not measured in the {where} (auto picks the fastest measured: {choice})"
    return Decision(choice, "", found, row, passed, stand_in)


def _stale(found: Table) -> dict:
    """``{backend: why}`` for the backends whose times in a Hopper table do not describe what they run now: the
    triton backends' times are of their sm_90 kernels, which `support.sm90_kernels_off` may switch off for every
    call (``PACKATTN_PORTABLE=1``, Triton's interpreter, a Triton they are not built for)."""
    if not found.arch.startswith("sm9"):
        return {}
    from packattn.ops.runtime import support

    off = support.sm90_kernels_off()
    return {} if off is None else {"triton": off, "triton_tree": off}
