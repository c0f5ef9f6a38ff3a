"""torch.compile on the GPU paths users run: one graph for every packing, results equal to eager, step times.

    python scripts/compile_gpu_check.py [--packings 20] [--timed 50] [--tokens 16384] [--json FILE]

1. `PackedAttention` (heads 32/8, d = 128, bf16, causal, ``backend="auto"``) compiled with
   ``fullgraph=True`` (inductor) on a cold dispatch cache, over ``--packings`` packings of ``--tokens``
   rows (Varlen with 1-30 documents, every third a Tree), forward and backward: graphs compiled, and the
   largest difference to eager of out, dq, dk, dv.
2. The same with a 4-layer `nn.Decoder` (dim 2048, heads 16/4): logits and every parameter gradient.
3. Training steps (forward, cross entropy, backward, AdamW) of that decoder over ``--timed`` Varlen
   packings, compiled and eager, interleaved: median step time of each after its first 3 steps.
Prints a short table last; the exit status is 1 when a check fails (more than 2 graphs, or a difference
above bf16 noise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch._dynamo
import torch.nn.functional as F

import packattn
from packattn import dispatch
from packattn.bench.packings import packings, position_ids
from packattn.nn import Decoder, DecoderConfig, PackedAttention

BF16_TOL = 0.05  # largest |compiled - eager| / max |eager| accepted: bf16, and inductor fuses the rest of the model differently


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def backend_names(descriptor, q, k, v) -> str:
    """Which backend eager auto dispatch runs for this call (a traced call may take another: FA4 is not traceable)."""
    return dispatch.select(dispatch.call_params(
        descriptor, device_type="cuda", dtype=q.dtype, heads_q=q.shape[1], heads_kv=k.shape[1],
        head_dim=q.shape[2], mask=packattn.Mask.make(True), requires_grad=True)).name


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def check_attention(tokens: int, count: int) -> dict:
    dispatch.clear_cache()
    before = graphs()
    attn = PackedAttention.Config(causal=True).build()
    compiled = torch.compile(attn, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    worst, used = 0.0, set()
    for descriptor in packings(tokens, count, device="cuda"):
        q, k, v = (torch.randn(tokens, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for h in (32, 8, 8))
        dout = torch.randn(tokens, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        results = []
        for fn in (compiled, attn):
            out = fn(q, k, v, attention_masks=descriptor, enable_gqa=True)
            results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
        worst = max(worst, *(rel_err(a, b) for a, b in zip(*results)))
        used.add(backend_names(descriptor, q, k, v))
    return {"check": "PackedAttention", "packings": count, "graphs": graphs() - before, "max_rel_err": worst,
            "backends": sorted(used)}


def make_decoder() -> Decoder:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=32000, dim=2048, num_layers=4, heads_q=16, heads_kv=4)
    return Decoder(config).cuda().to(torch.bfloat16)


def check_decoder(tokens: int, count: int) -> dict:
    dispatch.clear_cache()
    before = graphs()
    model = make_decoder()
    compiled = torch.compile(model, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    worst = 0.0
    for descriptor in packings(tokens, count, seed=1, device="cuda"):
        ids = torch.randint(0, 32000, (tokens,), device="cuda", generator=g)
        results = []
        for fn in (compiled, model):
            model.zero_grad(set_to_none=True)
            logits = fn(ids, position_ids(descriptor), descriptor)
            F.cross_entropy(logits.float(), ids.roll(-1)).backward()
            results.append([logits.detach()] + [p.grad.clone() for p in model.parameters()])
        worst = max(worst, *(rel_err(a, b) for a, b in zip(*results)))
    return {"check": "Decoder", "packings": count, "graphs": graphs() - before, "max_rel_err": worst}


def time_steps(tokens: int, count: int) -> dict:
    """Training steps over ``count`` Varlen packings, compiled and eager interleaved (one model each)."""
    dispatch.clear_cache()
    before = graphs()
    models = {"eager": make_decoder(), "compiled": make_decoder()}
    steps = {"eager": models["eager"], "compiled": torch.compile(models["compiled"], fullgraph=True)}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    times = {name: [] for name in models}
    descriptors = [d for d in packings(tokens, count + count // 2, seed=2, device="cuda")
                   if isinstance(d, packattn.Varlen)][:count]
    g = torch.Generator(device="cuda").manual_seed(2)
    for descriptor in descriptors:
        ids = torch.randint(0, 32000, (tokens,), device="cuda", generator=g)
        pos = position_ids(descriptor)
        for name in ("compiled", "eager"):
            torch.cuda.synchronize()
            start = time.perf_counter()
            logits = steps[name](ids, pos, descriptor)
            F.cross_entropy(logits.float(), ids.roll(-1)).backward()
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t[3:]) * 1e3 for name, t in times.items()}
    return {"check": "train steps", "packings": len(descriptors), "graphs": graphs() - before,
            "eager_ms": median["eager"], "compiled_ms": median["compiled"],
            "first_compiled_ms": times["compiled"][0] * 1e3, "speedup": median["eager"] / median["compiled"]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--packings", type=int, default=20)
    parser.add_argument("--timed", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--json")
    args = parser.parse_args()
    try:
        import flash_attn.cute  # noqa: F401
        fa4 = "installed"
    except Exception as err:  # noqa: BLE001
        fa4 = f"not installed ({type(err).__name__})"
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "fa4": fa4}
    print(env, flush=True)
    rows = [check_attention(args.tokens, args.packings), check_decoder(args.tokens, args.packings),
            time_steps(args.tokens, args.timed)]
    ok = all(r["graphs"] <= 2 for r in rows) and all(r.get("max_rel_err", 0) <= BF16_TOL for r in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows, "ok": ok}, f, indent=1)
    print(f"\n{'check':<16} {'packings':>8} {'graphs':>6}  result")
    for r in rows:
        if "max_rel_err" in r:
            result = f"max rel err {r['max_rel_err']:.2e}" + (f", eager auto: {r['backends']}" if "backends" in r else "")
        else:
            result = (f"eager {r['eager_ms']:.1f} ms, compiled {r['compiled_ms']:.1f} ms per step "
                      f"({r['speedup']:.2f}x; first compiled step {r['first_compiled_ms'] / 1e3:.1f} s)")
        print(f"{r['check']:<16} {r['packings']:>8} {r['graphs']:>6}  {result}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
