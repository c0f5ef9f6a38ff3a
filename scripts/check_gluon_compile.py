"""Compile the warp-specialised Gluon Hopper forward (`packattn.ops.varlen.fwd_sm90`) for sm_90a on a machine
without a GPU, for every mask combination and head dim, and check what matters before a GPU run:

* shared memory (must fit the 227 KB of an H100/H200 SM) and ptxas registers / spills (a spill access inside a
  main loop is a problem, bytes outside them are reported);
* ptxas "wgmma ... serialized" warnings (ptxas silently drops the async overlap when it cannot
  keep wgmma operands in registers);
* proof of the overlap: inside the main loop the PTX holds ``wgmma.wait_group.sync.aligned n`` with
  ``n >= 1`` (and the TTGIR ``warp_group_dot_wait {pendings = n}``), i.e. a wgmma stays in flight while the
  warp group runs the softmax (n = 2 where the value head dim is in two column parts: two PV groups);
* per partition, the setmaxnreg budget and the highest register the partition's SASS touches, and per
  loop (innermost loops of the PTX, from LLVM's loop annotations) the barriers left in it: ``cta_bar``
  (bar.sync over the whole CTA) and ``named_bar`` ({threads: count}: a barrier over one partition's warps).

    python scripts/check_gluon_compile.py [--head-dims 64 128] [--dtypes bf16 fp16] [--masks R RT ...]
    python scripts/check_gluon_compile.py --head-dims 96 192 192:128 128:64 --config 128,64,3,8
                                          # q/k head dim, or q/k:v; a dim that is not a power of two runs in
                                          # two column parts (`packattn.ops.varlen.fwd_sm90_parts`)
    python scripts/check_gluon_compile.py --dump /tmp/gluon_asm   # also write ttgir/ptx per variant
    python scripts/check_gluon_compile.py --config 64,64,3,4      # block_m,block_n,stages,num_warps[,trim]
    python scripts/check_gluon_compile.py --head-dims 256 --config 128,32,3,8,lazy=8   # lazy rescaling
    python scripts/check_gluon_compile.py --head-dims 256 --config 128,64,2,8,split   # separate K / V barriers
    python scripts/check_gluon_compile.py --selected              # every table entry of packattn.ops.varlen.configs
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvidia_tools import bundled_ptxas, disassemble  # noqa: E402
from packattn.ops.runtime.fast_launch import COMPILE_OPTIONS  # noqa: E402
from packattn.ops.runtime.sm90 import CTA_SHARED, _smem_layout, dims_key, ws_split  # noqa: E402
from packattn.ops.varlen import configs  # noqa: E402
from packattn.ops.varlen.configs import GluonConfig  # noqa: E402
from packattn.ops.varlen.fwd_sm90 import varlen_fwd_gluon_ws_kernel  # noqa: E402
from packattn.ops.varlen.fwd_sm90_parts import part_hi  # noqa: E402
from packattn.ops.varlen.launch_sm90 import (  # noqa: E402
    fwd_resources,
    fwd_variant_constexprs,
    shared_bytes,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHARED_LIMIT = CTA_SHARED  # bytes of shared memory one CTA may use on sm_90
CONFIG_FORM = "block_m,block_n,stages,num_warps[,trim][,lazy=T][,split][,qregs][,vec]"  # `parse_config`
# L(eft window) R(ight window / causal) C(hunk) T(op-left); "" = no mask
MASKS = ["", "R", "RT", "L", "LR", "LRT", "C", "CR", "CRT", "LCR"]
POINTERS = ("Out", "Lse", "tiles", "cu_seqlens_q", "cu_seqlens_kv", "row_offsets_q", "row_offsets_kv")


def _descriptor_type(dtype: torch.dtype, block: list[int]) -> str:
    """The signature string the JIT would give a host `TensorDescriptor` with this block."""
    dummy = torch.empty(256, 2048, dtype=dtype)  # CPU tensor: only its dtype / alignment matter
    return mangle_type(TensorDescriptor(dummy, list(dummy.shape), list(dummy.stride()), block,
                                        _smem_layout(tuple(block), dtype)))


def parse_config(text: str) -> GluonConfig:
    """``"block_m,block_n,stages,num_warps[,trim][,lazy=T][,split][,qregs][,vec]"`` as a `GluonConfig` (``lazy=T``:
    ``rescale_threshold=T``)."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    extra = {"trim": False}
    for part in parts[4:]:
        name, _, value = part.partition("=")
        if part == "trim":
            extra["trim"] = True
        elif part == "split":
            extra["split_kv"] = True
        elif part == "qregs":
            extra["q_in_regs"] = True
        elif part == "vec":
            extra["vec_store"] = True
        elif name == "lazy" and value:
            extra["rescale_threshold"] = float(value)
        else:
            raise ValueError(f"{text!r}: expected {CONFIG_FORM}")
    if len(parts) < 4:
        raise ValueError(f"{text!r}: expected {CONFIG_FORM}")
    return GluonConfig(*(int(x) for x in parts[:4]), **extra)


def parse_dims(text: str) -> tuple[int, int]:
    """``"d"`` or ``"d:d_v"`` as ``(q/k head dim, value head dim)``."""
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(x.strip().isdigit() for x in parts):
        raise ValueError(f"{text!r}: expected a head dim d or d:d_v")
    return int(parts[0]), int(parts[-1])


def dims_label(dims: tuple[int, int]) -> str:
    return str(dims[0]) if dims[0] == dims[1] else f"{dims[0]}:{dims[1]}"


def table_key(dims: tuple[int, int]):
    """The key of ``dims`` in the forward config tables (`sm90.dims_key`)."""
    return dims_key(*dims)


def label_of(cfg: GluonConfig) -> str:
    return (f"{cfg.block_m},{cfg.block_n},{cfg.stages},{cfg.num_warps}" + (",trim" if cfg.trim else "")
            + ("" if cfg.rescale_threshold is None else f",lazy={cfg.rescale_threshold:g}")
            + (",split" if cfg.split_kv else "") + (",qregs" if cfg.q_in_regs else "")
            + (",vec" if cfg.vec_store else ""))


def selected_configs(dims) -> list[GluonConfig]:
    """The forward configurations the launcher can select at ``dims`` (every table of `configs`; keys
    `table_key`)."""
    key = table_key(dims)
    tables = tuple(configs.fwd_tables().values())
    return list(dict.fromkeys(t[key] for t in tables if key in t))


def part_blocks(dims: tuple[int, int], block_m: int, block_n: int) -> dict:
    """The kernel's descriptor arguments as the launcher builds them: name -> TMA block ``[rows, columns]``, or
    None (``*_lo_desc`` where a head dim is a power of two: one column part)."""
    (d, dv), blocks = dims, {}
    for name, rows, dim in (("q", block_m, d), ("k", block_n, d), ("v", block_n, dv)):
        hi = part_hi(dim)
        blocks[f"{name}_desc"] = [rows, hi]
        blocks[f"{name}_lo_desc"] = [rows, dim - hi] if dim > hi else None
    return blocks


def compile_variant(dtype_name: str, dims, mask: str, cfg=None):
    """``triton.compile`` of one variant as `launch_sm90.gluon_fwd` launches it (the default configuration
    unless ``cfg``); ``dims``: a head dim or ``(q/k, v)`` head dims. The int and pointer arguments get
    ``tt.divisibility = 16`` where a real launch (16-aligned tensors, strides that are multiples of 16) would
    give it."""
    d, dv = (dims, dims) if isinstance(dims, int) else dims
    if cfg is None:
        if table_key((d, dv)) not in configs.CONFIGS:
            raise ValueError(f"no forward config for head dims {dims_label((d, dv))} in configs.CONFIGS: give --config")
        cfg = configs.CONFIGS[table_key((d, dv))]
    res = fwd_resources(cfg, d, dv)
    constexprs = dict(HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                      HAS_LEFT="L" in mask, HAS_RIGHT="R" in mask, HAS_CHUNK="C" in mask, TOP_LEFT="T" in mask,
                      TRIM=cfg.trim, CONSUMER_REGS=res["consumer_regs"], PRODUCER_REGS=res["producer_regs"],
                      num_warps=4, **fwd_variant_constexprs(cfg))
    blocks = part_blocks((d, dv), cfg.block_m, cfg.block_n)
    constexprs.update({name: None for name, block in blocks.items() if block is None})
    options = {"num_stages": 1, "num_warps": 4, "maxnreg": res["maxnreg"], **COMPILE_OPTIONS}
    aligned = set(POINTERS) | {"stride_o_row", "stride_o_head", "stride_lse_head"}  # (rows, heads, d): d | strides
    compiled = compile_forward_kernel(varlen_fwd_gluon_ws_kernel, dtype_name, d, cfg.block_m, cfg.block_n,
                                      constexprs, options, POINTERS, aligned, blocks)
    return cfg, compiled


def compile_forward_kernel(fn, dtype_name: str, head_dim: int, block_m: int, block_n: int, constexprs: dict,
                           options: dict, int_pointers, aligned, blocks: dict | None = None):
    """``triton.compile`` of a Gluon forward kernel for sm_90a: q / k / v descriptors of ``[block_m |
    block_n, head_dim]`` blocks (``blocks``: descriptor argument -> block, for those not in ``constexprs``),
    ``Out`` in the dtype, ``Lse`` float32, ``int_pointers`` int32 tensors, ``qk_scale_log2`` float32, other
    arguments int32; ``aligned`` get ``tt.divisibility = 16``."""
    dtype = DTYPES[dtype_name]
    blocks = blocks or {"q_desc": [block_m, head_dim], "k_desc": [block_n, head_dim], "v_desc": [block_n, head_dim]}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in blocks:
            signature[name] = _descriptor_type(dtype, blocks[name])
        elif name == "Out":
            signature[name] = "*" + dtype_name
        elif name == "Lse":
            signature[name] = "*fp32"
        elif name in int_pointers:
            signature[name] = "*i32"
        elif name == "qk_scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned}
    src = GluonASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_report(ptx: str) -> tuple[str, list[str]]:
    """(registers/spills line, performance warnings) from triton's bundled ptxas for sm_90a."""
    ptxas = bundled_ptxas()
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    done = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    text = done.stderr + done.stdout
    usage = " | ".join(line.split("info    : ")[-1].strip() for line in text.splitlines()
                       if "registers" in line or "spill" in line)
    warnings = [line.strip() for line in text.splitlines() if "warning" in line.lower() or "C7515" in line]
    return usage or text.strip()[-300:], warnings


_BLOCK_START = re.compile(r"^(?:\$L__(BB\d+_\d+):|// %bb\.(\d+):)", re.M)


def _ptx_loops(ptx: str) -> dict[str, str]:
    """Innermost-loop bodies of the PTX, keyed by loop header: the text of every basic block whose
    innermost enclosing loop (from LLVM's loop annotations, "in Loop: Header=BB0_7" / "This Loop
    Header") is that header. Child loops are not part of their parent's body."""
    starts = [m.start() for m in _BLOCK_START.finditer(ptx)] + [len(ptx)]
    loops: dict[str, list[str]] = {}
    for a, b in zip(starts, starts[1:]):
        block = ptx[a:b]
        lines = block.splitlines()
        label = _BLOCK_START.match(block)
        name = label.group(1) or f"bb.{label.group(2)}"
        notes = [lines[0]] + [ln for ln in lines[1:] if ln.strip().startswith("//")][:6]
        notes = " ".join(ln for ln in notes)
        if "Loop Header" in notes:
            header = name
        else:
            found = re.search(r"in Loop: Header=(BB\d+_\d+)", notes)
            if not found:
                continue
            header = found.group(1)
        loops.setdefault(header, []).append(block)
    return {h: "".join(blocks) for h, blocks in loops.items()}


def _loop_stats(body: str) -> dict:
    """Static instruction counts of one loop body (both softmax branches are in it). ``cta_bar``:
    ``bar.sync id`` / ``barrier.sync id`` over all the CTA's threads; ``named_bar``: ``bar.sync id,
    threads`` (a barrier over one partition's warps), listed as ``{threads: count}``."""
    named: dict[int, int] = {}
    for m in re.finditer(r"\b(?:bar|barrier)\.sync(?:\.aligned)?\s+\d+\s*,\s*(\d+)\s*;", body):
        named[int(m.group(1))] = named.get(int(m.group(1)), 0) + 1
    cta = len(re.findall(r"\b(?:bar|barrier)\.sync(?:\.aligned)?\s+\d+\s*;", body))
    return {"mma_async": body.count("wgmma.mma_async"),
            "wait_n": len(re.findall(r"wgmma\.wait_group\.sync\.aligned [1-9];", body)),
            "wait0": body.count("wgmma.wait_group.sync.aligned 0;"), "ex2": body.count("ex2.approx"),
            "cta_bar": cta, "named_bar": named, "mbar_wait": body.count("mbarrier.try_wait"),
            "mbar_arrive": len(re.findall(r"mbarrier\.arrive(?!\.expect_tx)", body)),
            "tma": body.count("cp.async.bulk.tensor")}


def overlap_proof(compiled) -> tuple[bool, str, list[dict]]:
    """Is a wgmma left in flight across the softmax? Checks the TTGIR (warp_group_dot_wait with
    pendings = 1 inside an scf.for) and the PTX: some innermost loop holds wgmma.mma_async, ex2
    and wgmma.wait_group 1 (the main loop; one per consumer partition when warp-specialised).
    Returns ``(ok, detail, stats)`` with ``stats`` the `_loop_stats` of each main loop and of
    each loop that issues TMA loads (the producer's, when warp-specialised)."""
    ttgir = compiled.asm["ttgir"]
    ptx = compiled.asm["ptx"]
    first_for = ttgir.find("scf.for")
    ir_ok = first_for >= 0 and re.search(r"pendings = [1-9]\b", ttgir[first_for:]) is not None
    stats = []
    for header, body in _ptx_loops(ptx).items():
        st = _loop_stats(body)
        main = st["mma_async"] and st["wait_n"] and st["ex2"]
        if main or st["tma"]:
            stats.append({"loop": header, "kind": "main" if main else "tma", **st})
    ptx_ok = any(st["kind"] == "main" for st in stats)
    detail = f"ttgir pendings>=1 in a loop: {ir_ok}; ptx loop with wgmma + wait_group >=1 + ex2: {ptx_ok}"
    return ir_ok and ptx_ok, detail, stats


def sass_spill_accesses(cubin: bytes) -> tuple[int, int]:
    """``(in key-block loops, in all)``: local-memory (spill) instructions of the SASS, and those inside an
    innermost loop that issues wgmma (a backward branch whose body holds HGMMA and no other such loop). A
    backward branch from past the kernel's last unconditional EXIT to a target before it is no loop: the
    mbarrier waits' retry loops sit there, out of line, and jump back to the wait site (which would otherwise
    read as one loop spanning everything between the wait and the end of the kernel; with Triton 3.9's ptxas it
    made spills outside the key-block loops count as inside). A loop wholly past that EXIT still counts."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = disassemble(f.name)
    finally:
        os.unlink(f.name)
    labels, ins, pending = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            labels.update({name: int(m.group(1), 16) for name in pending})
            pending = []
            ins.append((int(m.group(1), 16), m.group(2)))
    local = [a for a, text in ins if re.search(r"\b(?:LDL|STL)\b", text)]
    last_exit = max((a for a, text in ins if re.match(r"EXIT\b", text)), default=None)
    loops = []
    for a, text in ins:
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        start = labels.get(target.group(1), a) if target else a
        back_from_stub = last_exit is not None and start <= last_exit < a
        if start < a and not back_from_stub and any("HGMMA" in x for b, x in ins if start <= b <= a):
            loops.append((start, a))
    inner = [(lo, hi) for lo, hi in loops if not any(lo <= a2 < b2 <= hi and (a2, b2) != (lo, hi) for a2, b2 in loops)]
    return sum(any(lo <= a <= hi for lo, hi in inner) for a in local), len(local)


def sass_register_regions(cubin: bytes) -> list[tuple[int, int, int]]:
    """``(register limit, registers used, instructions)`` for each stretch of SASS between two
    ``USETMAXREG`` (setmaxnreg) instructions, in program order, stretches of fewer than 40
    instructions left out: the register budget each warp-specialised partition runs under and
    the highest register its code touches (+1). A stretch also ends at an unpredicated ``EXIT``: what
    follows one is reached by branches only, from whichever partition (Triton 3.9 puts the partitions'
    out-of-line mbarrier retry loops after the last setmaxnreg), so it is attributed to no budget until
    the next setmaxnreg. Empty for a kernel without setmaxnreg."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = disassemble(f.name)
    finally:
        os.unlink(f.name)
    regions, limit, top, count = [], None, -1, 0
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.\S+\s+(?:UP\d+,\s*)?(0x[0-9a-f]+|\d+)", line)
        if m:
            if limit is not None and count >= 40:
                regions.append((limit, top + 1, count))
            limit, top, count = int(m.group(1), 0), -1, 0
            continue
        if limit is not None and re.search(r"/\*[0-9a-f]{4,}\*/", line):
            if re.search(r"\bEXIT\b", line) and not re.search(r"@!?U?P\d", line):
                if count >= 40:
                    regions.append((limit, top + 1, count))
                limit, top, count = None, -1, 0
                continue
            count += 1
            for r in re.findall(r"\bR(\d+)\b", line):
                top = max(top, int(r))
    if limit is not None and count >= 40:
        regions.append((limit, top + 1, count))
    return regions


def _root_cause(e: BaseException) -> str:
    """The innermost exception's message (Triton wraps frontend errors in CompilationErrors)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {str(e)[-1500:]}"


def check_variant(dtype_name: str, dims, mask: str, config_text: str | None,
                  dump: str | None = None) -> tuple[bool, str]:
    """Compile one variant and check it: ``(problem, report text)``. A problem is a failed
    compile, shared memory over the limit, a spill, a ptxas warning (C7514/C7515...), a missing
    overlap, a warp-specialised partition touching more registers than its setmaxnreg budget, or
    the launcher's occupancy (`launch_sm90.fwd_resources`, from its shared memory figure) other than
    the compiled kernel's shared memory allows. ``dims``: a head dim or ``(q/k, v)`` head dims."""
    dims = (dims, dims) if isinstance(dims, int) else tuple(dims)
    config = parse_config(config_text) if config_text else None
    name = f"{dtype_name} d={dims_label(dims)} mask={mask or '-':4s}"
    try:
        cfg, compiled = compile_variant(dtype_name, dims, mask, config)
    except Exception as e:  # report and go on
        return True, failure_report(f"{name} [{config_text or 'default'}]", e)
    stem = f"{dtype_name}_d{dims_label(dims).replace(':', 'v')}_{mask or 'none'}_{label_of(cfg).replace(',', '_')}"
    bad, text = compiled_report(compiled, f"{name} [{label_of(cfg)}]", stem, dump)
    expected, res = shared_bytes(cfg, dims[0], head_dim_v=dims[1]), fwd_resources(cfg, *dims)
    ctas = ws_split(cfg.num_warps, compiled.metadata.shared)["ctas_per_sm"]
    other = ctas != res["ctas_per_sm"]  # (the launcher's figure leaves out a few barriers and captures)
    return bad or other, (f"{text}\n    launcher: shared_bytes={expected} ctas_per_sm={res['ctas_per_sm']}"
                          f"{f' BUT THE KERNEL FITS {ctas}' if other else ''} maxnreg={res['maxnreg']} "
                          f"consumer_regs={res['consumer_regs']} producer_regs={res['producer_regs']}")


def failure_report(label: str, e: BaseException) -> str:
    """Report text of a variant that did not compile."""
    return f"{label}: FAILED {type(e).__name__}: {str(e)[-800:]}\n    cause: {_root_cause(e)}"


def compiled_report(compiled, label: str, stem: str, dump: str | None = None) -> tuple[bool, str]:
    """Check one compiled kernel (`check_variant`'s checks): ``(problem, report text)``; with ``dump``
    its ttgir / ptx are written to ``dump/stem.{ttgir,ptx}``."""
    shared = compiled.metadata.shared
    usage, warnings = ptxas_report(compiled.asm["ptx"])
    ok, detail, loops = overlap_proof(compiled)
    regions = sass_register_regions(compiled.asm["cubin"])
    spills = re.search(r"(\d+) bytes spill stores", usage)
    in_loops, total = sass_spill_accesses(compiled.asm["cubin"]) if spills and int(spills.group(1)) > 0 else (0, 0)
    over = [r for r in regions if r[1] > r[0]]
    # a spill access inside a main loop is a problem; a few bytes outside them (the d = 128 table config's tile
    # bookkeeping, as the runtime compiles it) are reported
    bad = shared > SHARED_LIMIT or not ok or bool(warnings) or in_loops > 0 or bool(over)
    lines = [f"{label}: shared={shared}{' OVER THE LIMIT' if shared > SHARED_LIMIT else ''} | {usage}",
             f"    overlap {'OK' if ok else 'MISSING'}: {detail}"]
    if regions:
        lines.append("    partitions (setmaxnreg budget: registers used / SASS instructions): "
                     + "; ".join(f"{lim}: {used} / {n}" for lim, used, n in regions)
                     + (" OVER BUDGET" if over else ""))
    for st in loops:
        lines.append("      " + " ".join(f"{k}={v}" for k, v in st.items()))
    if total:
        lines.append(f"    spill accesses (LDL/STL): {in_loops} of {total} inside the wgmma loops")
    lines += [f"    ptxas: {w}" for w in warnings]
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"{stem}.{ext}"), "w") as f:
                f.write(compiled.asm[ext])
    return bad, "\n".join(lines)


def _check_job(job):
    return check_variant(*job)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=parse_dims,
                        default=[tuple(d) if isinstance(d, tuple) else (d, d) for d in configs.GLUON_HEAD_DIMS],
                        help="q/k head dims d, or d:d_v with a value head dim of its own (e.g. 192:128)")
    parser.add_argument("--masks", nargs="+", default=MASKS, help="subset of " + " ".join(repr(m) for m in MASKS))
    parser.add_argument("--config", action="append", default=None,
                        help="a configuration instead of the default one (repeatable): "
                             + CONFIG_FORM)
    parser.add_argument("--selected", action="store_true",
                        help="every configuration the launcher can select (default, long, short, short-trim)")
    parser.add_argument("--jobs", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                        help="compile in this many processes")
    parser.add_argument("--dump", default=None, help="directory to write each variant's ttgir / ptx to")
    args = parser.parse_args()
    jobs = []
    for dtype_name in args.dtypes:
        for dims in args.head_dims:
            if args.selected:
                texts = [label_of(c) for c in selected_configs(dims)]
            else:
                texts = args.config or [None]
            for config_text in texts:
                for mask in args.masks:
                    jobs.append((dtype_name, dims, mask, config_text, args.dump))
    failures = 0
    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            results = pool.imap(_check_job, jobs)
            for bad, text in results:
                failures += bad
                print(text, flush=True)
    else:
        for job in jobs:
            bad, text = _check_job(job)
            failures += bad
            print(text, flush=True)
    print(f"{failures} of {len(jobs)} variant(s) with problems", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
