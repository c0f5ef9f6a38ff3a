"""The README's examples run as written on this (CPU) machine: the Quickstart block, and the
`packattn explain` output it shows."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from packattn import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_quickstart_runs_on_cpu_as_written(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as a user runs it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, also on a GPU machine
    code = re.search(r"```python\n(.*?)```", section("Quickstart"), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md (Quickstart)", "exec"), namespace)
    out, lse, seqs, q, k, v = (namespace[n] for n in ("out", "lse", "seqs", "q", "k", "v"))
    assert out.device.type == "cpu" and out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    # the comment's claim: padding rows of out and of every gradient are exact zeros
    seq_of_row, _ = seqs.row_map_q()
    padding = seq_of_row < 0
    assert padding.any()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.equal(t[padding], torch.zeros_like(t[padding]))
    assert torch.isfinite(out).all() and q.grad.abs().sum() > 0
    assert "attn" in namespace


def test_explain_output_shown_in_the_readme_is_current(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as a user runs it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    block = re.search(r"```\n\$ (packattn explain [^\n]*)\n(.*?)```", section("Backends and dispatch"), re.S)
    command, shown = block.group(1), block.group(2)
    assert cli.main(command.split()[1:]) == 0
    actual = capsys.readouterr().out.splitlines()
    for line in shown.splitlines():
        if line.strip() != "...":
            assert line in actual, (line, actual)
