"""`packattn explain` and ``PACKATTN_LOG=dispatch`` say what decided auto's pick: the cost table's row (its
key, the table's device and date, every backend's time) or the priority rule."""

from __future__ import annotations

import logging

import test_costs
from test_costs import call, row

from packattn import cli, costs, dispatch

clean, hopper, use_table = test_costs.clean, test_costs.hopper, test_costs.use_table  # its fixtures, here too


def _explain(capsys, *args):
    code = cli.main(["explain", *args])
    return code, capsys.readouterr().out.splitlines()


W1_CUDA = ("--workload", "W1", "--device", "cuda", "--heads", "16/4")


def test_explain_prints_the_row_that_decided(hopper, use_table, capsys):
    shapes = [{"lengths": "doc_lengths(32768, 0)", "heads": [16, 4], "ms": {"fa4": 2.0, "triton": 1.0}}]
    use_table(row({"fa4": 2.0, "triton": 1.0}, shapes=shapes, refused={"torch_varlen": "not here"}))
    code, lines = _explain(capsys, *W1_CUDA)
    assert code == 0
    assert "picks: triton" in lines
    assert ("decided by: cost table costs_test.json (NVIDIA H100 80GB HBM3, 2026-01-02), row d=128 group 4 long "
            "causal fwd+bwd: triton 1 ms, fa4 2 ms") in lines
    assert "      measured on doc_lengths(32768, 0), heads 16/4: triton 1, fa4 2 ms" in lines
    assert any(ln.startswith("      table: ") and "costs_test.json (NVIDIA H100 80GB HBM3, 2026-01-02; torch 2.11.0, "
               "triton 3.6.0, FA4 4.0.0b36)" in ln for ln in lines), lines
    fa4 = next(ln for ln in lines if ln.split()[:1] == ["fa4"])
    assert fa4.split(None, 1)[1] == "2 ms vs triton 1 ms in the cost table row d=128 group 4 long causal fwd+bwd"


def test_explain_says_when_the_rule_decided(hopper, use_table, capsys):
    use_table(row({"fa4": 2.0, "triton": 1.0}))
    code, lines = _explain(capsys, *W1_CUDA, "--head-dim", "64")
    assert code == 0 and "picks: fa4" in lines
    assert ("decided by: the priority rule (costs_test.json (NVIDIA H100 80GB HBM3, 2026-01-02) has no row for "
            "d=64 group 4 long causal fwd+bwd)") in lines
    code, lines = _explain(capsys, "--workload", "W1", "--device", "cpu")
    assert "decided by: the priority rule (no cost table for cpu)" in lines
    code, lines = _explain(capsys, *W1_CUDA, "--backend", "triton")  # a named backend: nothing is ranked
    assert "picks: triton" in lines and not any(ln.startswith("decided by") for ln in lines)


def test_dispatch_log_names_the_row_or_the_rule(hopper, use_table, monkeypatch, caplog, restore_logger):
    use_table(row({"fa4": 2.0, "triton": 1.0}))
    monkeypatch.setenv("PACKATTN_LOG", "dispatch")
    with caplog.at_level(logging.INFO, logger="packattn.dispatch"):
        dispatch.select(call())
        dispatch.select(call())  # cached: no second line
        dispatch.select(call(head_dim=64, head_dim_v=64))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 2, lines
    assert lines[0].startswith("packattn dispatch: varlen cuda bfloat16 heads 16/4 d=128, causal, grad, longest "
                               ">512 (backend=auto) -> triton (passed over: small_seq: not in this test; fa4: 2 ms vs triton 1 ms")
    assert lines[0].endswith(" [decided by cost table costs_test.json (NVIDIA H100 80GB HBM3, 2026-01-02), row "
                             "d=128 group 4 long causal fwd+bwd: triton 1 ms, fa4 2 ms]")
    assert "-> fa4 (passed over: small_seq: not in this test) [decided by the priority rule (costs_test.json" in lines[1]


def test_explain_with_the_committed_table(hopper, capsys):
    """The committed sm_90 table (filled by `packattn tune` on an H100) decides W1 with GQA 16/4: explain names
    its row, and the pick is that row's fastest backend."""
    table = costs.table("sm90")
    w1 = next(r for r in table.rows if r.key == costs.Key(128, 128, 4, "long", "causal", True))
    best = min(("fa4", "triton"), key=w1.ms.get)  # the backends this test's GPU can run
    code, lines = _explain(capsys, *W1_CUDA)
    assert code == 0 and f"picks: {best}" in lines
    decided = next(ln for ln in lines if ln.startswith("decided by: "))
    assert decided.startswith(f"decided by: cost table costs_sm90.json ({table.meta['device']}, {table.meta['date']}), "
                              "row d=128 group 4 long causal fwd+bwd: "), decided
    assert any(ln.startswith("      table:") for ln in lines)


def test_explain_names_the_key_and_regime(hopper, use_table, capsys):
    """The call's cost-table key with its length regime; a mid call the table has no mid row for is ranked by the
    short row, and the decided-by line says it stands in."""
    use_table(row({"fa4": 1.45, "triton": 1.53}, head_dim=64, group=1, regime="short"))
    mha64 = ("--heads", "32/32", "--head-dim", "64", "--causal", "--device", "cuda")
    code, lines = _explain(capsys, "--lengths", "163x200", *mha64)
    assert code == 0 and "picks: fa4" in lines
    assert "      cost-table key: d=64 group 1 mid causal fwd+bwd (length regime mid: longest 129-256)" in lines
    assert ("decided by: cost table costs_test.json (NVIDIA H100 80GB HBM3, 2026-01-02), row d=64 group 1 short causal "
            "fwd+bwd, standing in for the mid regime (longest 129-256; the table has no mid row here): fa4 1.45 ms, "
            "triton 1.53 ms") in lines
    use_table(row({"fa4": 1.45, "triton": 1.53}, head_dim=64, group=1, regime="short"),
              row({"fa4": 1.8, "triton": 1.5}, head_dim=64, group=1, regime="mid"))
    code, lines = _explain(capsys, "--lengths", "163x200", *mha64)
    assert "picks: triton" in lines
    decided = next(ln for ln in lines if ln.startswith("decided by: "))
    assert "row d=64 group 1 mid causal fwd+bwd: triton 1.5 ms, fa4 1.8 ms" in decided and "standing in" not in decided
    code, lines = _explain(capsys, "--lengths", "85x384", *mha64)
    assert "      cost-table key: d=64 group 1 short causal fwd+bwd (length regime short: longest 257-512)" in lines
    code, lines = _explain(capsys, "--lengths", "4x100", "--kind", "tree", "--device", "cpu")
    assert "      cost-table key: none (tree calls are not in the table)" in lines
