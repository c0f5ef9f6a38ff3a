"""Correctness check of context parallelism (`packattn.cp`) on GPUs with NCCL: every strategy and
balance against single-process attention on the same global inputs, at sizes the CPU gloo tests
(tests/test_cp*.py) do not reach, with the Triton kernels doing the local attention.

    torchrun --nproc_per_node 2 scripts/cp_gpu_check.py [--json FILE] [--only REGEX] [--list]
    torchrun --nproc_per_node 2 scripts/cp_gpu_check.py --device cpu     # gloo, backend "reference"

One process group runs every case. A case is `cp_harness.errors_vs_single` (tests/cp_harness.py,
shared with the CPU tests): global inputs drawn on the host in float64 from a seeded generator
(the same on every rank) and moved to the device; the float64 oracle is single-process attention
with backend "reference" on the device; the CP result in the case's dtype (out, lse, dq, dk, dv)
is gathered back to the global layout. Pass (`cp_harness.verdict`, what the CPU tests assert):
every error at most 2x the error of single-process attention in the same dtype and backend (the
yardstick) plus 1e-5 plus one rounding unit of the dtype at the result's scale (`ROUNDINGS`; a
case that needs that last term is marked "*"), float64 within a fixed tolerance, padding rows
exactly zero, position ids right, and where asked two ``deterministic=True`` runs bitwise equal.
A case a strategy refuses by design (the same refusal a CPU test expects) reads REFUSED; any
other exception FAIL.

On CUDA: backend "triton" ("triton_tree" for trees) for the local problems and the bf16/fp16
yardstick, plus a few cases with backend "reference" (float64, and bf16). On CPU (``--device
cpu``, or no CUDA) every case runs with backend "reference" at smaller sizes (``--size small``).

Cases (world 2; other even worlds run the same list): strategies allgather / p2p / a2a /
a2a+p2p on 2-D meshes (1 x W: all-to-all only; W x 1: outer ring or all-gather only) x balances
zigzag / contiguous / documents; causal bottom-right and top-left, full, windows (causal and
two-sided), chunk_size; documents of 0, 1, 17, 100, 129, 1000, 3000 rows, one of 4099 rows
spanning both ranks, a batch shorter than 2 x world, padding between sequences
(``pad_to_multiple``); heads 8/2 (GQA) and 4/4 with head_dim 128 and 64, 4/1 (MQA: a2a
replicates kv heads); ``overlap_groups=2``; lse in the loss; trees with a root cut across ranks
(a large GRPO group, one node longer than a rank's share) and with whole roots; float32
through the same backend (IEEE dots: small enough errors to see a missed key).

Output (rank 0): a header, one line per case (name, PASS / FAIL / REFUSED, the worst ratio of a
CP error to the same-dtype single-process error, or for float64 the worst error against its
tolerance, seconds), then "N passed, M failed"; exit status 1 when a case failed. ``--json FILE``
writes every case's errors per rank (rewritten after each case, so a hang leaves the cases before it).
A case's seconds include compiling the Triton kernels it is the first to use (most of the run on a
cold Triton cache); ranks that disagree (one raises, the other waits in a collective) hang until
``--timeout``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

import cp_harness  # noqa: E402  (tests/cp_harness.py: errors_vs_single, verdict)

import packattn  # noqa: E402
from packattn import cp  # noqa: E402
from packattn.tree import Tree  # noqa: E402
from packattn.varlen import Varlen  # noqa: E402

TOL64 = 1e-10  # float64, strategies that compute every local problem once (all-gather, all-to-all, trees)
TOL64_RING = 1e-5  # float64 through the P2P ring: partial results merged through float32 lse (reference backend)
ATOL = 1e-5  # added to 2x the single-process error (as cp_harness.check)
# plus this many rounding units of the dtype (half its eps) at the result's scale (max |float64 result|):
# the all-gather's dK/dV of a cut document are partial sums rounded to bf16 / fp16 and summed over the
# ranks in that dtype, the ring's fp16 partial gradients likewise; a case that passes only thanks to it
# is marked "*" (on CPU with backend "reference" a few bf16 all-gather cases do: dK/dV about 2.1x-2.2x
# the single-process max error, whose float32 math rounds once)
ROUNDINGS = 1.0

# sizes: "full" on GPUs, "small" for the reference backend on CPU (same cases, fewer rows and columns)
PROFILES = {
    "full": dict(
        docs={
            "mixed": ([0, 1, 17, 100, 129, 1000, 3000, 0, 2], None),  # empty, 1 row, < 2 x world, one long
            "padded": ([5, 0, 130, 1, 999, 2050, 17], 64),  # slots padded to multiples of 64 rows
            "one_doc": ([4099], None),  # one document over every rank, not a multiple of 2 x world
            "tiny": ([1, 2], None),  # shorter than 2 x world: a rank holds nothing of a document
        },
        heads={"gqa": (8, 2, 128, 128), "mha": (4, 4, 64, 64), "mqa": (4, 1, 128, 128)},
        windows={"window": (256, 0), "window2": (128, 64)},
        chunk=512,
        # trees: (big prompt, responses, longest response, small groups, small prompt, small responses)
        tree_cut=(1500, 12, 300, 6, 60, 3),
        tree_long_node=2500,
    ),
    "small": dict(
        docs={
            "mixed": ([0, 1, 17, 30, 33, 64, 250, 0, 2], None),
            "padded": ([5, 0, 33, 1, 70, 150, 17], 16),
            "one_doc": ([203], None),
            "tiny": ([1, 2], None),
        },
        heads={"gqa": (8, 2, 16, 16), "mha": (4, 4, 8, 8), "mqa": (4, 1, 16, 16)},
        windows={"window": (16, 0), "window2": (8, 5)},
        chunk=32,
        tree_cut=(150, 12, 30, 6, 6, 3),
        tree_long_node=250,
    ),
}


@dataclasses.dataclass
class Case:
    name: str
    strategy: str
    balance: str = "documents"
    doc: str = "mixed"  # a key of the profile's docs, or "tree_cut" / "tree_long_node"
    mask: str = "causal"
    heads: str = "gqa"
    dtype: str = "bfloat16"
    backend: str = "fast"  # "fast": triton (triton_tree for trees) on CUDA, reference on CPU; or "reference"
    mesh: str | None = None  # None: the world group; "1d": a 1-D DeviceMesh; "1xW" / "Wx1": 2-D (a2a+p2p)
    outer: str | None = None  # a2a+p2p outer executor
    overlap: int | None = None  # overlap_groups
    deterministic: bool = False
    lse_in_loss: bool = False
    refusal: tuple[str, str, str] | None = None  # (exception type, text in it, the CPU test expecting it)
    seed: int = 0

    @property
    def is_tree(self) -> bool:
        return self.doc.startswith("tree")

    @property
    def tol64(self) -> float:
        ring = self.strategy == "p2p" or (self.strategy == "a2a+p2p" and self.outer == "p2p")
        return TOL64_RING if ring and not self.is_tree else TOL64


def mask_options(name: str, profile: dict) -> dict:
    if name in profile["windows"]:
        left, right = profile["windows"][name]
        return dict(causal=True, window=(left, right)) if right == 0 else dict(window=(left, right))
    return {"causal": dict(causal=True), "top_left": dict(causal="top_left"), "full": dict(),
            "chunk": dict(causal=True, chunk_size=profile["chunk"])}[name]


def cases(world: int) -> list[Case]:
    hybrid_inner, hybrid_outer = f"1x{world}", f"{world}x1"
    out = []

    def add(name, **kw):
        out.append(Case(name=name, seed=1000 + len(out), **kw))

    # every strategy x balance: bf16, GQA 8/2 d128, the mixed batch (one long document cut), causal
    for balance in ("zigzag", "contiguous", "documents"):
        det = balance == "zigzag"
        add(f"allgather-{balance}-mixed-causal", strategy="allgather", balance=balance, deterministic=det)
        add(f"p2p-{balance}-mixed-causal", strategy="p2p", balance=balance, deterministic=det)
        add(f"a2a-{balance}-mixed-causal", strategy="a2a", balance=balance, deterministic=det)
        add(f"a2a+p2p[{hybrid_outer},p2p]-{balance}-mixed-causal", strategy="a2a+p2p", balance=balance,
            mesh=hybrid_outer, outer="p2p", deterministic=det)
    add(f"a2a+p2p[{hybrid_outer},allgather]-zigzag-mixed-causal", strategy="a2a+p2p", balance="zigzag",
        mesh=hybrid_outer, outer="allgather", deterministic=True)
    add(f"a2a+p2p[{hybrid_inner}]-documents-mixed-causal", strategy="a2a+p2p", mesh=hybrid_inner,
        outer="allgather", deterministic=True)
    add("a2a-documents-mixed-causal-1d_mesh", strategy="a2a", mesh="1d")
    add("a2a-zigzag-mixed-causal-mqa", strategy="a2a", balance="zigzag", heads="mqa")  # kv heads replicated

    # masks x strategies: bf16 GQA, padding between sequences or one document over every rank
    for i, mask in enumerate(("top_left", "full", "window", "window2", "chunk")):
        doc, other = ("padded", "one_doc") if i % 2 == 0 else ("one_doc", "padded")
        add(f"allgather-zigzag-{doc}-{mask}", strategy="allgather", balance="zigzag", doc=doc, mask=mask)
        add(f"p2p-zigzag-{other}-{mask}", strategy="p2p", balance="zigzag", doc=other, mask=mask)
        add(f"p2p-contiguous-{doc}-{mask}", strategy="p2p", balance="contiguous", doc=doc, mask=mask,
            deterministic=mask == "window2")
        add(f"a2a-documents-{other}-{mask}", strategy="a2a", doc=other, mask=mask)
        add(f"a2a+p2p[{hybrid_outer},p2p]-documents-{doc}-{mask}", strategy="a2a+p2p", mesh=hybrid_outer,
            outer="p2p", doc=doc, mask=mask)
    add("allgather-documents-padded-causal", strategy="allgather", doc="padded", deterministic=True)

    # fp16, MHA 4/4 d64: causal, a batch shorter than 2 x world, a window (few masks: each is a compile)
    for strategy in ("allgather", "p2p", "a2a"):
        add(f"{strategy}-zigzag-mixed-causal-fp16", strategy=strategy, balance="zigzag", heads="mha",
            dtype="float16")
        add(f"{strategy}-zigzag-tiny-causal-fp16", strategy=strategy, balance="zigzag", doc="tiny", heads="mha",
            dtype="float16")
    add("allgather-documents-padded-window-fp16", strategy="allgather", doc="padded", mask="window", heads="mha",
        dtype="float16")
    add("a2a-documents-padded-window-fp16", strategy="a2a", doc="padded", mask="window", heads="mha",
        dtype="float16")

    # overlap_groups 2 (all-gather only; the others refuse it, as test_cp_overlap expects)
    add("allgather-zigzag-mixed-causal-G2", strategy="allgather", balance="zigzag", overlap=2, deterministic=True)
    add("allgather-documents-one_doc-window-G2", strategy="allgather", doc="one_doc", mask="window", overlap=2)
    add("allgather-zigzag-padded-chunk-G2-lse", strategy="allgather", balance="zigzag", doc="padded",
        mask="chunk", overlap=2, lse_in_loss=True)
    add("allgather-documents-mixed-causal-G2-fp16", strategy="allgather", heads="mha", dtype="float16", overlap=2)
    for strategy in ("p2p", "a2a"):
        add(f"{strategy}-zigzag-mixed-causal-G2", strategy=strategy, balance="zigzag", overlap=2,
            refusal=("ValueError", "overlap_groups applies to strategy 'allgather'",
                     "test_cp_overlap.py::test_overlap_groups_only_for_allgather"))

    # lse in the loss (the dlse term of the backward)
    add("p2p-zigzag-mixed-causal-lse", strategy="p2p", balance="zigzag", lse_in_loss=True)
    add("p2p-contiguous-padded-window2-lse", strategy="p2p", balance="contiguous", doc="padded", mask="window2",
        lse_in_loss=True)
    add("a2a-zigzag-one_doc-causal-lse", strategy="a2a", balance="zigzag", doc="one_doc", lse_in_loss=True)
    add(f"a2a+p2p[{hybrid_outer},p2p]-zigzag-padded-causal-lse", strategy="a2a+p2p", balance="zigzag",
        mesh=hybrid_outer, outer="p2p", doc="padded", lse_in_loss=True)

    # trees: a root cut across ranks (allgather), roots whole (p2p, a2a), zigzag refused
    add("tree-allgather-cut", strategy="allgather", doc="tree_cut", deterministic=True)
    add("tree-allgather-cut-lse", strategy="allgather", doc="tree_cut", lse_in_loss=True)
    add("tree-allgather-long_node", strategy="allgather", doc="tree_long_node")
    add("tree-p2p-whole_roots", strategy="p2p", doc="tree_cut")
    add("tree-a2a-whole_roots", strategy="a2a", doc="tree_cut")
    add("tree-allgather-zigzag", strategy="allgather", balance="zigzag", doc="tree_cut",
        refusal=("NotImplementedError", "balance='zigzag'",
                 "test_cp_tree.py::test_plan_refuses_what_it_cannot_do"))

    # float32 through the same backend (IEEE dots in Triton): errors small enough to see a missed key
    add("p2p-zigzag-padded-window2-fp32", strategy="p2p", balance="zigzag", doc="padded", mask="window2",
        dtype="float32")
    add("allgather-zigzag-one_doc-window-fp32", strategy="allgather", balance="zigzag", doc="one_doc",
        mask="window", dtype="float32", deterministic=True)
    add("a2a-documents-mixed-window-fp32", strategy="a2a", mask="window", dtype="float32")

    # backend "reference": float64 (the algorithms exact up to float64 / float32-lse rounding), and bf16
    add("allgather-zigzag-mixed-causal-f64", strategy="allgather", balance="zigzag", dtype="float64",
        backend="reference")
    add("allgather-zigzag-padded-chunk-G2-f64", strategy="allgather", balance="zigzag", doc="padded", mask="chunk",
        overlap=2, dtype="float64", backend="reference")
    add("p2p-zigzag-one_doc-causal-f64", strategy="p2p", balance="zigzag", doc="one_doc", dtype="float64",
        backend="reference")
    add("p2p-contiguous-padded-window2-f64", strategy="p2p", balance="contiguous", doc="padded", mask="window2",
        dtype="float64", backend="reference")
    add("a2a-documents-padded-top_left-f64", strategy="a2a", doc="padded", mask="top_left", dtype="float64",
        backend="reference")
    add(f"a2a+p2p[{hybrid_outer},p2p]-zigzag-mixed-full-f64", strategy="a2a+p2p", balance="zigzag",
        mesh=hybrid_outer, outer="p2p", mask="full", dtype="float64", backend="reference")
    add("tree-allgather-cut-f64", strategy="allgather", doc="tree_cut", dtype="float64", backend="reference")
    add("allgather-zigzag-mixed-causal-reference", strategy="allgather", balance="zigzag", backend="reference")
    add("p2p-zigzag-padded-causal-reference", strategy="p2p", balance="zigzag", doc="padded", backend="reference")
    return out


# ------------------------------------------------------------------ descriptors
def _group(first_token: int, prompt_len: int, responses: int, max_response: int, g: torch.Generator) -> list:
    """A GRPO group: one prompt (distinct first token: one root), ``responses`` continuations of
    1..``max_response`` rows."""
    prompt = torch.randint(0, 50, (prompt_len,), generator=g)
    prompt[0] = first_token
    return [torch.cat([prompt, torch.randint(0, 50, (int(torch.randint(1, max_response + 1, (1,), generator=g)),),
                                              generator=g)]) for _ in range(responses)]


def make_tree(name: str, profile: dict) -> Tree:
    g = torch.Generator().manual_seed(7)
    if name == "tree_cut":  # one group larger than half a rank's share (cut by allgather), small groups
        prompt, responses, longest, small, small_prompt, small_responses = profile["tree_cut"]
        seqs = _group(1000, prompt, responses, longest, g)
        for i in range(small):
            seqs += _group(1001 + i, int(torch.randint(small_prompt // 3, small_prompt + 1, (1,), generator=g)),
                           small_responses, max(2, small_prompt // 2), g)
        return Tree.from_sequences(seqs)
    if name == "tree_long_node":  # a root that is one node longer than a rank's share, then small roots
        n = profile["tree_long_node"]
        seqs = [[900] * n]
        for i in range(3):
            seqs += _group(901 + i, n // 60, 2, n // 100, g)
        return Tree.from_sequences(seqs)
    raise ValueError(name)


def make_descriptor(case: Case, profile: dict):
    if case.is_tree:
        return make_tree(case.doc, profile)
    lengths, pad = profile["docs"][case.doc]
    return Varlen.from_lengths(lengths, pad_to_multiple=pad)


# ------------------------------------------------------------------ running
@dataclasses.dataclass
class Context:
    device: torch.device
    world: int
    rank: int
    profile: dict
    fast_backend: str
    tree_backend: str
    meshes: dict


def run_case(case: Case, ctx: Context) -> dict:
    seqs = make_descriptor(case, ctx.profile)
    mask = {} if case.is_tree else mask_options(case.mask, ctx.profile)
    if case.backend == "reference":
        backend = "reference"
    else:
        backend = ctx.tree_backend if case.is_tree else ctx.fast_backend

    def make_plan(seqs):
        group = ctx.meshes[case.mesh] if case.mesh else None
        extra = {"outer": case.outer} if case.strategy == "a2a+p2p" else {}
        return cp.plan(seqs, group, strategy=case.strategy, balance=case.balance, **extra)

    try:
        res = cp_harness.errors_vs_single(
            seqs, mask, ctx.profile["heads"][case.heads], getattr(torch, case.dtype), case.seed, make_plan,
            backend=backend, check_deterministic=case.deterministic, lse_in_loss=case.lse_in_loss,
            cp_options=None if case.overlap is None else {"overlap_groups": case.overlap},
            device=ctx.device, single_backend=backend)
    except Exception as exc:  # as cp_harness.run_case, plus where it came from
        return {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=-6)}
    if case.is_tree:  # the first root is the large one: cut across ranks by "allgather" only (host plan)
        owner = cp.plan(seqs, world=ctx.world, rank=0, strategy=case.strategy, balance=case.balance).owner
        first_root_rows = int(seqs.cu_node_lens[int((seqs.node_parent[1:] < 0).nonzero()[0]) + 1])
        res["root_cut"] = len(set(owner[:first_root_rows].tolist())) > 1
    return res


def judge(case: Case, per_rank: list[dict]) -> dict:
    """Status, the worst ratio and what failed, from every rank's `errors_vs_single` result."""
    if case.refusal is not None:
        kind, text, cpu_test = case.refusal
        excs = [res.get("exception") or "" for res in per_rank]
        if all(e.startswith(kind + ":") and text in e for e in excs):
            return {"status": "REFUSED", "detail": f"{excs[0]} (expected, as {cpu_test})"}
        return {"status": "FAIL", "detail": f"expected {kind} containing {text!r} on every rank, got "
                                            f"{[e or 'no exception' for e in excs]}"}
    failures, strict, worst = [], True, (-1.0, None)
    for rank, res in enumerate(per_rank):
        failures += [f"rank {rank}: {f}" for f in cp_harness.verdict(res, case.dtype, case.tol64, ATOL, ROUNDINGS)]
        if "root_cut" in res and res["root_cut"] != (case.strategy == "allgather"):
            failures.append(f"rank {rank}: the large root is {'' if res['root_cut'] else 'not '}cut across ranks")
        strict = strict and not cp_harness.verdict(res, case.dtype, case.tol64, ATOL)
        if "exception" in res:
            continue
        for key, err in res["cp"].items():
            if case.dtype == "float64":
                ratio = err / case.tol64
            else:
                single = res["single"][key]
                ratio = err / single if single > 0 else (0.0 if err == 0 else math.inf)
            ratio = math.inf if math.isnan(ratio) else ratio
            if ratio > worst[0]:
                worst = (ratio, key)
    if worst[1] is None:
        summary = "-"
    elif case.dtype == "float64":
        err = max(res["cp"][worst[1]] for res in per_rank if "cp" in res)
        summary = f"err {err:.1e} ({worst[1]}) tol {case.tol64:.0e}"
    else:
        summary = f"cp/single {worst[0]:.2f} ({worst[1]}){'' if strict or failures else ' *'}"
    return {"status": "FAIL" if failures else "PASS", "worst_ratio": worst[0], "worst_key": worst[1],
            "strict_pass": strict, "summary": summary, "detail": "; ".join(failures)}


def init(device_arg: str, timeout_s: float) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=timeout_s)
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def make_meshes(device: torch.device, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("cp_outer", "cp_inner")
    return {"1d": init_device_mesh(device.type, (world,)),
            f"1x{world}": init_device_mesh(device.type, (1, world), mesh_dim_names=names),
            f"{world}x1": init_device_mesh(device.type, (world, 1), mesh_dim_names=names)}


def header(ctx: Context, n: int) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if ctx.device.type == "cuda":
        gpu = torch.cuda.get_device_name(ctx.device)
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # only for the header
            nccl = "?"
        where = f"{gpu} x{ctx.world} (nccl {nccl}, CUDA {torch.version.cuda})"
    else:
        gpu, where = None, f"CPU x{ctx.world} (gloo)"
    return {"gpu": gpu, "device": ctx.device.type, "world": ctx.world, "torch": torch.__version__,
            "triton": triton_version, "packattn": getattr(packattn, "__version__", None),
            "backend": ctx.fast_backend, "tree_backend": ctx.tree_backend, "cases": n, "where": where,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the per-case results here (rank 0)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA with NCCL when available, else CPU with gloo")
    parser.add_argument("--size", choices=("auto", "full", "small"), default="auto",
                        help="auto: full on CUDA, small on CPU")
    parser.add_argument("--backend", help="backend of the local varlen problems (default: triton on CUDA, "
                                          "reference on CPU); trees use triton_tree / reference")
    parser.add_argument("--only", help="run the cases whose name matches this regular expression (re.search)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit (no process group)")
    parser.add_argument("--timeout", type=float, default=300.0, help="process group timeout, seconds")
    args = parser.parse_args(argv)

    world_env = int(os.environ.get("WORLD_SIZE", "2"))
    selected = [c for c in cases(world_env) if args.only is None or re.search(args.only, c.name)]
    if args.list:
        for c in selected:
            print(c.name)
        return 0

    t_start = time.perf_counter()
    device = init(args.device, args.timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    size = args.size if args.size != "auto" else ("full" if device.type == "cuda" else "small")
    cuda = device.type == "cuda"
    ctx = Context(device, world, rank, PROFILES[size], args.backend or ("triton" if cuda else "reference"),
                  "triton_tree" if cuda else "reference", make_meshes(device, world))
    info = header(ctx, len(selected))
    info["size"] = size
    if rank == 0:
        print(f"cp_gpu_check: {info['where']}, torch {info['torch']}, triton {info['triton']}, backend "
              f"{info['backend']} / {info['tree_backend']} (trees), sizes {size}, {len(selected)} cases", flush=True)
    results = []
    counts = {"PASS": 0, "FAIL": 0, "REFUSED": 0}
    width = max((len(c.name) for c in selected), default=10) + 1
    for case in selected:
        t0 = time.perf_counter()
        res = run_case(case, ctx)
        if cuda:
            torch.cuda.synchronize()
        per_rank = [None] * world
        dist.all_gather_object(per_rank, res)
        seconds = time.perf_counter() - t0
        if rank != 0:
            continue
        verdict = judge(case, per_rank)
        counts[verdict["status"]] += 1
        line = f"{case.name:<{width}} {verdict['status']:<7} {verdict.get('summary', ''):<34} {seconds:6.1f} s"
        if verdict["detail"]:
            line += f"  {verdict['detail']}"
        print(line, flush=True)
        if verdict["status"] == "FAIL":
            shown = set()
            for r, res_r in enumerate(per_rank):
                if "traceback" in res_r and res_r["traceback"] not in shown:
                    shown.add(res_r["traceback"])
                    print(f"  rank {r}: {res_r['traceback'].rstrip()}".replace("\n", "\n    "), flush=True)
        results.append({"name": case.name, **verdict, "seconds": round(seconds, 3),
                        "case": dataclasses.asdict(case), "per_rank": per_rank})
        if args.json:
            _write_json(args.json, info, results, counts, time.perf_counter() - t_start)
    total_s = time.perf_counter() - t_start
    failed = 0
    if rank == 0:
        failed = counts["FAIL"]
        refused = f", {counts['REFUSED']} refused (by design)" if counts["REFUSED"] else ""
        print(f"{counts['PASS']} passed, {failed} failed{refused} in {total_s:.0f} s", flush=True)
        if args.json:
            _write_json(args.json, info, results, counts, total_s)
    status = torch.tensor([failed], device=device)
    dist.broadcast(status, 0)
    dist.destroy_process_group()
    return 1 if int(status) else 0


def _write_json(path: str, info: dict, results: list, counts: dict, seconds: float) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"header": info, "passed": counts["PASS"], "failed": counts["FAIL"], "refused": counts["REFUSED"],
                   "seconds": round(seconds, 1), "cases": results}, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
