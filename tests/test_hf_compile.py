"""attn_implementation="packattn" under torch.compile(fullgraph=True): a tiny Mistral (sliding window)
trained on packed rows described by ``packattn_descriptor=`` compiles without a graph break, gives the
logits and gradients of the uncompiled model, and new packings do not recompile past a second
(dynamic-shape) graph. What needs a host read inside the traced graph raises a packattn message that
names the fix."""

from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

import packattn  # noqa: E402
from packattn.nn import hf  # noqa: E402

PACKINGS = [[7, 1, 5, 9], [6], [9, 8]]


@pytest.fixture(scope="module")
def model():
    hf.register()
    config = transformers.MistralConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, sliding_window=3)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.NAME).float().train()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _packed(lengths, seed):
    ids = torch.randint(3, 100, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(input_ids=ids, position_ids=pos, packattn_descriptor=packattn.Varlen.from_lengths(lengths))


def _step(fn, model, batch):
    model.zero_grad()
    logits = fn(**batch, use_cache=False).logits
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_packed_training_compiles_once_for_all_packings(model):
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]  # (not reset between tests on every torch version)
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # fullgraph: a graph break raises
    for seed, lengths in enumerate(PACKINGS):
        batch = _packed(lengths, seed)
        with mock.patch.object(packattn, "attention", wraps=packattn.attention) as spy:  # a spy cannot be traced
            want_logits, want_grads = _step(model, model, batch)
        assert [c.args[3] for c in spy.call_args_list] == [batch["packattn_descriptor"]]
        assert [c.kwargs["window"] for c in spy.call_args_list] == [(2, 0)]  # the layer's sliding_window=3
        logits, grads = _step(compiled, model, batch)
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    assert counters["stats"]["unique_graphs"] - graphs_before <= 2


def test_position_ids_packing_under_compile_names_the_fix(model):
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    batch = _packed([4, 5], 0)
    del batch["packattn_descriptor"]
    with pytest.raises(Exception, match=r"position_ids \(to find packed sequences\).*pass packattn_descriptor="):
        compiled(**batch, use_cache=False)
