"""A small Triton varlen forward + backward for compute-sanitizer (memcheck / racecheck):
padding between sequences, GQA, cross lengths, empty and length-1 sequences, every mask kind; a batch with a
sequence of >= 512 queries and a short one (<= 512: the short-batch Gluon forward of `configs.config_for` -- at
d = 128 64 x 64 on an H200, the trimmed 128 x 64 elsewhere -- and the short-sequence dQ), both with GQA 4/2 (the
one-consumer dK/dV); the long one again with a gradient through lse too (the backward then runs the preprocess:
the dQ pass does not compute delta);
then a small tree (the Gluon tree forward, dK/dV and dQ on sm_90). The head dims are 128 unless given as ``D`` or
``D:D_V`` (e.g. 96, 192, 192:128 for the column-part kernels; MLA skips the tree, whose kernels refuse it).

    compute-sanitizer --tool memcheck python3 scripts/sanitizer_case.py [D[:D_V]]
"""

import sys

import torch

import packattn

DIMS = [int(x) for x in sys.argv[1].split(":")] if len(sys.argv) > 1 else [128]
D, D_V = DIMS[0], DIMS[-1]
torch.manual_seed(0)
batches = [packattn.Varlen.from_lengths([0, 1, 37, 129, 600], [3, 1, 50, 129, 580], pad_to_multiple=16, device="cuda"),
           packattn.Varlen.from_lengths([0, 1, 37, 129, 300], [3, 1, 50, 129, 290], pad_to_multiple=16, device="cuda")]
for seqs, opts in [(seqs, opts) for seqs in batches  # the second batch is short: 64 x 64 forward, short dQ
                   for opts in ({"causal": True}, {"causal": "top_left", "window": (33, 5)},
                                {"causal": True, "chunk_size": 48}, {})]:
    q = torch.randn(seqs.total_q, 4, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(seqs.total_kv, 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(seqs.total_kv, 2, D_V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, lse = packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **opts)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads) and not out.isnan().any()
# the long batch again with a gradient through lse: the preprocess computes delta, the dQ kernel reads it
for opts in ({"causal": True}, {"causal": "top_left", "window": (33, 5)}):
    seqs = batches[0]
    q = torch.randn(seqs.total_q, 4, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(seqs.total_kv, 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(seqs.total_kv, 2, D_V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, lse = packattn.attention(q, k, v, seqs, backend="triton", return_lse=True, **opts)
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    assert all(torch.isfinite(g).all() for g in grads) and not out.isnan().any()
if D != D_V:
    torch.cuda.synchronize()
    print("sanitizer case done (no tree at MLA dims)")
    sys.exit(0)
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 50, (n,), generator=g) for n in (70, 3, 200)]
tree = packattn.Tree.from_sequences([torch.cat([p, torch.randint(0, 50, (m,), generator=g)])
                                     for p in prompts for m in (0, 1, 45, 130)], device="cuda")
q = torch.randn(tree.total, 4, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(tree.total, 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(tree.total, 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
out, lse = packattn.attention(q, k, v, tree, backend="triton_tree", return_lse=True)
grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
assert all(torch.isfinite(g).all() for g in grads) and not out.isnan().any()
torch.cuda.synchronize()
print("sanitizer case done")
