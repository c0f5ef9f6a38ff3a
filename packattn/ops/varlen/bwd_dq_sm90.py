"""Warp-specialised dQ backward for Hopper (sm_90a), written in Gluon (FlashAttention-3 style).

Same contract as `packattn.ops.varlen.bwd_sm90.varlen_bwd_dq_gluon_kernel` (read its module
docstring): one program per (query tile of ``BLOCK_M = 128`` queries -- or 64, ONE CONSUMER below --,
query head), tile-table rows ``[seq, q_start, n_lo, n_mid_lo, n_mid_hi, n_hi]`` built by
``tile_table(seqs, mask, False, BLOCK_M, BLOCK_N)``, key blocks ``n_lo + j * BLOCK_N`` of ``[n_lo,
n_hi)`` in order; kv head ``head // group_size``; the element mask only outside the fully visible
band ``[n_mid_lo, n_mid_hi)``; K / V rows past ``len_kv`` zeroed in shared memory before a wgmma
reads them; dQ (times ``scale``) stored for rows inside the sequence only; no atomics
(deterministic); queries that see no key get dQ = 0.
Selected by ``GluonBwdConfig.warp_specialize`` (``$PACKATTN_GLUON_DQ_CONFIG=128,64,4,8,ws``) in
`packattn.ops.varlen.launch_sm90_bwd`. The partitions, barriers and register split are those of
`packattn.ops.varlen.bwd_dkdv_sm90` (dK/dV) with the roles of queries and keys swapped.

Partitions (launched with ``num_warps = 4``: the default partition is consumer 0, plus a 4-warp
worker for consumer 1 and a 1-warp producer; 9 warps, the register file sized for 12: consumers
240 registers each, producer 24, `triton_bwd_gluon.dq_ws_resources`)::

    producer (1 warp)                        consumer c in {0, 1} (4 warps each)
    TMA Q, dO (128 rows) -> q_bar            queries [64 c, 64 c + 64) of the tile: own Q / dO
    for j in 0 .. num_blocks-1:              rows, own dQ accumulator, own lse / delta (2 + 2
      wait empty[j % S] (parity ^ 1)         registers per thread: rows of the accumulator layout)
      expect + TMA K[j], V[j] -> ready[j % S]   wait q_bar; for j: step(j) (below); store dQ * scale
                                             (staged in its own Q rows)

How producer and consumers agree on ring slots and parities: `varlen_bwd_gluon_dq_ws_producer` (module docstring).

Step ``j`` of one consumer, ``CARRY_DS`` (``STAGES >= 3``: the schedule of the non-specialised
kernel; dS[j] crosses the loop's back edge as a register A operand, no wgmma does)::

    wait   ready[j % S]; tail block only: zero rendezvous (below)
    issue  S[j]  = Q K[j]^T                        (async)
    issue  dP[j] = dO V[j]^T                       (async)
    issue  dQ   += dS[j-1] K[j-1]                  (async; three groups in flight)
    wait   until 2 pending                         (S[j] done)
    P[j] = exp2(S c - lse log2e), masked off the band   (dP[j], dQ[j-1] run)
    wait   until 1 pending                         (dP[j] done; dQ[j-1] runs)
    dS[j] = P (dP - delta) -> A operand            (dQ[j-1] runs)
    wait   until 0 pending; arrive empty[(j-1) % S]   (K[j-1] was last read by dQ[j-1])

after the loop: dQ += dS[last] K[last], wait, arrive empty[last % S]. Slot ``j % S`` is held
through step ``j + 1``, so the producer refills it with block ``j - 1 + S``: ``STAGES = 4`` keeps two
blocks of prefetch. Without ``CARRY_DS`` (``STAGES = 2``, e.g. ``BLOCK_N = 128`` at d = 128, where a
third 64 KB slot does not fit): issue S[j], dP[j]; wait until 1 pending; P[j] (dP[j] runs); wait
until 0 pending; dS[j]; dQ += dS[j] K[j]; wait; arrive empty[j % S] -- the dQ product is exposed
inside a consumer, the other consumer's elementwise work fills it (no CTA barrier in the loop:
only the ``empty`` slots and the tail rendezvous tie the two warp groups, so they drift out of
phase).

Registers (d = 128, per consumer thread): dQ 64; at ``BLOCK_N = 64`` S and dP 32 each, the P / dS
operands 16 each: far below 240. lse / delta / query positions are per row (2 registers each in
the accumulator layout), loaded once before the loop.

Tail block (``n_start + BLOCK_N > len_kv``; at most one per tile, the same step for both consumers):
consumer 0 zeroes the slot's K rows past ``len_kv``, consumer 1 its V rows
(`varlen_fwd_gluon._zero_v_tail`: generic stores, ``fence.proxy.async``, a barrier over the
partition), then both arrive on ``zero_bar`` (count 2) and wait for it (parity ``ntail & 1``,
``ntail`` the tail steps so far), so neither issues a wgmma on the slot before both halves are zero;
the slot cannot be refilled before both consumers release it. Query rows past ``len_q`` (in Q / dO
as TMA read them) only produce dQ rows that are never stored.

A tile with ``num_blocks == 0`` loads nothing and stores zeros (``seq < 0``: stores nothing).

ONE CONSUMER (``BLOCK_M = 64``, config ``num_warps = 4``, e.g. ``$PACKATTN_GLUON_DQ_CONFIG=64,64,2,4,ws``;
``CONSUMERS = BLOCK_M // 64``, a constexpr of the same kernel), as the one-consumer dK/dV
(`varlen_bwd_gluon_ws`, ONE CONSUMER): consumer 0 alone, in the default partition, with the 1-warp
producer as the only worker (padded to a warp group at launch: 8 warps, ``.reqntid 256``). Sized for
TWO CTAs per SM, so that one CTA's prologue (Q / dO TMA, first ring slots, lse / delta loads) and
epilogue (dQ stores) hide behind the other's steps -- short documents, whose tiles have few key
blocks: shared memory <= ~113 KB (Q / dO 32 KB at d = 128 and each (K, V) slot of 64 keys 32 KB: 96 KB
at 2 stages; d = 64 half of it), registers from `triton_fwd_gluon.ws_split` (2 CTAs x 8 warps: maxnreg
128, the consumer 232, the producer 24). Differences to two consumers, all decided by the constexpr:

* ``empty[slot]`` has count 1: the consumer's one arrival per ring step (after the wgmma that last read
  the slot: ``dQ[j-1]`` with ``CARRY_DS``, ``dQ[j]`` without) releases the slot; ring slots, parities
  and the producer are otherwise unchanged (``q_desc`` / ``do_desc`` blocks of ``BLOCK_M = 64`` rows,
  so ``q_bar``'s expected bytes are those of the 64-row tiles).
* Tail block: the consumer zeroes both the K and the V rows past ``len_kv`` (two `_zero_v_tail`, each
  ending with ``fence.proxy.async`` and a barrier over this warp group, the slot's only reader) before it
  issues the S / dP wgmma; no ``zero_bar`` rendezvous (the barrier is not allocated; ``ntail`` stays 0).
* One query block of 64 rows: ``q_wg`` / ``do_wg`` are the whole Q / dO buffers; the epilogue stages dQ
  through them as before.
* Not with ``PERSISTENT`` (static_assert; `triton_bwd_gluon.check_dq_ws_config` refuses such a config).

The two-consumer code is unchanged by this (PTX identical for the existing configs, persistent and tree
included, ``.loc`` / debug sections aside). sm_90a compile (scripts/check_gluon_bwd_compile.py --kernels
dq --config 64,64,2,4,ws, ...): every mask, bf16 / fp16, no spills, no ptxas warnings, the overlap check
passes; consumer registers used (of 232) and shared memory per CTA: d = 128, (64, 64, 2 stages) 175-183,
98540 B; d = 64, (64, 64, 2 / 3 / 4 stages) 137-147 / 142-152 / 142-152, 49388 / 65804 / 82188 B, (64,
128, 2 stages) 203-217, 82156 B. At d = 128, (64, 64, 3 / 4 stages) and (64, 128, 2 stages) take 128-160
KB: one CTA per SM, for which `ws_split` gives maxnreg 256 and ptxas warns ("Too many maxnreg", ignored);
no spills there either (196-204 / 192-197 / 240-249 of 256), but they defeat the purpose and are not
listed in `triton_bwd_gluon.DQ_WS_ALTERNATIVES`. On GPUs since the ninth session: the short-batch dQ at d = 128
(`triton_bwd_gluon.DQ_SHORT_CONFIGS`).

DELTA FROM O (constexpr ``DELTA_FROM_O``, never with ``PERSISTENT``): the kernel computes delta = rowsum(dO O)
itself (from an O tile the producer loads with Q / dO) and writes it, instead of reading the preprocess's; see
`varlen_bwd_gluon_dq_delta`.

``PERSISTENT`` (``$PACKATTN_GLUON_DQ_CONFIG=128,64,4,8,ws,persistent``; a grid of ``ctas_per_sm x
SMs`` programs, `triton_fwd_gluon.ws_grid`, smaller than ``num_work = tiles x query heads``), as the
persistent warp-specialised dK/dV (`varlen_bwd_gluon_ws`) runs it: every partition walks the work
items ``pid, pid + nprog, ...`` (`_work_item` with ``num_work`` as the item count, so the head
sections and the item each program gets are the one-program-per-item ones) and skips the items with
``num_blocks == 0`` identically: no load, no barrier operation, the consumers just store zeros
(``seq >= 0``). Per item the consumers run exactly the non-persistent tile: the same lse / delta,
the same key blocks in the same order, the same wgmma and elementwise steps (`_dq_ws_blocks`), and
store the same float32 ``dq * scale`` cast to the output dtype to the same rows, only straight from
the accumulator registers (`varlen_bwd_gluon_ws._store_rows_direct`) instead of staged through Q's
buffer: dQ is bitwise the non-persistent kernel's. Barrier phases across items:

* ``ready`` / ``empty`` (the K / V ring): ring steps are counted over all the items of the program
  (``step``: the blocks of the program's earlier items), so item ``i``'s block ``b`` is ring step
  ``j = step + b`` in all three partitions, slot ``j % STAGES``, ``ready`` parity ``(j // STAGES) & 1``,
  ``empty`` parity (producer) that ``^ 1``: the ring runs on across items as if they were one tile,
  and the producer fills the next item's first ``min(num_blocks, STAGES)`` slots while the consumers
  finish this item (those waits need only this item's releases).
* ``q_bar`` / ``q_empty`` (Q and dO, one buffer): the consumers wait ``q_bar`` with the parity of the
  Q / dO tiles they consumed so far, and after the item's last wgmma each arrives on ``q_empty``
  (count 2); the producer waits ``q_empty`` with the parity of its Q / dO loads so far ``^ 1`` (the
  first wait passes on the fresh barrier) before the next item's Q / dO TMA, which it issues after
  that item's first ``STAGES`` K / V blocks. Neither barrier runs two phases ahead of its waiter:
  the producer loads Q / dO ``k + 1`` only after both consumers released ``k``, which each did after
  waiting for it. The output no longer stages through Q's rows, so the next item's Q / dO land
  during this item's epilogue.
* ``zero_bar`` (tail rendezvous): both consumers see the same tail steps (at most one per item, the
  same items and blocks), and each waits with the parity of the tail steps it took so far, now
  counted over the items (bit 31 of its state word) instead of restarting at 0 per tile; neither can
  arrive twice before the other arrived once (each waits for the phase it arrived on).

Registers: a persistent partition keeps its item, its Q / dO parity and (consumers) its tail parity
in one state word (`varlen_bwd_gluon_ws_load.ITEM_MASK`: bits 0..29 the item, bit 30 the Q / dO
parity, bit 31 the tail parity; hence ``num_work + grid < 2**30``) and reads the grid size,
``num_work`` and (consumers) the window arguments through opaque inline asm
(`varlen_fwd_gluon_ws._opaque`; the lse stride and the dQ strides as ``stride + 16 * z``, ``z`` an
opaque 0), so that LLVM does not hoist item-prologue / epilogue values out of the persistent loop to
the kernel entry (shared by all partitions: ptxas spills what lives from there into a consumer) or
into registers held across the steps; the epilogue decodes the item again from an opaque copy of the
state. sm_90a compile (scripts/check_gluon_bwd_compile.py --kernels dq --config
128,64,4,8,ws,persistent, also 128,64,3,...): no spills for any mask, bf16 / fp16, d 64 / 128 (at d =
128 consumers ~190 of 240 registers); 128,128,2,8,ws,persistent spills 4 B at d = 128 with the
left + chunk + right mask (the non-persistent kernel is at 238 of 240 there already).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from packattn.ops.varlen.bwd_sm90 import _lse_log2, _probs, _row_vector, _store_tile
from packattn.ops.varlen.bwd_dq_sm90_delta import _delta_from_o
from packattn.ops.varlen.bwd_dq_sm90_load import _dq_tile, _dq_ws_producer
from packattn.ops.varlen.common_sm90 import _to_operand, _zero_v_tail, mma_layout
from packattn.ops.varlen.fwd_sm90 import (_ring_barriers)

WG_ROWS = gl.constexpr(64)  # queries per consumer warp group (one wgmma M = 64 per warp group)


# ---------------------------------------------------------------- consumers
@gluon.jit
def _probs_tree(s, lse_log2, offs_m, n_start, n_mid_lo, n_mid_hi, ends, qk_scale_log2, BLOCK_N: gl.constexpr,
                s_layout: gl.constexpr):
    """`varlen_bwd_gluon._probs` with the tree mask (`packattn.ops.tree.kernels_triton`): query ``t`` sees key ``s``
    iff ``s <= t < key_end[s]``; ``ends``: shared memory holding ``key_end`` of the block's keys (0 past
    the tree: no query sees them), read only in masked blocks."""
    p = gl.exp2(s * qk_scale_log2 - lse_log2[:, None])
    if (n_start < n_mid_lo) | (n_start >= n_mid_hi):
        keys = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        key_end = ends.load(gl.SliceLayout(0, s_layout))
        ok = (keys[None, :] <= offs_m[:, None]) & (offs_m[:, None] < key_end[None, :])
        p = gl.where(ok, p, 0.0)
    return p


@gluon.jit
def _dq_ws_step(j, n_start, ds_prev, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, key_ends, ready, empty, zero_bar,
                lse_log2, delta, offs_m, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2, window_left, window_right,
                chunk_size, s_layout: gl.constexpr, o_layout: gl.constexpr, WG: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, TREE: gl.constexpr, CARRY_DS: gl.constexpr,
                WITH_PREV: gl.constexpr, CONSUMERS: gl.constexpr = 2,
                o_wg=None, delta_ptr=None, delta_rows=None, DELTA_FROM_O: gl.constexpr = False):
    """Ring step ``j``, the key block at ``n_start``, of one consumer warp group (module docstring).
    ``CARRY_DS``: issue the previous block's ``dQ += dS K`` (operand ``ds_prev``, when ``WITH_PREV``)
    under this block's work and return this block's dS as an A operand; otherwise finish this block's
    dQ product here. ``TREE``: the tree mask (`_probs_tree`, ``key_ends``: the ring of the blocks'
    ``key_end``), else the varlen masks (``key_ends`` unused). ``CONSUMERS
    == 1`` (module docstring, ONE CONSUMER): the only consumer zeroes both tails (K and V rows), no
    ``zero_bar`` rendezvous (``ntail`` unchanged). Returns ``(dq, ds, ntail)`` with no wgmma in flight.
    ``DELTA_FROM_O`` (the tile's first step; ``delta`` is None): delta = rowsum(dO O) from
    ``do_wg`` / ``o_wg`` while the S and dP wgmma run, stored to ``delta_ptr[i]`` for ``i < delta_rows``
    (`_delta_from_o`); returns ``(dq, ds, ntail, delta)``."""
    gl.static_assert((not DELTA_FROM_O) | ((not WITH_PREV) & (not TREE)), "delta from O: the tile's first step")
    slot = j % STAGES
    mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
    k_buf = k_bufs.index(slot)
    v_buf = v_bufs.index(slot)
    if n_start + BLOCK_N > len_kv:  # keys past the sequence: zeros, not NaN, enter dQ
        if CONSUMERS == 1:  # fence + barrier over this warp group inside: its own wgmma see the zeros
            _zero_v_tail(k_buf, n_start, len_kv, BLOCK_N, HEAD_DIM, 4)
            _zero_v_tail(v_buf, n_start, len_kv, BLOCK_N, HEAD_DIM, 4)
        else:
            if WG == 0:
                _zero_v_tail(k_buf, n_start, len_kv, BLOCK_N, HEAD_DIM, 4)
            else:
                _zero_v_tail(v_buf, n_start, len_kv, BLOCK_N, HEAD_DIM, 4)
            mbarrier.arrive(zero_bar, count=1)
            mbarrier.wait(zero_bar, ntail & 1)  # the other consumer's half is zero too
            ntail += 1

    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_wg, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do_wg, v_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if DELTA_FROM_O:  # under the S / dP wgmma (both only read do_wg; nobody writes it or o_wg)
        delta = _delta_from_o(do_wg, o_wg, delta_ptr, delta_rows, s_layout, HEAD_DIM)
    if CARRY_DS and WITH_PREV:
        prev = (j + STAGES - 1) % STAGES
        dq_tok = warpgroup_mma(ds_prev, k_bufs.index(prev), dq, is_async=True)
        s = warpgroup_mma_wait(2, deps=(s_tok, ))
    else:
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
    if TREE:
        p = _probs_tree(s, lse_log2, offs_m, n_start, n_mid_lo, n_mid_hi, key_ends.index(slot), qk_scale_log2,
                        BLOCK_N, s_layout)
    else:
        p = _probs(s, lse_log2, offs_m, n_start, n_mid_lo, n_mid_hi, len_q, len_kv, qk_scale_log2, window_left,
                   window_right, chunk_size, BLOCK_N, s_layout, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT)
    if CARRY_DS and WITH_PREV:
        dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    else:
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    ds = _to_operand(p * (dp - delta[:, None]), q_wg.dtype, o_layout)
    if CARRY_DS:
        if WITH_PREV:
            dq, ds_prev = warpgroup_mma_wait(0, deps=(dq_tok, ds_prev))
            mbarrier.arrive(empty.index(prev), count=1)  # K[j-1] (dQ[j-1]) and V[j-1] (dP[j-1]) are done
    else:
        dq, ds = warpgroup_mma_wait(0, deps=(warpgroup_mma(ds, k_buf, dq, is_async=True), ds))
        mbarrier.arrive(empty.index(slot), count=1)  # this consumer is done with the slot
    if DELTA_FROM_O:
        return dq, ds, ntail, delta
    else:
        return dq, ds, ntail


@gluon.jit
def _dq_ws_blocks(step, num_blocks, n_lo, n_mid_lo, n_mid_hi, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, ready, empty,
                  zero_bar, lse_log2, delta, offs_m, len_q, len_kv, qk_scale_log2, window_left, window_right,
                  chunk_size, s_layout: gl.constexpr, o_layout: gl.constexpr, WG: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                  HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, CONSUMERS: gl.constexpr = 2, o_wg=None,
                  delta_ptr=None, delta_rows=None,
                  DELTA_FROM_O: gl.constexpr = False):
    """The tile's ``num_blocks >= 1`` key blocks ``n_lo + b * BLOCK_N`` (fully visible band ``[n_mid_lo,
    n_mid_hi)``) as ring steps ``step + b`` of one consumer warp group: with
    ``CARRY_DS`` (``STAGES >= 3``) dS crosses from block to block and the last dQ product is finished
    (and its slot released) here. Returns ``(dq, ntail)``, no wgmma in flight. (The tree kernel,
    `tree_dq_gluon_ws`, walks its intervals with its own loop around `_dq_ws_step`.) ``DELTA_FROM_O``
    (``delta`` None): the first step computes delta from ``do_wg`` / ``o_wg`` and stores it
    (`_dq_ws_step`), the other steps use it; without ``CARRY_DS`` that first step is peeled off the loop."""
    CARRY_DS: gl.constexpr = STAGES >= 3
    first_b = 0
    if DELTA_FROM_O:  # the first step peeled: it computes delta (and with CARRY_DS hands its dS on)
        dq, ds, ntail, delta = _dq_ws_step(step, n_lo, None, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, None, ready,
                                           empty, zero_bar, lse_log2, None, offs_m, n_mid_lo, n_mid_hi, len_q,
                                           len_kv, qk_scale_log2, window_left, window_right, chunk_size, s_layout,
                                           o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                           TOP_LEFT, False, CARRY_DS, False, CONSUMERS, o_wg, delta_ptr,
                                           delta_rows, True)
        first_b = 1
    if CARRY_DS:
        if not DELTA_FROM_O:
            dq, ds, ntail = _dq_ws_step(step, n_lo, None, dq, ntail, q_wg, do_wg, k_bufs, v_bufs, None, ready, empty,
                                        zero_bar, lse_log2, delta, offs_m, n_mid_lo, n_mid_hi, len_q, len_kv,
                                        qk_scale_log2, window_left, window_right, chunk_size, s_layout, o_layout, WG,
                                        BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, False,
                                        True, False, CONSUMERS)
        for b in range(1, num_blocks):
            dq, ds, ntail = _dq_ws_step(step + b, n_lo + b * BLOCK_N, ds, dq, ntail, q_wg, do_wg, k_bufs, v_bufs,
                                        None, ready, empty, zero_bar, lse_log2, delta, offs_m, n_mid_lo, n_mid_hi,
                                        len_q, len_kv, qk_scale_log2, window_left, window_right, chunk_size, s_layout,
                                        o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                        TOP_LEFT, False, True, True, CONSUMERS)
        last = (step + num_blocks - 1) % STAGES
        dq, ds = warpgroup_mma_wait(0, deps=(warpgroup_mma(ds, k_bufs.index(last), dq, is_async=True), ds))
        mbarrier.arrive(empty.index(last), count=1)
    else:
        for b in range(first_b, num_blocks):
            dq, ds, ntail = _dq_ws_step(step + b, n_lo + b * BLOCK_N, None, dq, ntail, q_wg, do_wg, k_bufs, v_bufs,
                                        None, ready, empty, zero_bar, lse_log2, delta, offs_m, n_mid_lo, n_mid_hi,
                                        len_q, len_kv, qk_scale_log2, window_left, window_right, chunk_size, s_layout,
                                        o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                        TOP_LEFT, False, False, False, CONSUMERS)
    return dq, ntail


@gluon.jit
def _consume_item(step, q_phase, dq, ntail, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q,
                  Lse, Delta, stride_lse_head, qk_scale_log2, window_left, window_right, chunk_size, q_wg, do_wg,
                  k_bufs, v_bufs, q_bar, ready, empty, zero_bar, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
                  CONSUMERS: gl.constexpr, o_wg=None, DELTA_FROM_O: gl.constexpr = False):
    """One tile with ``num_blocks >= 1`` key blocks, ring steps ``step ...``: this warp group's lse / delta
    / query positions, wait for Q / dO (``q_bar`` phase ``q_phase``), the blocks (`_dq_ws_blocks`).
    ``DELTA_FROM_O``: delta is not loaded; the first step computes it from dO / O (``o_wg``, loaded on
    ``q_bar`` too) and stores it to ``Delta`` at the addresses the load would read (`_row_vector`).
    Returns ``(dq, ntail)``, no wgmma in flight."""
    first = q_start + WG * WG_ROWS
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_m = first + gl.arange(0, WG_ROWS, layout=row_layout)
    lse_log2 = _lse_log2(Lse, head, stride_lse_head, row0_q, first, len_q, WG_ROWS, row_layout)
    if DELTA_FROM_O:
        delta_ptr = Delta + (head.to(gl.int64) * stride_lse_head + row0_q.to(gl.int64) + first)
        mbarrier.wait(q_bar, q_phase)
        return _dq_ws_blocks(step, num_blocks, n_lo, n_mid_lo, n_mid_hi, dq, ntail, q_wg, do_wg, k_bufs, v_bufs,
                             ready, empty, zero_bar, lse_log2, None, offs_m, len_q, len_kv, qk_scale_log2,
                             window_left, window_right, chunk_size, s_layout, o_layout, WG, BLOCK_N, HEAD_DIM, STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS, o_wg, delta_ptr,
                             len_q - first, True)
    else:
        delta = _row_vector(Delta, head, stride_lse_head, row0_q, first, len_q, WG_ROWS, row_layout, 0.0)
        mbarrier.wait(q_bar, q_phase)
        return _dq_ws_blocks(step, num_blocks, n_lo, n_mid_lo, n_mid_hi, dq, ntail, q_wg, do_wg, k_bufs, v_bufs,
                             ready, empty, zero_bar, lse_log2, delta, offs_m, len_q, len_kv, qk_scale_log2,
                             window_left, window_right, chunk_size, s_layout, o_layout, WG, BLOCK_N, HEAD_DIM, STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS)


@gluon.jit
def _dq_ws_consumer(dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, stride_dq_row,
                    stride_dq_head, stride_lse_head, num_heads_q, group_size, heads_per_section, qk_scale_log2, scale,
                    window_left, window_right, chunk_size, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty,
                    zero_bar, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
                    CONSUMERS: gl.constexpr, o_smem=None, DELTA_FROM_O: gl.constexpr = False):
    """Consumer warp group ``WG`` (4 warps) of ``CONSUMERS`` (1 or 2): queries ``[64 WG, 64 WG + 64)`` of
    the program's tile, their dQ. ``DELTA_FROM_O``: delta of its rows from dO and O (its rows of ``o_smem``)
    instead of loaded (`_consume_item`)."""
    s_layout: gl.constexpr = mma_layout(4, BLOCK_N)  # S, dP: (64 queries, BLOCK_N keys)
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)  # dQ: (64 queries, HEAD_DIM)
    q_wg = q_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    do_wg = do_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    seq, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, row0_kv, col_kv = \
        _dq_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
                 heads_per_section, HEAD_DIM, BLOCK_N)
    dq = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, o_layout)
    if num_blocks > 0:
        ntail = n_lo * 0  # tail steps so far (an i32 value: it changes inside a branch)
        if DELTA_FROM_O:  # this warp group's rows of O
            dq, ntail = _consume_item(0, 0, dq, ntail, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q,
                                      len_kv, row0_q, Lse, Delta, stride_lse_head, qk_scale_log2, window_left,
                                      window_right, chunk_size, q_wg, do_wg, k_bufs, v_bufs, q_bar, ready, empty,
                                      zero_bar, s_layout, o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT,
                                      HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS,
                                      o_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0), True)
        else:
            dq, ntail = _consume_item(0, 0, dq, ntail, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q,
                                      len_kv, row0_q, Lse, Delta, stride_lse_head, qk_scale_log2, window_left,
                                      window_right, chunk_size, q_wg, do_wg, k_bufs, v_bufs, q_bar, ready, empty,
                                      zero_bar, s_layout, o_layout, WG, BLOCK_N, HEAD_DIM, STAGES, HAS_LEFT,
                                      HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS)

    # decoded again: the loads are cheaper than holding these scalars in registers across the loop
    seq, head, q_start, n_lo, n_mid_lo, n_mid_hi, num_blocks, len_q, len_kv, row0_q, row0_kv, col_kv = \
        _dq_tile(tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, num_heads_q, group_size,
                 heads_per_section, HEAD_DIM, BLOCK_N, True)
    if seq >= 0:
        # staged through this warp group's own Q rows (nobody else reads them; its wgmma are done;
        # with num_blocks == 0 no TMA was issued into them)
        base = dQ + row0_q.to(gl.int64) * stride_dq_row + head.to(gl.int64) * stride_dq_head
        _store_tile(dq * scale, q_wg, base, q_start + WG * WG_ROWS, len_q, stride_dq_row, WG_ROWS, HEAD_DIM, 4)


@gluon.jit
def _dq_ws_consumer_worker(dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                           stride_dq_row, stride_dq_head, stride_lse_head, num_heads_q, group_size, heads_per_section,
                           qk_scale_log2, scale, window_left, window_right, chunk_size, q_smem, do_smem, k_bufs,
                           v_bufs, q_bar, ready, empty, zero_bar, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                           HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr, o_smem=None,
                           DELTA_FROM_O: gl.constexpr = False):
    """The second consumer warp group (queries 64..127) as a worker partition."""
    _dq_ws_consumer(dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv, stride_dq_row,
                    stride_dq_head, stride_lse_head, num_heads_q, group_size, heads_per_section, qk_scale_log2, scale,
                    window_left, window_right, chunk_size, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty,
                    zero_bar, 1, HEAD_DIM, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, 2, o_smem,
                    DELTA_FROM_O)


# ---------------------------------------------------------------- kernel
@gluon.jit
def _dq_ws_buffers(q_desc, k_desc, v_desc, do_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
                   CONSUMERS: gl.constexpr = 2):
    """Shared memory and barriers of a warp-specialised dQ kernel (this module's and the tree's,
    `tree_dq_gluon_ws`, which always has two consumers), initialised: ``(q_smem, do_smem, k_bufs,
    v_bufs, q_bar, zero_bar, ready, empty)``; ``empty`` counts the ``CONSUMERS`` consumer warp groups,
    ``zero_bar`` is the two consumers' tail rendezvous (with one consumer not allocated: ``q_bar`` is
    returned in its place, unused)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((CONSUMERS == 1) | (CONSUMERS == 2), "one or two consumer warp groups")
    gl.static_assert(BLOCK_M == CONSUMERS * WG_ROWS, "consumer warp groups of 64 queries each")
    gl.static_assert((BLOCK_N == 64) | (BLOCK_N == 128), "key block: 64 or 128 rows")
    gl.static_assert(STAGES >= 2, "ring of at least two (K, V) slots")

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if CONSUMERS == 2:
        zero_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(zero_bar, count=2)
    else:  # the only consumer zeroes both tails: no rendezvous
        mbarrier.init(q_bar, count=1)
        zero_bar = q_bar  # (unused)
    ready, empty = _ring_barriers(STAGES, CONSUMERS)
    return q_smem, do_smem, k_bufs, v_bufs, q_bar, zero_bar, ready, empty


@gluon.jit
def varlen_bwd_dq_gluon_ws_kernel(
    q_desc, k_desc, v_desc, do_desc, o_desc, Lse, Delta, dQ, tiles,
    cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
    stride_dq_row, stride_dq_head, stride_lse_head,
    num_heads_q, group_size, qk_scale_log2, scale, window_left, window_right, chunk_size, heads_per_section,
    num_work,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_CHUNK: gl.constexpr, TOP_LEFT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    DELTA_FROM_O: gl.constexpr = False,
):
    """dQ of one (query tile, query head) per program, grid ``num_work = tiles.shape[0] * num_heads_q`` (the
    argument itself is unused). Launch with ``num_warps = 4`` and ``maxnreg`` / ``CONSUMER_REGS`` /
    ``PRODUCER_REGS`` from `packattn.ops.runtime.sm90.ws_split`. Descriptors: ``q_desc`` / ``do_desc`` blocks
    ``[BLOCK_M, HEAD_DIM]``, ``k_desc`` / ``v_desc`` blocks ``[BLOCK_N, HEAD_DIM]``. ``BLOCK_M`` 128: two consumer
    warp groups; 64: one. ``DELTA_FROM_O`` (`packattn.ops.varlen.bwd_dq_sm90_delta`): ``o_desc`` (O, blocks as
    ``do_desc``) is loaded with Q / dO and ``Delta`` is written (rowsum(dO O) of the tile's rows) instead of
    read; without it ``o_desc`` is unused (the launcher passes None: no kernel parameter)."""
    CONSUMERS: gl.constexpr = BLOCK_M // WG_ROWS
    gl.static_assert((BLOCK_M == WG_ROWS) | (BLOCK_M == 2 * WG_ROWS), "one or two consumer warp groups of 64 queries")
    q_smem, do_smem, k_bufs, v_bufs, q_bar, zero_bar, ready, empty = _dq_ws_buffers(
        q_desc, k_desc, v_desc, do_desc, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, num_warps, CONSUMERS)
    if DELTA_FROM_O:  # O of the tile (loaded on q_bar with Q / dO), read by the consumer's row sums only
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [BLOCK_M, HEAD_DIM], o_desc.layout)
    else:
        o_smem = do_smem  # (unused)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_dq_ws_consumer, (dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                               stride_dq_row, stride_dq_head, stride_lse_head, num_heads_q, group_size,
                               heads_per_section, qk_scale_log2, scale, window_left, window_right, chunk_size,
                               q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty, zero_bar, 0, HEAD_DIM, BLOCK_N,
                               STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS, o_smem, DELTA_FROM_O)),
            (_dq_ws_consumer_worker, (dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q,
                                      row_offsets_kv, stride_dq_row, stride_dq_head, stride_lse_head, num_heads_q,
                                      group_size, heads_per_section, qk_scale_log2, scale, window_left, window_right,
                                      chunk_size, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty, zero_bar,
                                      HEAD_DIM, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, o_smem,
                                      DELTA_FROM_O)),
            (_dq_ws_producer, (q_desc, k_desc, v_desc, do_desc, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q,
                               row_offsets_kv, num_heads_q, group_size, heads_per_section, q_smem, do_smem, k_bufs,
                               v_bufs, q_bar, ready, empty, HEAD_DIM, BLOCK_N, STAGES, o_desc, o_smem,
                               DELTA_FROM_O)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:  # one consumer warp group (queries 0..63) in the default partition; the launch pads the producer to 4
        # warps. With DELTA_FROM_O the producer loads O too (a third TMA on q_bar) and the consumer reads it.
        gl.warp_specialize([
            (_dq_ws_consumer, (dQ, Lse, Delta, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q, row_offsets_kv,
                               stride_dq_row, stride_dq_head, stride_lse_head, num_heads_q, group_size,
                               heads_per_section, qk_scale_log2, scale, window_left, window_right, chunk_size,
                               q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty, zero_bar, 0, HEAD_DIM, BLOCK_N,
                               STAGES, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, TOP_LEFT, CONSUMERS, o_smem, DELTA_FROM_O)),
            (_dq_ws_producer, (q_desc, k_desc, v_desc, do_desc, tiles, cu_seqlens_q, cu_seqlens_kv, row_offsets_q,
                               row_offsets_kv, num_heads_q, group_size, heads_per_section, q_smem, do_smem, k_bufs,
                               v_bufs, q_bar, ready, empty, HEAD_DIM, BLOCK_N, STAGES, o_desc, o_smem,
                               DELTA_FROM_O)),
        ], [1], [PRODUCER_REGS])
