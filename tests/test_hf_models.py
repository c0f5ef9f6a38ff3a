"""attn_implementation="packattn" across model families (tiny random configs, CPU, float32): packed
training (DataCollatorWithFlattening, packattn descriptors, gradient checkpointing on and off) and
generate() (dynamic and static cache, batched left-padded prompts) give the logits and gradients of
each sequence run alone with transformers' eager attention. A spy proves packattn ran every layer."""

from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

import packattn  # noqa: E402
from packattn.nn import hf  # noqa: E402

ATOL = 2e-5
LAYERS = 2
COMMON = dict(vocab_size=100, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configs():
    """name -> (config class, its keyword arguments, packattn window of each layer)."""
    full, window_3 = [None] * LAYERS, [(2, 0)] * LAYERS  # transformers' sliding_window=3: 2 keys back
    return {
        "llama": (transformers.LlamaConfig, {}, full),
        "qwen2": (transformers.Qwen2Config, {}, full),
        "qwen3": (transformers.Qwen3Config, dict(head_dim=8), full),
        "mistral": (transformers.MistralConfig, dict(sliding_window=3), window_3),
        "gemma3": (transformers.Gemma3TextConfig,
                   dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=3,
                        layer_types=["sliding_attention", "full_attention"]), [(2, 0), None]),
        "qwen2_moe": (transformers.Qwen2MoeConfig,
                      dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           shared_expert_intermediate_size=32, decoder_sparse_step=1), full),
    }


MODELS = list(_configs())
_made = {}


def _pair(name):
    """(packattn model, eager model) with the same random weights, float32, cached per module."""
    if name not in _made:
        hf.register()
        config_class, kwargs, _ = _configs()[name]

        def make(attn_implementation):  # one config each: from_config writes the implementation into it
            config = config_class(**COMMON, **kwargs)
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
            return model.float()

        torch.manual_seed(0)
        packed, eager = make(hf.NAME), make("eager")
        eager.load_state_dict(packed.state_dict())
        assert packed.config._attn_implementation == hf.NAME and eager.config._attn_implementation == "eager"
        _made[name] = packed, eager
    return _made[name]


@pytest.fixture
def spy():
    """packattn.attention, wrapped to record its calls: a test cannot pass by running eager."""
    with mock.patch.object(packattn, "attention", wraps=packattn.attention) as wrapped:
        yield wrapped


def _windows(spy):
    """The window of every packattn.attention call so far, in call order; resets the spy."""
    seen = [c.kwargs.get("window") for c in spy.call_args_list]
    spy.reset_mock()
    return seen


def _expected_windows(name, forwards):
    return _configs()[name][2] * forwards


def _checkpointing(model, on: bool, reentrant: bool = False):
    """Gradient (activation) checkpointing of every decoder layer on or off, by this transformers' name."""
    if on:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


SEQS = [[5, 17, 3, 9, 2, 44], [11, 4], [7, 7, 8, 1, 30, 2, 6, 60, 12], [42]]


# ---------------------------------------------------------------------------------- packed training
def _eager_alone(eager, sequences, weights):
    """Logits of each sequence run alone with eager attention; backward of sum(logits * weights)."""
    eager.zero_grad()
    logits = []
    for seq, w in zip(sequences, weights.split([len(s) for s in sequences])):
        out = eager(torch.tensor(seq)[None], use_cache=False).logits[0]
        (out * w).sum().backward()
        logits.append(out.detach())
    return torch.cat(logits)


def _packed_batch(mode, sequences):
    """Model inputs for one packed row of ``sequences``, the way ``mode`` describes the packing."""
    if mode == "descriptor":
        ids = torch.tensor([t for s in sequences for t in s])[None]
        pos = torch.cat([torch.arange(len(s)) for s in sequences])[None]
        seqs = packattn.Varlen.from_lengths([len(s) for s in sequences])
        return dict(input_ids=ids, position_ids=pos, packattn_descriptor=seqs)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=mode == "collator_flash_kwargs")
    batch = collator([{"input_ids": s} for s in sequences])
    batch.pop("labels")
    assert ("cu_seq_lens_q" in batch) == (mode == "collator_flash_kwargs")
    return dict(batch)


@pytest.mark.parametrize("mode,checkpointing", [("collator_position_ids", None), ("collator_flash_kwargs", "plain"),
                                                ("descriptor", "reentrant")])
@pytest.mark.parametrize("name", MODELS)
def test_packed_training(name, mode, checkpointing, spy):
    packed, eager = _pair(name)
    packed.train(), eager.train()
    _checkpointing(packed, checkpointing is not None, reentrant=checkpointing == "reentrant")
    try:
        weights = torch.randn(sum(map(len, SEQS)), COMMON["vocab_size"], generator=torch.Generator().manual_seed(3))
        packed.zero_grad()
        logits = packed(**_packed_batch(mode, SEQS), use_cache=False).logits[0]
        (logits * weights).sum().backward()
    finally:
        _checkpointing(packed, False)
    calls = spy.call_args_list
    assert len(calls) == LAYERS * (1 if checkpointing is None else 2)  # checkpointing runs each layer's forward twice
    assert all(c.args[3].lengths_q == tuple(map(len, SEQS)) for c in calls)
    windows = _expected_windows(name, 1)
    assert _windows(spy) == (windows if checkpointing is None else windows + windows[::-1])  # recomputed in reverse
    want = _eager_alone(eager, SEQS, weights)
    torch.testing.assert_close(logits.detach(), want, atol=ATOL, rtol=0)
    for (param_name, p), q in zip(packed.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), param_name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=param_name)


# ----------------------------------------------------------------------------------------- generate
PROMPTS = [[5, 17, 3, 9, 2, 44, 8], [11, 4], [7, 7, 8, 1, 30]]
NEW_TOKENS = 4


def _generate(model, ids, mask=None, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)  # new tokens (b, n), logits (b, n, vocab)


_references = {}


def _eager_alone_generation(name, prompt):
    """(new tokens, logits) of ``prompt`` generated alone by the eager model, cached per module."""
    if (name, tuple(prompt)) not in _references:
        with torch.no_grad():
            tokens, logits = _generate(_pair(name)[1].eval(), torch.tensor([prompt]))
        _references[name, tuple(prompt)] = tokens[0], logits[0]
    return _references[name, tuple(prompt)]


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", MODELS)
def test_generate_left_padded_batch(name, cache, spy):
    packed, _ = _pair(name)
    packed.eval()
    kwargs = {} if cache == "dynamic" else dict(cache_implementation="static")
    ids, mask = _left_padded(PROMPTS)
    with torch.no_grad():
        tokens, logits = _generate(packed, ids, mask, **kwargs)
    assert _windows(spy) == _expected_windows(name, NEW_TOKENS)  # prefill + NEW_TOKENS - 1 decoding steps
    for row, prompt in enumerate(PROMPTS):
        want_tokens, want_logits = _eager_alone_generation(name, prompt)
        torch.testing.assert_close(logits[row], want_logits, atol=ATOL, rtol=0)
        assert torch.equal(tokens[row], want_tokens)


@pytest.mark.parametrize("name,cache", [("llama", "dynamic"), ("gemma3", "static")])
def test_generate_without_attention_mask(name, cache, spy):
    packed, _ = _pair(name)
    packed.eval()
    kwargs = {} if cache == "dynamic" else dict(cache_implementation="static")
    with torch.no_grad():
        tokens, logits = _generate(packed, torch.tensor([PROMPTS[0]]), **kwargs)
    assert spy.call_count == LAYERS * NEW_TOKENS
    want_tokens, want_logits = _eager_alone_generation(name, PROMPTS[0])
    torch.testing.assert_close(logits[0], want_logits, atol=ATOL, rtol=0)
    assert torch.equal(tokens[0], want_tokens)
