"""`packattn.demo_tree` (``packattn demo tree``, ``examples/grpo_tree.py``) at tiny sizes on CPU: the
tree-packed GRPO step runs fewer tokens and matches the varlen step to 1e-5."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

from packattn import cli, demo_tree

TINY = dict(prompts=2, group=3, prompt_len=12, response_len=6, vocab=32, dim=32, layers=2, heads_q=4, heads_kv=2,
            device="cpu", backend="reference", repeats=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_step_matches_varlen_with_fewer_tokens(seed):
    report = demo_tree.run(seed=seed, **TINY)
    assert report.sequences == 6
    assert report.tree.tokens < report.varlen.tokens
    assert report.varlen.tokens == sum(len(s) for s in demo_tree.make_batch(2, 3, 12, 6, 32, seed).sequences)
    assert report.checked and report.ok
    assert max(report.diff_logprobs, report.diff_loss, report.diff_grads) <= 1e-5
    assert report.tree.peak_bytes is None and report.varlen.peak_bytes is None  # n/a off CUDA
    assert report.tree.loss.abs() > 0 and report.tree.grads.keys() == report.varlen.grads.keys()


def test_step_times_are_medians_of_the_timed_steps(monkeypatch):
    """After one warm-up step each way, ``repeats`` timed steps (tree and varlen interleaved): each reported
    time is their median, so one slow step does not make the tree read slower than varlen."""
    real = demo_tree.train_step
    times = iter([900.0, 900.0, 1.0, 10.0, 2.0, 20.0, 3.0, 30.0, 500.0, 40.0, 4.0, 50.0])

    def timed(*args, **kwargs):
        result = real(*args, **kwargs)
        result.ms = next(times)
        return result

    monkeypatch.setattr(demo_tree, "train_step", timed)
    report = demo_tree.run(seed=0, **dict(TINY, repeats=5))
    assert (report.tree.ms, report.varlen.ms, report.timed_steps) == (3.0, 30.0, 5)
    assert report.ok
    assert "(median of 5 steps)" in demo_tree.format_report(report, "cpu", torch.float32)


def test_batch_and_weights():
    batch = demo_tree.make_batch(prompts=2, group=4, prompt_len=5, response_len=3, vocab=10, seed=0)
    assert len(batch.sequences) == 8 and batch.advantages.shape == (8,)
    assert all(s[:5] == batch.sequences[4 * (i // 4)][:5] for i, s in enumerate(batch.sequences))
    w = batch.token_weights("cpu")
    assert w.numel() == sum(map(len, batch.sequences))
    per_seq = torch.stack([x.sum() for x in w.split([len(s) for s in batch.sequences])])
    torch.testing.assert_close(per_seq, batch.advantages / 8)  # mean over response tokens, mean over sequences
    assert demo_tree.relative_difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 0


def test_a_failed_comparison_exits_with_1(monkeypatch, capsys):
    monkeypatch.setattr(demo_tree, "TOLERANCE", -1.0)
    assert demo_tree.main(["--prompts", "1", "--group", "2", "--prompt-len", "4", "--response-len", "2",
                           "--dim", "16", "--layers", "1", "--repeats", "1", "--device", "cpu"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_cli_demo_tree(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as a user runs it
    assert cli.main(["demo", "tree", "--size", "small"]) == 0
    text = capsys.readouterr().out
    assert "GRPO step on cpu" in text and "fewer tokens" in text and "OK: differences <= 1e-05" in text
    assert "agree with the reference" not in text  # only the tree step ran, not the backends demo
    with pytest.raises(SystemExit):
        cli.main(["demo", "forest"])


def test_example_script(monkeypatch, capsys):
    script = Path(__file__).resolve().parents[1] / "examples" / "grpo_tree.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--prompts", "1", "--group", "2",
                                      "--prompt-len", "6", "--response-len", "3", "--layers", "1", "--repeats", "1"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    assert "OK: differences" in capsys.readouterr().out
