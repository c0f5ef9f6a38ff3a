"""`packattn demo tree` / ``examples/grpo_tree.py``: one GRPO training step of the reference `Decoder`
on a synthetic batch (``prompts`` prompts with ``group`` responses each, random tokens), packed two
ways from the same initial weights:

* as a trie (`Tree.from_sequences`): every prompt is stored once, log-probs via `sequence_logprobs`;
* as plain varlen (`Varlen.from_lengths`): every sequence in full, log-probs by a direct log-softmax.

The loss is GRPO-like: ``-mean_i A_i * mean_{t in response i} log p(t)`` with a random advantage
``A_i`` per sequence. It reports tokens, peak memory (CUDA), step time (the median of ``repeats``
steps after one warm-up step, the two ways interleaved), and the largest relative difference between
the two ways of the log-probs, the loss and every parameter gradient.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from packattn.nn.decoder import Decoder, DecoderConfig
from packattn.tree import Tree, sequence_logprobs
from packattn.varlen import Varlen

TOLERANCE = 1e-5  # relative, checked for float32 / float64
# preset sizes: batch shape and model shape
SIZES = {
    "small": dict(prompts=2, group=4, prompt_len=48, response_len=16, vocab=128, dim=64, layers=2, heads_q=4,
                  heads_kv=2),
    "large": dict(prompts=4, group=8, prompt_len=2048, response_len=512, vocab=4096, dim=512, layers=4, heads_q=8,
                  heads_kv=2),
}


@dataclass
class Batch:
    sequences: list[list[int]]  # prompt + response token ids, prompts' responses adjacent
    prompt_lengths: list[int]  # per sequence
    advantages: torch.Tensor  # float32 (num_sequences,)

    def token_weights(self, device) -> torch.Tensor:
        """Per token of the unpacked layout: ``A_i / (|response_i| * num_sequences)`` on response tokens, else 0."""
        rows = []
        for seq, n_prompt, adv in zip(self.sequences, self.prompt_lengths, self.advantages.tolist()):
            n_resp = len(seq) - n_prompt
            rows.append(torch.cat([torch.zeros(n_prompt), torch.full((n_resp,), adv / (n_resp * len(self.sequences)))]))
        return torch.cat(rows).to(device)


def make_batch(prompts: int, group: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> Batch:
    """``prompts`` random prompts of ``prompt_len`` tokens, each followed by ``group`` random responses
    of 1 .. ``response_len`` tokens."""
    rng = random.Random(seed)
    sequences, prompt_lengths = [], []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for _ in range(group):
            sequences.append(prompt + [rng.randrange(vocab) for _ in range(rng.randint(1, response_len))])
            prompt_lengths.append(prompt_len)
    advantages = torch.randn(len(sequences), generator=torch.Generator().manual_seed(seed))
    return Batch(sequences, prompt_lengths, advantages)


@dataclass
class StepResult:
    tokens: int  # rows the model ran on
    logprobs: torch.Tensor  # per token, unpacked layout
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    ms: float  # packing + forward + loss + backward (`run`: the median over its timed steps)
    peak_bytes: int | None  # CUDA peak allocated above the start of the step, None elsewhere


def _tree_forward(model, batch: Batch, device, backend: str):
    tree = Tree.from_sequences(batch.sequences, device=device)
    logits = model(tree.tokens, tree.position_ids, tree, backend=backend)
    return tree.total, sequence_logprobs(logits, tree)


def _varlen_forward(model, batch: Batch, device, backend: str):
    lengths = [len(s) for s in batch.sequences]
    seqs = Varlen.from_lengths(lengths, device=device)
    tokens = torch.tensor([t for s in batch.sequences for t in s], device=device)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).to(device)
    logits = model(tokens, position_ids, seqs, backend=backend)
    # log p(token j | tokens < j) at unpacked row j: logits of row j - 1; 0 at each sequence's first token
    prev = (torch.arange(tokens.numel(), device=device) - 1).clamp_min(0)
    logp = logits[prev, tokens].float() - torch.logsumexp(logits.float(), -1)[prev]
    first = torch.zeros_like(tokens, dtype=torch.bool)
    first[seqs.cu_seqlens_q[:-1].long()] = True
    return tokens.numel(), torch.where(first, logp.new_zeros(()), logp)


def train_step(model, batch: Batch, forward, backend: str = "auto") -> StepResult:
    """One step (no optimizer update): pack, forward, GRPO loss, backward."""
    device = next(model.parameters()).device
    weights = batch.token_weights(device)
    model.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    tokens, logprobs = forward(model, batch, device, backend)
    loss = -(logprobs * weights).sum()
    loss.backward()
    if cuda:
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return StepResult(tokens, logprobs.detach(), loss.detach(), grads, ms, peak)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    return err / scale if scale > 0 else err


@dataclass
class Report:
    sequences: int
    tree: StepResult
    varlen: StepResult
    diff_logprobs: float
    diff_loss: float
    diff_grads: float  # worst parameter
    checked: bool  # the dtype is float32 / float64, so the differences are held to TOLERANCE
    timed_steps: int = 1  # steps each step time is the median of

    @property
    def ok(self) -> bool:
        return not self.checked or max(self.diff_logprobs, self.diff_loss, self.diff_grads) <= TOLERANCE


def run(prompts=2, group=4, prompt_len=48, response_len=16, vocab=128, dim=64, layers=2, heads_q=4, heads_kv=2,
        device=None, dtype=torch.float32, backend="auto", seed=0, repeats=5) -> Report:
    """Build the batch and the model, run one warm-up step both ways, then ``repeats`` timed steps each (tree
    and varlen interleaved), and compare the last ones. Step times are the medians of the timed steps."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch = make_batch(prompts, group, prompt_len, response_len, vocab, seed)
    torch.manual_seed(seed)
    config = DecoderConfig(vocab_size=vocab, dim=dim, num_layers=layers, heads_q=heads_q, heads_kv=heads_kv)
    model_tree = Decoder(config).to(device=device, dtype=dtype)
    model_varlen = Decoder(config).to(device=device, dtype=dtype)
    model_varlen.load_state_dict(model_tree.state_dict())  # same initial weights, separate gradients
    train_step(model_tree, batch, _tree_forward, backend)  # warm-up: first-use costs out of the times
    train_step(model_varlen, batch, _varlen_forward, backend)
    tree_ms, varlen_ms = [], []
    for _ in range(max(1, repeats)):
        tree = train_step(model_tree, batch, _tree_forward, backend)
        varlen = train_step(model_varlen, batch, _varlen_forward, backend)
        tree_ms.append(tree.ms)
        varlen_ms.append(varlen.ms)
    tree.ms, varlen.ms = statistics.median(tree_ms), statistics.median(varlen_ms)
    diff_grads = max(relative_difference(tree.grads[n], varlen.grads[n]) for n in tree.grads)
    return Report(len(batch.sequences), tree, varlen, relative_difference(tree.logprobs, varlen.logprobs),
                  relative_difference(tree.loss, varlen.loss), diff_grads, dtype in (torch.float32, torch.float64),
                  len(tree_ms))


def format_report(r: Report, device, dtype) -> str:
    def mem(b):
        return "n/a" if b is None else f"{b / 2**20:.1f} MiB"

    t, v = r.tree, r.varlen
    lines = [
        f"GRPO step on {device}, {str(dtype).replace('torch.', '')}: {r.sequences} sequences",
        f"  {'':<8} {'tokens':>9} {'peak memory':>13} {'step ms':>9}  (median of {r.timed_steps} steps)",
        f"  {'tree':<8} {t.tokens:>9} {mem(t.peak_bytes):>13} {t.ms:>9.2f}",
        f"  {'varlen':<8} {v.tokens:>9} {mem(v.peak_bytes):>13} {v.ms:>9.2f}",
        f"  the tree runs {v.tokens / t.tokens:.2f}x fewer tokens",
        f"  max relative difference, tree vs varlen: log-probs {r.diff_logprobs:.2e}, loss {r.diff_loss:.2e}, "
        f"parameter gradients {r.diff_grads:.2e}",
    ]
    if r.checked:
        lines.append(f"  {'OK' if r.ok else 'FAILED'}: differences {'<=' if r.ok else 'exceed'} {TOLERANCE:g}")
    else:
        lines.append(f"  (differences are not checked in {str(dtype).replace('torch.', '')}; use float32)")
    return "\n".join(lines)


def run_demo_tree(size: str = "auto", seed: int = 0, **overrides) -> int:
    """Run with preset sizes (``auto``: large on a GPU, small on CPU); print the report; 0 if it passed."""
    device = torch.device(overrides.pop("device", None) or ("cuda" if torch.cuda.is_available() else "cpu"))
    if size == "auto":
        size = "large" if device.type == "cuda" else "small"
    options = {**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}
    dtype = options.get("dtype", torch.float32)
    report = run(device=device, seed=seed, **options)
    print(format_report(report, device, dtype))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="grpo_tree.py")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--size", choices=("auto", "small", "large"), default="auto",
                        help="preset sizes (auto: large on a GPU); the options below override them")
    for name in ("prompts", "group", "prompt-len", "response-len", "vocab", "dim", "layers", "heads-q", "heads-kv"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--repeats", type=int, help="timed steps each way, after one warm-up step (default 5)")
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default="float32")
    parser.add_argument("--backend", default="auto", help="packattn backend for both ways (default: auto)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    overrides = {name: getattr(args, name) for name in ("prompts", "group", "prompt_len", "response_len", "vocab",
                                                       "dim", "layers", "heads_q", "heads_kv", "repeats")}
    return run_demo_tree(args.size, args.seed, device=args.device, dtype=getattr(torch, args.dtype),
                         backend=args.backend, **overrides)
