"""End-to-end training step on a GPU: the reference decoder (`packattn.nn.Decoder`, random init,
bf16 weights, AdamW) on W6 (2 prompts x 2048 tokens, 8 responses x 1024 each), packed as a trie
(20480 rows) and as plain varlen (49152 rows: every response with its own copy of the prompt).
One step = forward, per-sequence log-probs, a GRPO-style loss, backward, optimizer step.
Reports median step times, the speedup of tree packing and the token-ratio bound (49152 / 20480).

usage: python3 benchmarks/e2e_tree_vs_varlen.py [--dim 2048 --layers 12 --heads 16 --vocab 32000 --steps 6]
"""

from __future__ import annotations

import argparse
import time

import torch

from packattn.bench.workloads import grpo_sequences
from packattn.nn import Decoder, DecoderConfig
from packattn.tree import Tree, sequence_logprobs
from packattn.varlen import Varlen


def varlen_logprobs(logits, tokens, seqs: Varlen):
    """log p(token_j | prefix) per row of a packed varlen batch; 0 at every sequence's first token."""
    logp = torch.log_softmax(logits.float(), -1)
    prev = torch.arange(tokens.numel(), device=tokens.device) - 1
    out = logp[prev.clamp(min=0), tokens]
    first = torch.zeros(tokens.numel(), dtype=torch.bool, device=tokens.device)
    first[seqs.cu_seqlens_q[:-1].long()] = True
    return torch.where(first, torch.zeros_like(out), out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--scale", type=int, default=1, help="divide the W6 lengths by this (quick checks)")
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sequences = grpo_sequences(2, 2048 // args.scale, 8, 1024 // args.scale)  # ids < 20480: vocab above that
    tree = Tree.from_sequences(sequences, device=device)
    lengths = [len(s) for s in sequences]
    flat = torch.tensor([t for s in sequences for t in s], device=device)
    seqs = Varlen.from_lengths(lengths, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])
    advantages = torch.randn(len(sequences), device=device)
    adv_tree = torch.repeat_interleave(advantages, torch.tensor(lengths, device=device))

    config = DecoderConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, heads_q=args.heads,
                           heads_kv=args.heads)
    torch.manual_seed(0)
    model = Decoder(config).to(device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    print(f"decoder: {model.num_parameters() / 1e9:.2f}B parameters, {args.layers} layers, dim {args.dim}; "
          f"tokens: tree {tree.total}, varlen {seqs.total_q} (bound {seqs.total_q / tree.total:.2f}x)")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step_tree():
        logits = model(tree.tokens, tree.position_ids, tree)
        loss = -(sequence_logprobs(logits, tree) * adv_tree).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step_varlen():
        logits = model(flat, pos, seqs)
        loss = -(varlen_logprobs(logits, flat, seqs) * adv_tree).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    results = {}
    for name, step in (("tree", step_tree), ("varlen", step_varlen)):
        step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        results[name] = (sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
        print(f"{name:<7} step {results[name][0]:8.1f} ms (median of {args.steps}), peak memory {results[name][1]:.1f} GiB")
    speedup = results["varlen"][0] / results["tree"][0]
    bound = seqs.total_q / tree.total
    print(f"tree packing speedup {speedup:.2f}x; token-ratio bound {bound:.2f}x; {speedup / bound:.2f} of the bound")


if __name__ == "__main__":
    main()
