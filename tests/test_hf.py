"""attn_implementation="packattn" in a tiny random Llama (CPU, no downloads): packed batches give the
logits of running each sequence alone with transformers' eager attention."""

import inspect
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

import packattn  # noqa: E402
from packattn.nn import hf  # noqa: E402

ATOL = 1e-5


@pytest.fixture(scope="module")
def models():
    hf.register()

    def make(attn_implementation):  # one config each: from_config writes the implementation into it
        config = transformers.LlamaConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256, use_cache=False)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        return model.float().eval()

    torch.manual_seed(0)
    packed, eager = make("packattn"), make("eager")
    eager.load_state_dict(packed.state_dict())
    assert packed.config._attn_implementation == "packattn" and eager.config._attn_implementation == "eager"
    return packed, eager


@pytest.fixture
def spy():
    """packattn.attention, wrapped to record its calls: a test cannot pass by running eager."""
    with mock.patch.object(packattn, "attention", wraps=packattn.attention) as wrapped:
        yield wrapped


def _descriptors(spy):
    """The descriptor of every packattn.attention call so far (None for a dense call); resets the spy."""
    seen = [c.args[3] if len(c.args) > 3 else None for c in spy.call_args_list]
    spy.reset_mock()
    return seen


def _alone(eager, sequences):
    """Logits of each sequence run alone with eager attention, concatenated."""
    with torch.no_grad():
        return torch.cat([eager(torch.tensor(s)[None]).logits[0] for s in sequences])


SEQS = [[5, 17, 3, 9, 2], [11, 4], [7, 7, 8, 1, 30, 2, 6, 60], [42]]


def _packed_inputs(sequences):
    ids = torch.tensor([t for s in sequences for t in s])[None]
    pos = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    return ids, pos


def test_register_is_idempotent_and_lazy():
    import subprocess
    import sys

    hf.register()
    hf.register()
    assert transformers.AttentionInterface()["packattn"] is hf.packattn_attention
    code = "import sys, packattn, packattn.nn; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_packed_varlen_descriptor(models, spy):
    packed, eager = models
    ids, pos = _packed_inputs(SEQS)
    seqs = packattn.Varlen.from_lengths([len(s) for s in SEQS])
    with torch.no_grad():
        logits = packed(ids, position_ids=pos, packattn_descriptor=seqs).logits[0]
    assert _descriptors(spy) == [seqs, seqs]
    torch.testing.assert_close(logits, _alone(eager, SEQS), atol=ATOL, rtol=0)


def test_packed_from_position_ids(models, spy):
    packed, eager = models
    ids, pos = _packed_inputs(SEQS)
    with torch.no_grad():
        logits = packed(ids, position_ids=pos).logits[0]
        # transformers' own masks ignore packing when there is a cache; packattn still packs
        logits_cached = packed(ids, position_ids=pos, use_cache=True).logits[0]
    first, second, third, fourth = _descriptors(spy)
    assert isinstance(first, packattn.Varlen) and first.lengths_q == (5, 2, 8, 1)
    assert second is first and fourth is third  # derived once per forward, shared by the layers
    torch.testing.assert_close(logits, _alone(eager, SEQS), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits_cached, logits, atol=ATOL, rtol=0)


def test_packed_from_flash_attention_kwargs(models, spy):
    packed, eager = models
    ids, pos = _packed_inputs(SEQS)
    cu = torch.tensor([0, 5, 7, 15, 16], dtype=torch.int32)
    with torch.no_grad():
        flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8, max_length_k=8)
        logits = packed(ids, position_ids=pos, **flash_kwargs).logits[0]
    assert [d.lengths_q for d in _descriptors(spy)] == [(5, 2, 8, 1)] * 2
    torch.testing.assert_close(logits, _alone(eager, SEQS), atol=ATOL, rtol=0)


def test_tree_batch(models, spy):
    packed, eager = models
    prompt = [3, 14, 15, 92, 65]
    sequences = [prompt + [35, 89], prompt + [79, 32, 38, 46], prompt + [26]]
    tree = packattn.Tree.from_sequences(sequences)
    assert tree.total < sum(map(len, sequences))
    with torch.no_grad():
        logits = packed(tree.tokens[None], position_ids=tree.position_ids[None], packattn_descriptor=tree).logits[0]
    assert _descriptors(spy) == [tree, tree]
    torch.testing.assert_close(tree.gather(logits), _alone(eager, sequences), atol=ATOL, rtol=0)


def test_unpacked_batch(models, spy):
    packed, eager = models
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, eager(ids).logits, atol=ATOL, rtol=0)
        assert _descriptors(spy) == [None, None]
        ones = torch.ones_like(ids)
        torch.testing.assert_close(packed(ids, attention_mask=ones).logits, eager(ids).logits, atol=ATOL, rtol=0)
        assert _descriptors(spy) == [None, None]


def test_decoding_with_cache(models, spy):
    packed, eager = models
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(2))
    cache_kwarg = "cache" if "cache" in inspect.signature(packed.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = packed(ids[:, :4], use_cache=True)
        step = packed(ids[:, 4:], **{cache_kwarg: out.past_key_values}, use_cache=True).logits
        assert spy.call_count == 4 and all(c.kwargs["causal"] for c in spy.call_args_list)
        torch.testing.assert_close(step, eager(ids).logits[:, 4:], atol=ATOL, rtol=0)
        ones = torch.ones_like(ids)
        generated = packed.generate(ids, attention_mask=ones, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(generated, eager.generate(ids, attention_mask=ones, max_new_tokens=4, do_sample=False,
                                                     pad_token_id=0))


def test_sliding_window_packed(spy):
    hf.register()

    def make(attn_implementation):
        config = transformers.MistralConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, sliding_window=3, use_cache=False)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()

    torch.manual_seed(0)
    packed, eager = make("packattn"), make("eager")
    eager.load_state_dict(packed.state_dict())
    ids, pos = _packed_inputs(SEQS)
    with torch.no_grad():
        logits = packed(ids, position_ids=pos).logits[0]
    assert [c.kwargs["window"] for c in spy.call_args_list] == [(2, 0)] * 2
    torch.testing.assert_close(logits, _alone(eager, SEQS), atol=ATOL, rtol=0)


def test_right_padding_is_honoured(models, spy):
    packed, eager = models
    ids = torch.tensor([SEQS[0] + [0, 0, 0], SEQS[2]])
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8])
    with torch.no_grad():
        logits = packed(ids, attention_mask=mask).logits
    assert [d.lengths_q for d in _descriptors(spy)] == [(5, 8)] * 2
    torch.testing.assert_close(logits[0, :5], _alone(eager, [SEQS[0]]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], _alone(eager, [SEQS[2]]), atol=ATOL, rtol=0)


def test_left_padding_is_honoured(models, spy):
    packed, eager = models
    ids = torch.tensor([[0, 0, 0] + SEQS[0], SEQS[2], [0] * 7 + SEQS[3]])
    mask = (ids != 0).long()
    mask[1] = 1
    with torch.no_grad():
        logits = packed(ids, attention_mask=mask).logits
    # rows of 8: each sequence ends its row; an empty sequence covers the padding in front of the first
    assert [(d.lengths_q, d.host_starts_q) for d in _descriptors(spy)] == [((0, 5, 8, 1), (0, 3, 8, 23))] * 2
    torch.testing.assert_close(logits[0, 3:], _alone(eager, [SEQS[0]]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], _alone(eager, [SEQS[2]]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2, 7:], _alone(eager, [SEQS[3]]), atol=ATOL, rtol=0)


def test_padding_inside_a_row_raises(models, spy):
    packed, _ = models
    ids = torch.tensor([[5, 17, 0, 3, 9], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"rows \[0\] .*padding_side = 'left'"), torch.no_grad():
        packed(ids, attention_mask=mask)
    assert spy.call_count == 0


def test_right_padded_prompt_with_cache_raises(models):
    """generate() appends tokens after the padding of a right-padded prompt: refused, naming the fix."""
    packed, _ = models
    ids = torch.tensor([[5, 17, 3, 0], [1, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="padding_side = 'left'"), torch.no_grad():
        packed.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_dense_4d_mask_raises(models):
    packed, _ = models
    ids = torch.tensor([[1, 2, 3]])
    mask = torch.zeros(1, 1, 3, 3)
    with pytest.raises(TypeError, match="precomputed attention mask"), torch.no_grad():
        packed(ids, attention_mask=mask)


def test_unknown_mask_piece_raises():
    from transformers.masking_utils import and_masks, causal_mask_function, or_masks

    with pytest.raises(NotImplementedError, match="cannot honour"):
        hf.packattn_mask(1, 4, 4, mask_function=and_masks(causal_mask_function, lambda b, h, q, k: q >= 0))
    with pytest.raises(NotImplementedError, match="cannot honour the transformers mask piece 'or_masks"):
        hf.packattn_mask(1, 4, 4, mask_function=or_masks(causal_mask_function, causal_mask_function))
    mask = hf.packattn_mask(2, 4, 4)
    assert (mask.causal, mask.window, mask.packed, mask.fresh, mask.spans) == (True, None, False, True, None)


def test_packed_mask_pieces_are_read():
    """The pieces transformers adds for packed sequences (the same-sequence mask; from 5.23 also the position
    remapping around the causal or windowed piece) are recognised, whichever this transformers builds."""
    from transformers import masking_utils as mu

    pos = torch.tensor([[0, 1, 2, 0, 1]])
    same_seq = mu.packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1]]))
    windowed = mu.sliding_window_causal_mask_function(3)
    if hasattr(mu, "remap_positions_for_packed_sequence"):
        windowed = mu.remap_positions_for_packed_sequence(windowed, pos)
    mask = hf.packattn_mask(1, 5, 5, mask_function=mu.and_masks(windowed, same_seq))
    assert (mask.causal, mask.window, mask.packed) == (True, 3, True)


def test_static_cache_offsets(models):
    """A static cache: keys past the last query are empty slots, the query offset arrives as a tensor."""
    mask = hf.packattn_mask(2, 1, 16, q_offset=torch.tensor(5), attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]] * 2))
    assert (mask.q_shift, mask.kv_used, mask.spans) == (5, 6, ((2, 6), (2, 6)))
    with pytest.raises(NotImplementedError, match="every query's own key"):
        hf.packattn_mask(2, 4, 3)
    # queries that are all the keys need no read of the offset; other offsets cannot be read in a traced graph
    assert hf.packattn_mask(1, 4, 4, q_offset=torch.tensor(0)).q_shift == 0
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        with pytest.raises(NotImplementedError, match="static cache on the host.*fullgraph=True"):
            hf.packattn_mask(1, 1, 16, q_offset=torch.tensor(5))
        with pytest.raises(NotImplementedError, match="attention_mask on the host"):
            hf.packattn_mask(1, 4, 4, attention_mask=torch.ones(1, 4))


@pytest.mark.parametrize("q_length", [3, 6])
def test_bidirectional_padded_keys(spy, q_length):
    """A bidirectional mask (encoders, cross-attention: 3 queries over 6 keys) places no queries: every query
    row is real and sees its row's real keys, as transformers' eager attention with the same padding."""
    from types import SimpleNamespace

    from transformers.masking_utils import bidirectional_mask_function
    from transformers.models.llama.modeling_llama import eager_attention_forward

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, q_length, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    keep = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]).bool()
    module = SimpleNamespace(num_key_value_groups=2, training=False, is_causal=False)
    mask = hf.packattn_mask(2, q_length, 6, mask_function=bidirectional_mask_function, attention_mask=keep)
    assert (mask.causal, mask.q_shift, mask.spans) == (False, None, ((2, 6), (0, 5)))
    out, _ = hf.packattn_attention(module, q, k, v, mask, scaling=8 ** -0.5)
    (seqs,) = _descriptors(spy)
    assert (seqs.lengths_q, seqs.lengths_kv) == ((0, q_length, q_length), (0, 4, 5))
    additive = torch.zeros(2, 1, q_length, 6).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=8 ** -0.5)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=0)


def test_gradients_match_eager(models, spy):
    packed, eager = models
    ids, pos = _packed_inputs(SEQS)
    seqs = packattn.Varlen.from_lengths([len(s) for s in SEQS])
    weight = "model.layers.0.self_attn.k_proj.weight"
    packed.zero_grad()
    packed(ids, position_ids=pos, packattn_descriptor=seqs).logits.square().sum().backward()
    assert _descriptors(spy) == [seqs, seqs]
    eager.zero_grad()
    for s in SEQS:
        eager(torch.tensor(s)[None]).logits.square().sum().backward()
    grad, want = packed.get_parameter(weight).grad, eager.get_parameter(weight).grad
    torch.testing.assert_close(grad, want, atol=1e-4, rtol=1e-4)
    packed.zero_grad()
    eager.zero_grad()
