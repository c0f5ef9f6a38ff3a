"""torch.compile(fullgraph=True) of the reference `Decoder` on Varlen and Tree batches, and of
`PackedAttention`: same logits and gradients as eager, no graph break.

Compiled with ``backend="aot_eager"`` (dynamo + AOTAutograd, the parts that must not break the
graph) to keep CI fast; one test runs the default inductor backend. Every compiled call comes after
an eager call with the same descriptor, except in the cold-dispatch-cache test.
"""

from __future__ import annotations

import os
import warnings

import pytest

import torch

from packattn import Tree, Varlen, dispatch
from packattn.bench.packings import packings, position_ids
from packattn.nn import Decoder, DecoderConfig, PackedAttention

VOCAB = 40
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_model(head_dim: int = 8) -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=VOCAB, dim=4 * head_dim, num_layers=2, heads_q=4, heads_kv=2))


def varlen_batch():
    lengths = [5, 1, 9, 3]
    tokens = torch.randint(0, VOCAB, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    return tokens, position_ids, Varlen.from_lengths(lengths)


def tree_batch():
    tree = Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [11, 12]])
    return tree.tokens, tree.position_ids, tree


def logits_and_grads(fn, model, tokens, position_ids, descriptor, backend):
    model.zero_grad(set_to_none=True)
    logits = fn(tokens, position_ids, descriptor, backend=backend)
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check_compiled_equals_eager(model, batch, backend="reference", compiler="aot_eager"):
    eager = logits_and_grads(model, model, *batch, backend)  # also warms packattn's dispatch cache
    compiled = torch.compile(model, fullgraph=True, backend=compiler)  # fullgraph: a graph break raises
    got = logits_and_grads(compiled, model, *batch, backend)
    torch.testing.assert_close(got[0], eager[0], **TOL)
    for name in eager[1]:
        torch.testing.assert_close(got[1][name], eager[1][name], **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("batch", [varlen_batch, tree_batch], ids=["varlen", "tree"])
def test_decoder_compiles_fullgraph_and_matches_eager(batch):
    check_compiled_equals_eager(make_model(), batch())


@pytest.mark.parametrize("batch", [varlen_batch, tree_batch], ids=["varlen", "tree"])
def test_decoder_forward_has_no_graph_break(batch):
    model = make_model()
    tokens, position_ids, descriptor = batch()
    model(tokens, position_ids, descriptor, backend="reference")  # warm the dispatch cache, gradients on as in training
    explained = torch._dynamo.explain(model)(tokens, position_ids, descriptor, backend="reference")
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.skipif(not os.environ.get("PACKATTN_SLOW_TESTS"), reason="inductor on CPU takes 30-60 s; "
                    "set PACKATTN_SLOW_TESTS=1")
def test_decoder_compiles_with_inductor():
    check_compiled_equals_eager(make_model(), varlen_batch(), compiler="inductor")


@pytest.mark.parametrize("backend, batch", [("triton", varlen_batch), ("triton_tree", tree_batch)],
                         ids=["varlen", "tree"])
def test_decoder_compiles_with_triton_kernels_interpreted(backend, batch):
    """The Triton kernels are custom ops with fake implementations: on CPU they run in Triton's
    interpreter (TRITON_INTERPRET=1, set by conftest) at tiny sizes."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before packattn is imported")
    check_compiled_equals_eager(make_model(head_dim=32), batch(), backend=backend)


def test_decoder_compiles_with_a_cold_dispatch_cache():
    # dispatch.select leaves its cache alone while dynamo traces (a mutation there broke the graph)
    dispatch.clear_cache()
    model = make_model()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(*varlen_batch(), backend="reference")


def test_packed_attention_compiles_fullgraph():
    attn = PackedAttention.Config(backend="reference", causal=True).build()
    g = torch.Generator().manual_seed(0)
    seqs = Varlen.from_lengths([4, 0, 7])
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4, 5], [6]])
    cases = [((2, 6), None), ((11,), seqs), ((1, 11), seqs), ((tree.total,), tree)]
    for lead, descriptor in cases:
        q, k, v = (torch.randn(*lead, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))

        def step(q, k, v, descriptor=descriptor):
            return attn(q, k, v, attention_masks=descriptor, enable_gqa=True, scale=0.5)

        eager = step(q, k, v)
        eager_grads = torch.autograd.grad(eager.square().sum(), (q, k, v))
        with warnings.catch_warnings():  # no dynamo warning either (e.g. about a cached helper it traces through)
            warnings.simplefilter("error", UserWarning)
            out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        torch.testing.assert_close(out, eager, **TOL)
        for got, want in zip(grads, eager_grads):
            torch.testing.assert_close(got, want, **TOL)


# ---------------------------------------------------------------- one graph for every packing
TOKENS = 64  # every packing below holds this many rows: a training step's fixed token budget


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (its counter is not reset between tests: compare)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("backends, count", [(("reference", "reference"), 20), (("triton", "triton_tree"), 4)],
                         ids=["reference", "triton"])
def test_packed_attention_compiles_one_graph_for_every_packing(backends, count):
    """PackedAttention under torch.compile(fullgraph=True), cold dispatch cache, over ``count`` packings (Varlen
    and Tree) of the same token budget: at most one graph per descriptor kind, results equal to eager.
    ``backends``: the one for Varlen batches and the one for trees (the Triton kernels are interpreted on CPU)."""
    if backends[0] == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before packattn is imported")
    dispatch.clear_cache()
    graphs_before = graphs_compiled()
    modules = {kind: PackedAttention.Config(backend=name, causal=True).build() for kind, name in zip((Varlen, Tree),
                                                                                                  backends)}
    compiled = {kind: torch.compile(m, fullgraph=True, backend="aot_eager") for kind, m in modules.items()}
    g = torch.Generator().manual_seed(0)
    for descriptor in packings(TOKENS, count):
        q, k, v = (torch.randn(TOKENS, h, 32, generator=g, requires_grad=True) for h in (4, 2, 2))
        out = compiled[type(descriptor)](q, k, v, attention_masks=descriptor, enable_gqa=True)
        grads = torch.autograd.grad((out * out.detach().sin()).sum(), (q, k, v))
        want = modules[type(descriptor)](q, k, v, attention_masks=descriptor, enable_gqa=True)
        want_grads = torch.autograd.grad((want * want.detach().sin()).sum(), (q, k, v))
        torch.testing.assert_close(out, want, **TOL, msg=lambda m: f"{descriptor}: {m}")
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected, **TOL, msg=lambda m: f"{descriptor}: {m}")
    assert graphs_compiled() - graphs_before <= 2  # one per descriptor kind (Varlen, Tree)


def test_decoder_compiles_one_graph_for_every_packing():
    """nn.Decoder, compiled once, trained-step style over 20 packings (Varlen and Tree): at most 2 graphs,
    logits and parameter gradients equal to eager."""
    dispatch.clear_cache()
    graphs_before = graphs_compiled()
    model = make_model()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    rng = torch.Generator().manual_seed(3)
    for descriptor in packings(TOKENS, 20, seed=1):
        tokens = torch.randint(0, VOCAB, (TOKENS,), generator=rng)
        batch = (tokens, position_ids(descriptor), descriptor)
        want = logits_and_grads(model, model, *batch, "auto")
        got = logits_and_grads(compiled, model, *batch, "auto")
        torch.testing.assert_close(got[0], want[0], **TOL)
        for name in want[1]:
            torch.testing.assert_close(got[1][name], want[1][name], **TOL, msg=lambda m: f"{name}: {m}")
    assert graphs_compiled() - graphs_before <= 2
