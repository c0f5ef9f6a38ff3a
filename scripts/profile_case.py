"""One forward + backward of a bench workload (default W1; any of `varlen_workloads` / `head_dim_workloads`, e.g.
D96 or MLA) through the Triton backend, for Nsight Compute: the kernels run once each after a warm-up outside the
profiled range.

    ncu --clock-control none --profile-from-start off -k regex:"fwd|bwd" \
        --section SpeedOfLight --section WarpStateStats python3 scripts/profile_case.py D96
"""

import sys

import torch

import packattn
from packattn.bench.workloads import head_dim_workloads, varlen_workloads

w = {**varlen_workloads(), **head_dim_workloads()}[sys.argv[1] if len(sys.argv) > 1 else "W1"]
seqs, q, k, v = w.make_inputs("cuda", requires_grad=True)
dout = torch.randn(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)


def step():
    out = packattn.attention(q, k, v, seqs, backend="triton", **w.options)
    torch.autograd.grad(out, (q, k, v), dout)


step()  # compile and build the tile tables
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
