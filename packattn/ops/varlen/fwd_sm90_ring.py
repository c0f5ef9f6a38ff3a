"""The warp-specialised Gluon forward's ring (`packattn.ops.varlen.fwd_sm90`): the producer's K / V loads and the
consumers' side of its barriers, and the views of Q its S products read.

* One barrier a slot (the default): ``ready[slot]`` / ``empty[slot]`` for K and V together, the slot released
  once PV is done (`_load_kv`, `_wait_slot`).
* ``SPLIT_KV`` (`configs.GluonConfig.split_kv`): ``2 STAGES`` barriers each, ``[slot]`` for K and
  ``[STAGES + slot]`` for V; K goes back to the producer once S is done, V once PV is (`_load_kv_split`,
  `_v_bar`, `_wait_v`, `_release_k`), so the next K loads under the softmax and PV.
* Q's descriptors (`q_desc_in_loop`, `_q_view`): at d = 256 with 64-key blocks built per S inside the loop.
* ``Q_REGS`` (`configs.GluonConfig.q_in_regs`): Q loaded into registers at the tile's start and its shared memory
  released at once (`_q_operands`); otherwise released after the tile's last S (`_release_q`); refused at head
  dims of 256 (`q_regs_ok`).

Without ``SPLIT_KV`` / ``Q_REGS`` the helpers emit the code of the kernel before them (same PTX).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from packattn.ops.runtime.gluon_compat import tma_load
from packattn.ops.varlen.common_sm90 import _load_kv_block
from packattn.ops.varlen.common_sm90_ws import _opaque_i32
from packattn.ops.varlen.fwd_sm90_parts import _load_kv_parts


@gluon.jit
def _load_kv_split(k_desc, v_desc, k_lo_desc, v_lo_desc, k_bufs, v_bufs, k_lo_bufs, v_lo_bufs, ready, empty, block,
                   row0_kv, n_lo, col_k, col_v, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D_HI: gl.constexpr,
                   DV_HI: gl.constexpr):
    """`_load_kv_parts` on a ring with separate K and V barriers (the kernel's ``SPLIT_KV``): once ``empty[slot]``
    says the consumers' S is done with the slot's K, K (and its ``lo`` part) onto ``ready[slot]``; once
    ``empty[STAGES + slot]`` says their PV is done with its V, V onto ``ready[STAGES + slot]``."""
    slot = block % STAGES
    phase = ((block // STAGES) & 1) ^ 1
    row = row0_kv + n_lo + block * BLOCK_N
    mbarrier.wait(empty.index(slot), phase)
    k_bytes: gl.constexpr = k_desc.block_type.nbytes + (0 if k_lo_desc is None else k_lo_desc.block_type.nbytes)
    mbarrier.expect(ready.index(slot), k_bytes)
    tma_load(k_desc, [row, col_k], ready.index(slot), k_bufs.index(slot))
    if k_lo_desc is not None:
        tma_load(k_lo_desc, [row, col_k + D_HI], ready.index(slot), k_lo_bufs.index(slot))
    mbarrier.wait(empty.index(STAGES + slot), phase)
    v_bytes: gl.constexpr = v_desc.block_type.nbytes + (0 if v_lo_desc is None else v_lo_desc.block_type.nbytes)
    mbarrier.expect(ready.index(STAGES + slot), v_bytes)
    tma_load(v_desc, [row, col_v], ready.index(STAGES + slot), v_bufs.index(slot))
    if v_lo_desc is not None:
        tma_load(v_lo_desc, [row, col_v + DV_HI], ready.index(STAGES + slot),
                                        v_lo_bufs.index(slot))


@gluon.jit
def _col_v(col_kv, head_kv, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr):
    """V's first column for kv head ``head_kv``: K's (``col_kv``) where the head dims agree, else at V's own."""
    if HEAD_DIM_V == HEAD_DIM:
        col_v = col_kv
    else:
        col_v = head_kv * HEAD_DIM_V
    return col_v


@gluon.jit
def _load_kv(k_desc, v_desc, k_lo_desc, v_lo_desc, k_bufs, v_bufs, k_lo_bufs, v_lo_bufs, ready, empty, block, row0_kv,
             n_lo, col_kv, head_kv, num_blocks, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             HEAD_DIM_V: gl.constexpr, PLAIN: gl.constexpr, SPLIT_KV: gl.constexpr):
    """One ring block's K and V once the consumers released its slot (`common_sm90._load_kv_block`; not
    ``PLAIN``: `fwd_sm90_parts._load_kv_parts`, K at ``col_kv``, V at kv head ``head_kv``'s columns of its own head
    dim; ``SPLIT_KV``: `_load_kv_split`, K and V each after its own release)."""
    if SPLIT_KV:
        _load_kv_split(k_desc, v_desc, k_lo_desc, v_lo_desc, k_bufs, v_bufs, k_lo_bufs, v_lo_bufs, ready, empty, block,
                       row0_kv, n_lo, col_kv, _col_v(col_kv, head_kv, HEAD_DIM, HEAD_DIM_V), STAGES, BLOCK_N,
                       k_bufs.shape[2], v_bufs.shape[2])
    else:
        if PLAIN:
            _load_kv_block(k_desc, v_desc, k_bufs, v_bufs, ready, block, row0_kv, n_lo, col_kv, num_blocks, STAGES,
                           BLOCK_N)
        else:
            _load_kv_parts(k_desc, v_desc, k_lo_desc, v_lo_desc, k_bufs, v_bufs, k_lo_bufs, v_lo_bufs, ready, block,
                           row0_kv, n_lo, col_kv, _col_v(col_kv, head_kv, HEAD_DIM, HEAD_DIM_V), num_blocks, STAGES,
                           BLOCK_N, k_bufs.shape[2], v_bufs.shape[2])


@gluon.jit
def _wait_slot(empty, block, STAGES: gl.constexpr, SPLIT_KV: gl.constexpr):
    """Producer, one barrier a slot: wait until the consumers released ring block ``block``'s slot (``SPLIT_KV``:
    nothing here, `_load_kv_split` waits for K's and V's release each)."""
    if SPLIT_KV:
        pass
    else:
        mbarrier.wait(empty.index(block % STAGES), ((block // STAGES) & 1) ^ 1)


@gluon.jit
def _v_bar(block, STAGES: gl.constexpr, SPLIT_KV: gl.constexpr):
    """The ring barrier index of ring block ``block``'s V: ``STAGES + slot`` with ``SPLIT_KV``, else the slot's
    one barrier (K's too)."""
    slot = block % STAGES
    if SPLIT_KV:
        slot = slot + STAGES
    return slot


@gluon.jit
def _wait_v(ready, block, STAGES: gl.constexpr, SPLIT_KV: gl.constexpr):
    """``SPLIT_KV``: wait until ring block ``block``'s V has landed (without it, K's wait covered V)."""
    if SPLIT_KV:
        mbarrier.wait(ready.index(STAGES + block % STAGES), (block // STAGES) & 1)


@gluon.jit
def _release_k(empty, block, STAGES: gl.constexpr, SPLIT_KV: gl.constexpr):
    """``SPLIT_KV``: ring block ``block``'s S is done, its K slot goes back to the producer (without it, the
    slot goes back once PV is done)."""
    if SPLIT_KV:
        mbarrier.arrive(empty.index(block % STAGES), count=1)


@gluon.jit
def _release_q(q_empty, Q_REGS: gl.constexpr):
    """The consumer is done with the tile's Q in shared memory: arrive on ``q_empty``, unless ``Q_REGS`` (Q went to
    registers at the tile's start and ``q_empty`` was arrived on then: one arrival a tile either way)."""
    if Q_REGS:
        pass
    else:
        mbarrier.arrive(q_empty, count=1)


@gluon.jit
def _q_operands(q_wg, q_lo_wg, q_empty, s_layout: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                Q_REGS: gl.constexpr):
    """The consumer's Q operands of the tile's S products once Q has landed: its shared-memory views ``(q_wg,
    q_lo_wg)``, or with ``Q_REGS`` both loaded into registers (the wgmma A operand layout) and Q's shared memory
    released on ``q_empty`` at once (`_release_q` then arrives no more). ``q_lo_wg``: None without a second part;
    the second operand returned is then a stand-in (the first: a jit function cannot return None)."""
    gl.static_assert((not Q_REGS) | q_regs_ok(HEAD_DIM, HEAD_DIM_V), "q_in_regs: head dims below 256")
    q_op = q_wg
    if Q_REGS:
        q_op = q_wg.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    q_lo_op = q_op
    if q_lo_wg is not None:
        q_lo_op = q_lo_wg
        if Q_REGS:
            q_lo_op = q_lo_wg.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    if Q_REGS:
        # the loads above are generic-proxy reads of Q's buffer; the next tile's Q lands there by TMA (async proxy)
        # once q_empty completes: order them first (PTX memory model, cross-proxy write-after-read)
        fence_async_shared()
        mbarrier.arrive(q_empty, count=1)
    return q_op, q_lo_op


@gluon.constexpr_function
def q_regs_ok(head_dim, head_dim_v):
    """Can Q sit in registers (`configs.GluonConfig.q_in_regs`)? Not at 256: Q's 64 registers a thread beside the
    256-column output accumulator's 128 spill. (MLA's 192 / 128 with Q in registers gave wrong rows now and then
    until `_q_operands` fenced its register loads before releasing Q's buffer: benchmarks/NOTES.md v39, v40.)"""
    return max(int(head_dim), int(head_dim_v)) < 256


@gluon.constexpr_function
def q_desc_in_loop(head_dim, head_dim_v, block_n):
    """Does the consumer build Q's wgmma descriptors per S inside the loop (`_q_view`)? At d = 256 with 64-key
    blocks: hoisted, Q's 16 descriptors take registers those blocks need (ptxas spills); elsewhere they stay
    hoisted (the kernel's code as without this)."""
    return int(head_dim) == 256 and int(head_dim_v) == 256 and int(block_n) >= 64


@gluon.jit
def _q_view(q_wg, like, Q_WG: gl.constexpr):
    """The consumer's 64 rows of Q for one S: ``q_wg`` itself, or with ``Q_WG >= 0`` (`q_desc_in_loop`) rows
    ``64 Q_WG ...`` of ``q_wg`` (then Q's whole buffer as ``[1, rows, d]``, the same bytes) indexed by a zero
    LLVM cannot hoist (inline asm of ``like``, any int32 scalar of the loop)."""
    if Q_WG >= 0:
        q_wg = q_wg.index(_opaque_i32(like * 0)).slice(Q_WG * 64, 64, dim=0)
    return q_wg
