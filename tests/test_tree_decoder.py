"""A small decoder trained on a tree-packed GRPO batch gets the same per-sequence log-probs,
loss and parameter gradients as the same decoder run on every sequence alone (and on all of
them packed as one plain varlen batch). Reference backend, float32, CPU."""

from __future__ import annotations

import random

import pytest
import torch

from packattn import Tree, Varlen
from packattn.nn import Decoder, DecoderConfig
from packattn.tree import sequence_logprobs

VOCAB = 50
CONFIG = DecoderConfig(vocab_size=VOCAB, dim=32, num_layers=2, heads_q=4, heads_kv=2)


def grpo_batch(seed: int = 0, prompts: int = 2, group: int = 3) -> list[list[int]]:
    """``prompts`` prompts of 11..13 tokens, each with ``group`` responses of 3..9 tokens whose
    first tokens differ (so every response branches off its prompt)."""
    rng = random.Random(seed)
    seqs = []
    for p in range(prompts):
        prompt = [p] + [rng.randrange(VOCAB) for _ in range(rng.randint(10, 12))]  # distinct first tokens
        firsts = rng.sample(range(VOCAB), group)
        for first in firsts:
            seqs.append(prompt + [first] + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))])
    return seqs


def make_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(CONFIG)


def direct_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[j] | tokens[<j]) of one sequence from its own logits, 0 at j = 0."""
    logp = logits[:-1].log_softmax(-1).gather(1, tokens[1:, None]).squeeze(1)
    return torch.cat([logp.new_zeros(1), logp])


def run_tree(model, seqs, weights):
    tree = Tree.from_sequences(seqs)
    logits = model(tree.tokens, tree.position_ids, tree, backend="reference")
    lp = sequence_logprobs(logits, tree)
    return lp, -(lp * weights).sum()


def run_alone(model, seqs, weights):
    lps = []
    for s in seqs:
        tokens = torch.tensor(s)
        logits = model(tokens, torch.arange(len(s)), Varlen.from_lengths([len(s)]), backend="reference")
        lps.append(direct_logprobs(logits, tokens))
    lp = torch.cat(lps)
    return lp, -(lp * weights).sum()


def run_varlen(model, seqs, weights):
    lengths = [len(s) for s in seqs]
    tokens = torch.tensor([t for s in seqs for t in s])
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    logits = model(tokens, position_ids, Varlen.from_lengths(lengths), backend="reference")
    lp = torch.cat([direct_logprobs(lg, tk) for lg, tk in zip(logits.split(lengths), tokens.split(lengths))])
    return lp, -(lp * weights).sum()


def loss_and_grads(run, model, seqs, weights):
    model.zero_grad(set_to_none=True)
    lp, loss = run(model, seqs, weights)
    loss.backward()
    return lp.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("other", [run_alone, run_varlen], ids=["alone", "one_varlen_batch"])
def test_tree_packed_training_step_matches_unpacked(seed, other):
    seqs = grpo_batch(seed)
    model = make_model(seed)
    tree = Tree.from_sequences(seqs)
    assert tree.total < sum(len(s) for s in seqs)  # the prompts really are shared
    weights = torch.randn(sum(len(s) for s in seqs), generator=torch.Generator().manual_seed(seed))

    lp_a, loss_a, grads_a = loss_and_grads(run_tree, model, seqs, weights)
    lp_b, loss_b, grads_b = loss_and_grads(other, model, seqs, weights)

    torch.testing.assert_close(lp_a, lp_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_packing_does_not_leak_across_sequences():
    model = make_model(3)
    rng = random.Random(3)
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (7, 1, 12, 5)]
    lengths = [len(s) for s in seqs]
    tokens = torch.tensor([t for s in seqs for t in s])
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        packed = model(tokens, position_ids, Varlen.from_lengths(lengths), backend="reference").split(lengths)
        for s, got in zip(seqs, packed):
            alone = model(torch.tensor(s), torch.arange(len(s)), Varlen.from_lengths([len(s)]), backend="reference")
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-6)


def test_decoder_shapes_and_config_defaults():
    assert CONFIG.head_dim == 8 and CONFIG.mlp_hidden % 16 == 0 and CONFIG.mlp_hidden >= 2 * CONFIG.dim
    model = make_model(0)
    tokens = torch.tensor([1, 2, 3, 4])
    logits = model(tokens, torch.arange(4), Varlen.from_lengths([4]), backend="reference")
    assert logits.shape == (4, VOCAB) and logits.dtype == torch.float32
    tied = Decoder(DecoderConfig(vocab_size=VOCAB, dim=32, num_layers=1, heads_q=4, heads_kv=1, tie_embeddings=True))
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.num_parameters() == sum(p.numel() for p in tied.parameters())
    with pytest.raises(ValueError, match="multiple"):
        DecoderConfig(vocab_size=VOCAB, dim=32, num_layers=1, heads_q=4, heads_kv=3)
