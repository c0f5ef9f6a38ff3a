"""One W1 (bf16, causal, heads 16/16, d=128) forward + backward through the Triton backend, for
Nsight Compute: the kernels run once each after a warm-up outside the profiled range.

    ncu --clock-control none --profile-from-start off -k regex:"varlen_fwd|bwd_dkdv|bwd_dq" \
        --section SpeedOfLight --section WarpStateStats python3 scripts/profile_case.py
"""

import torch

import packattn
from packattn.bench.workloads import varlen_workloads

w = varlen_workloads()["W1"]
seqs, q, k, v = w.make_inputs("cuda", torch.bfloat16)
dout = torch.randn_like(q)


def step():
    out = packattn.attention(q, k, v, seqs, backend="triton", **w.options)
    torch.autograd.grad(out, (q, k, v), dout)


step()  # compile and build the tile tables
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
