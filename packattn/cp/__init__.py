"""Context parallelism over ``torch.distributed``: a `CPPlan` per batch (which rows each rank
holds) and executors that compute the local rows' attention against the whole batch.

    plan = packattn.cp.plan(global_varlen, group)          # same on every rank, no communication
    q, k, v = (plan.shard(t) for t in (q_g, k_g, v_g))     # or build the local rows directly
    out = packattn.cp.attention(q, k, v, plan, causal=True)  # local rows of the global result
    out_g = plan.unshard(out)                               # every rank gets the global layout

Strategies (``plan(..., strategy=)``): "allgather" (all-gather K/V, reduce-scatter dK/dV, its collectives
overlapping compute per group of kv heads with ``overlap_groups``: `packattn.cp.allgather`); "p2p" (P2P
ring: K/V rotate rank to rank, sends overlapping compute: `packattn.cp.ring`); "a2a" (all-to-all over
heads, Ulysses: `packattn.cp.alltoall`); "a2a+p2p" on a 2-D DeviceMesh (all-to-all inside the inner
dimension, K/V exchange across the outer: `packattn.cp.hybrid`). Every mask (causal in both alignments,
windows, chunks) and every balance ("documents", "zigzag", "contiguous"). `packattn.Tree` descriptors:
`packattn.cp.tree` (root subtrees per rank, large roots cut with "allgather"). Layers: `packattn.cp.plan`
(row ownership), `packattn.cp.executor` (the executors' one signature), `packattn.cp.api` (checks,
builders, dispatch to the executors).
"""

from packattn.cp.api import attention, plan
from packattn.cp.plan import CPPlan

__all__ = ["CPPlan", "attention", "plan"]
