"""`attention()` and `DotProductAttention`: every validation error, raised before any backend runs,
with the offending value named in the message."""

import math

import pytest
import torch

from packattn import DotProductAttention, NoBackendError, Varlen, attention
from packattn import dispatch

SEQS = Varlen.from_lengths([3, 2])  # total 5
CROSS = Varlen.from_lengths([3, 2], [4, 1])  # total_q 5, total_kv 5


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def qkv(total_q=5, total_kv=5, hq=4, hk=2, d=8, dv=None, dtype=torch.float32):
    return t(total_q, hq, d, dtype=dtype), t(total_kv, hk, d, dtype=dtype), t(total_kv, hk, dv or d, dtype=dtype)


@pytest.fixture(autouse=True)
def _no_backend_runs(monkeypatch):
    """Validation must fail before dispatch: make any backend selection an error."""
    dispatch.clear_cache()

    def refuse(*args, **kwargs):
        raise AssertionError("dispatch was reached")

    monkeypatch.setattr(dispatch, "select", refuse)
    yield
    dispatch.clear_cache()


Q, K, V = qkv()


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        # tensors
        ((Q.long(), K, V, SEQS), {}, TypeError, r"q has dtype torch.int64; packattn takes float16, bfloat16, float32 or float64"),
        ((Q, K.int(), V, SEQS), {}, TypeError, r"k has dtype torch.int32"),
        ((Q, K, V.to(torch.complex64), SEQS), {}, TypeError, r"v has dtype torch.complex64"),
        ((Q.half(), K, V, SEQS), {}, TypeError, r"q, k, v must share a dtype, got torch.float16, torch.float32, torch.float32"),
        ((Q, K, V.bfloat16(), SEQS), {}, TypeError, r"must share a dtype"),
        (([[0.0]], K, V, SEQS), {}, TypeError, r"q must be a torch.Tensor, got list"),
        ((Q, None, V, SEQS), {}, TypeError, r"k must be a torch.Tensor, got NoneType"),
        ((Q[0], K, V, SEQS), {}, ValueError, r"q must be 3-D for layout='thd', got shape \(4, 8\)"),
        ((Q, K[None], V, SEQS), {}, ValueError, r"k must be 3-D for layout='thd', got shape \(1, 5, 2, 8\)"),
        ((Q, K, V, None), {"layout": "bshd"}, ValueError, r"q must be 4-D for layout='bshd', got shape \(5, 4, 8\)"),
        ((*qkv(hq=3, hk=2), SEQS), {}, ValueError, r"heads_q \(3\) must be a multiple of heads_kv \(2\)"),
        ((Q, t(5, 2, 8), t(5, 1, 8), SEQS), {}, ValueError, r"k has 2 heads but v has 1"),
        ((Q, t(5, 0, 8), t(5, 0, 8), SEQS), {}, ValueError, r"heads_q \(4\) must be a multiple of heads_kv \(0\)"),
        ((Q, t(5, 2, 16), t(5, 2, 8), SEQS), {}, ValueError, r"q head_dim 8 != k head_dim 16"),
        ((t(5, 4, 0), t(5, 2, 0), t(5, 2, 8), SEQS), {}, ValueError, r"head_dim must be positive"),
        # descriptor
        ((t(6, 4, 8), K, V, SEQS), {}, ValueError, r"q has 6 rows but the descriptor describes total_q=5"),
        ((Q, t(4, 2, 8), t(4, 2, 8), SEQS), {}, ValueError, r"k/v have 4/4 rows but the descriptor describes total_kv=5"),
        ((Q, K, t(6, 2, 8), CROSS), {}, ValueError, r"k/v have 5/6 rows but the descriptor describes total_kv=5"),
        ((Q, K, V), {}, TypeError, r"layout='thd' needs a packattn.Varlen descriptor as seqs, got NoneType"),
        ((Q, K, V, SEQS.cu_seqlens_q), {}, TypeError, r"needs a packattn.Varlen descriptor as seqs, got Tensor"),
        ((Q[None], K[None], V[None], SEQS), {"layout": "bshd"}, ValueError, r"layout='bshd' is a dense batch: pass seqs=None"),
        ((Q[None], K[None], V[None], SEQS), {"layout": "sbhd"}, ValueError, r"layout='sbhd' is a dense batch"),
        ((Q[None], t(2, 5, 2, 8), t(2, 5, 2, 8)), {"layout": "bshd"}, ValueError, r"q, k, v batch/sequence sizes disagree"),
        ((Q[None], K[None], t(1, 6, 2, 8)), {"layout": "bshd"}, ValueError, r"batch/sequence sizes disagree"),
        ((Q[:, None], t(5, 2, 2, 8), t(5, 2, 2, 8)), {"layout": "sbhd"}, ValueError, r"batch/sequence sizes disagree"),
        # layout
        ((Q, K, V, SEQS), {"layout": "bhsd"}, ValueError, r"layout must be one of \('thd', 'bshd', 'sbhd'\), got 'bhsd'"),
        ((Q, K, V, SEQS), {"layout": "THD"}, ValueError, r"layout must be one of"),
        # mask options
        ((Q, K, V, SEQS), {"causal": "left"}, ValueError, r"causal must be True, False, 'bottom_right' or 'top_left', got 'left'"),
        ((Q, K, V, SEQS), {"window": (4,)}, ValueError, r"window must be a \(left, right\) pair, got \(4,\)"),
        ((Q, K, V, SEQS), {"window": (-3, 0)}, ValueError, r"window left must be an int >= -1"),
        ((Q, K, V, SEQS), {"window": (2, 0.5)}, ValueError, r"window right must be an int >= -1 .* got 0.5"),
        ((Q, K, V, SEQS), {"chunk_size": 0}, ValueError, r"chunk_size must be a positive int, got 0"),
        ((Q, K, V, SEQS), {"chunk_size": 64.0}, ValueError, r"chunk_size must be a positive int, got 64.0"),
        # scale
        ((Q, K, V, SEQS), {"scale": float("nan")}, ValueError, r"scale must be a finite number, got nan"),
        ((Q, K, V, SEQS), {"scale": math.inf}, ValueError, r"scale must be a finite number, got inf"),
        ((Q, K, V, SEQS), {"scale": "0.1"}, ValueError, r"scale must be a finite number, got '0.1'"),
        ((Q, K, V, SEQS), {"scale": True}, ValueError, r"scale must be a finite number, got True"),
        ((Q, K, V, SEQS), {"scale": torch.tensor(0.1)}, ValueError, r"scale must be a finite number"),
    ],
)
def test_attention_rejects(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attention(*args, **kwargs)


def test_errors_are_value_or_type_errors_before_dispatch():
    # the fixture makes reaching dispatch an AssertionError: a valid call gets that far, proving the check works
    with pytest.raises(AssertionError, match="dispatch was reached"):
        attention(Q, K, V, SEQS)


def test_dot_product_attention_validates_at_construction():
    with pytest.raises(ValueError, match=r"layout must be one of .* got 'bsh'"):
        DotProductAttention(layout="bsh")
    with pytest.raises(ValueError, match=r"causal must be .* got 'no'"):
        DotProductAttention(causal="no")
    with pytest.raises(ValueError, match=r"window must be a \(left, right\) pair"):
        DotProductAttention(window=3)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got -1"):
        DotProductAttention(chunk_size=-1)


# ------------------------------------------------------------------------------------ backend names
# (these reach dispatch, so they run without the refusing fixture)
@pytest.fixture
def real_dispatch(monkeypatch):
    monkeypatch.undo()
    monkeypatch.delenv("PACKATTN_BACKEND", raising=False)
    monkeypatch.delenv("PACKATTN_DISABLE", raising=False)
    dispatch.clear_cache()
    yield monkeypatch
    dispatch.clear_cache()


def test_unknown_backend_name(real_dispatch):
    with pytest.raises(ValueError, match=r"unknown backend backend='fast'; known: .*reference.*sdpa"):
        attention(Q, K, V, SEQS, backend="fast")


def test_unknown_forced_backend_name(real_dispatch):
    real_dispatch.setenv("PACKATTN_BACKEND", "nope")
    with pytest.raises(ValueError, match=r"unknown backend PACKATTN_BACKEND='nope'; known: "):
        attention(Q, K, V, SEQS)


def test_backend_that_cannot_run_the_call(real_dispatch):
    with pytest.raises(NoBackendError, match=r"sdpa: SDPA does not return the log-sum-exp"):
        attention(Q, K, V, SEQS, backend="sdpa", return_lse=True)
    with pytest.raises(ValueError, match=r"no packattn backend can run this call"):
        attention(Q, K, V, SEQS, backend="sdpa", return_lse=True)


def test_dense_calls_share_one_descriptor_per_shape(real_dispatch):
    """Per-batch metadata must not be rebuilt on every dense call (every layer)."""
    from packattn import api

    q = torch.randn(2, 5, 2, 8)
    built = []
    real = api.Varlen.uniform

    def counting(*args):
        built.append(args)
        return real(*args)

    api._dense_descriptor.cache_clear()
    real_dispatch.setattr(api.Varlen, "uniform", counting)
    for _ in range(3):
        attention(q, q, q, layout="bshd", causal=True)
    attention(q[:1], q[:1], q[:1], layout="bshd")
    assert len(built) == 2  # one per distinct (batch, seq_q, seq_kv, device)
    api._dense_descriptor.cache_clear()
