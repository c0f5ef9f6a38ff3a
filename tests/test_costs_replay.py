"""`packattn tune --replay` (`packattn.bench.tune_replay`): a `tune --check` run's own timings replayed against a
cost table on the CPU. Against the table the run ranked by it reproduces every logged pick (table and rule
rows alike), so its answers for another table are what auto would have picked on that run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_costs
from test_costs import META, row, table_data

from packattn import cli, costs
from packattn.bench import tune_check, tune_replay

clean = test_costs.clean  # its fixture, here too
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "2026-11-27"
CHECKS = {fa4: RESULTS / f"s20_check_{fa4}.json" for fa4 in ("fa4", "nofa4")}
TABLE = RESULTS / "s20_costs_sm90_tune_partial_h100.json"  # the table those check runs ranked by


def _by_name(rows):
    return {(r["shape"], r["pass"]): r for r in rows}


def test_shape_names_parse_back_into_the_check_shapes():
    for shape in tune_check.check_grid():
        again = tune_replay.shape_of(shape.name, shape.label)
        assert again == shape, shape.name
    with pytest.raises(ValueError, match="not a tune shape name"):
        tune_replay.shape_of("W1 varlen")


@pytest.mark.parametrize("fa4", ["fa4", "nofa4"])
def test_replaying_a_check_against_its_own_table_reproduces_every_pick(fa4):
    rows = tune_replay.replay(CHECKS[fa4], TABLE)
    assert len(rows) == 46 and not [r for r in rows if r["changed"]]
    assert {r["logged"][1] for r in rows} == {"table", "rule"}  # both kinds of decision reproduced
    window = _by_name(rows)["s384 d128 g4 window", "f+b"]  # the table had no short window row: the rule
    assert window["by"] == "rule" and window["pick"] == ("fa4" if fa4 == "fa4" else "triton")


def test_the_200_token_rows_by_stand_in():
    """Those runs' table predates the mid regime: its short row stands in (the logged pick, FA4 at d = 64 MHA f+b,
    18% behind triton); the tiny row standing in instead (a tiny bound of 256) gives torch_varlen on the forward,
    24% behind (benchmarks/NOTES.md, "Cost table after v35")."""
    rows = _by_name(tune_replay.replay(CHECKS["fa4"], TABLE))
    d64 = rows["s200 d64 g1 causal", "f+b"]
    assert d64["regime"] == "mid" and d64["by"] == "short row" and d64["pick"] == "fa4" and d64["ratio"] == 1.177
    assert d64["row"] == "d=64 group 1 short causal fwd+bwd"
    tiny = _by_name(tune_replay.replay(CHECKS["fa4"], costs.load(TABLE), stand_ins={"mid": "tiny"}))
    assert (tiny["s200 d64 g1 causal", "f+b"]["pick"], tiny["s200 d64 g1 causal", "f+b"]["ratio"]) == ("triton", 1.0)
    assert (tiny["s200 d64 g1 causal", "fwd"]["pick"], tiny["s200 d64 g1 causal", "fwd"]["ratio"]) == \
        ("torch_varlen", 1.243)


def _check(*rows, capability=(9, 0)):
    return {"env": {"capability": list(capability)}, "rows": [
        {"shape": shape, "lengths": label, "pass": kind, "pick": pick, "decided_by": by, "times": times}
        for shape, label, kind, pick, by, times in rows]}


def test_a_mid_row_decides_a_replayed_mid_call(tmp_path, capsys):
    check = _check(("s200 d64 g1 causal", "163x200", "f+b", "fa4", "table", {"fa4": 1.8, "triton": 1.5}),
                   ("s384 d64 g1 causal", "85x384", "f+b", "fa4", "table", {"fa4": 1.4, "triton": 1.5}),
                   ("s200 d128 g1 causal", "163x200", "f+b", "triton", "rule", {"fa4": 2.0, "triton": 1.9}))
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table_data(row({"fa4": 1.45, "triton": 1.53}, head_dim=64, group=1, regime="short"),
                                          row({"fa4": 1.8, "triton": 1.5}, head_dim=64, group=1, regime="mid"))))
    rows = tune_replay.replay(check, path)
    assert [(r["pick"], r["by"], r["ratio"], r["changed"]) for r in rows] == [
        ("triton", "table", 1.0, True), ("fa4", "table", 1.0, False),
        ("triton", "rule", 1.0, False)]  # no d = 128 row: the rule, FA4 deferring to triton (MHA, short, grad)
    assert rows[0]["row"] == "d=64 group 1 mid causal fwd+bwd"
    assert tune_replay.print_replay(rows) == 0
    text = capsys.readouterr().out
    assert "triton (table)" in text and " *" in text
    assert "replayed: within 5% of the fastest backend on 3 of 3 rows; 1 pick(s) changed (*)" in text
    no_defer = tune_replay.replay(_check(*[(r["shape"], "163x200", r["pass"], "fa4", "rule", {"fa4": 2.0, "triton": 1.9})
                                           for r in rows[2:]], capability=(10, 0)), path)
    assert no_defer[0]["pick"] == "fa4"  # not on Blackwell: the deferral is Hopper's


def test_cli_replay(tmp_path, capsys):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table_data(row({"fa4": 1.0, "triton": 2.0}, head_dim=64, group=1, regime="mid"),
                                          meta=META)))
    check = tmp_path / "check.json"
    check.write_text(json.dumps(_check(("s200 d64 g1 causal", "163x200", "f+b", "fa4", "table",
                                        {"fa4": 1.8, "triton": 1.5}))))
    assert cli.main(["tune", "--replay", str(check), "--table", str(path)]) == 1  # FA4 20% behind: a slow row
    out = capsys.readouterr().out
    assert "s200 d64 g1 causal" in out and "1.200  <-- slow" in out
    assert cli.main(["tune", "--replay", str(CHECKS["nofa4"]), "--table", str(TABLE)]) == 0
    assert "within 5% of the fastest backend on 46 of 46 rows; 0 pick(s) changed" in capsys.readouterr().out


def test_files_that_are_not_a_check_run_are_refused_by_name(tmp_path):
    """A cost table, a row missing a field, a row with bad values, no timings at all: ValueError naming the file
    and the problem, before anything is replayed."""
    good = _check(("s200 d64 g1 causal", "163x200", "f+b", "fa4", "table", {"fa4": 1.8, "triton": 1.5}))
    table = tmp_path / "table.json"
    table.write_text(json.dumps(table_data(row({"fa4": 1.0}, head_dim=64, group=1, regime="mid"), meta=META)))
    with pytest.raises(ValueError, match=f"{table}: is a cost table, not a `packattn tune --check --json` run"):
        tune_replay.replay(table, table)
    cases = {
        "not a `packattn tune --check --json` run: needs a top-level 'rows' list": {"env": {}},
        "row 0: lacks pass": {"rows": [{k: v for k, v in good["rows"][0].items() if k != "pass"}]},
        "row 0: lacks shape, pick, decided_by, times": {"rows": [{"pass": "fwd"}]},
        "row 0: not an object": {"rows": [["s200 d64 g1 causal"]]},
        "row 0: pass must be fwd or f\\+b, got 'bwd'": {"rows": [dict(good["rows"][0], **{"pass": "bwd"})]},
        "row 0: shape must be a name": {"rows": [dict(good["rows"][0], shape=3)]},
        "row 0: times must map backends to positive ms": {"rows": [dict(good["rows"][0], times={"fa4": 0})]},
        "none of its 1 rows has timings": {"rows": [dict(good["rows"][0], times={})]},
        "env.capability must be \\[major, minor\\]": dict(good, env={"capability": "sm90"}),
        "row 0: 'W1 varlen' is not a tune shape name": {"rows": [dict(good["rows"][0], shape="W1 varlen")]},
        "row 0: times name no known backend \\(flash2\\)": {"rows": [dict(good["rows"][0], times={"flash2": 1.0})]},
    }
    for number, (problem, data) in enumerate(cases.items()):
        path = tmp_path / f"check{number}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=f"{path}: {problem}"):
            tune_replay.replay(path, table)
    with pytest.raises(ValueError, match="the check run: row 0: lacks pass"):
        tune_replay.replay(cases["row 0: lacks pass"], table)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match=f"{broken}: not a readable JSON file"):
        tune_replay.replay(broken, table)
    with pytest.raises(ValueError, match="missing.json: not a readable JSON file"):
        tune_replay.replay(tmp_path / "missing.json", table)


def test_cli_replay_of_a_wrong_file_is_a_usage_error(tmp_path, capsys):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(table_data(row({"fa4": 1.0}, head_dim=64, group=1, regime="mid"), meta=META)))
    for args in (["--replay", str(table), "--table", str(table)], ["--replay", str(tmp_path / "none.json")]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["tune", *args])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "packattn: error:" in err and "Traceback" not in err
        assert ("is a cost table" in err) if args[-1] == str(table) else ("none.json: not a readable JSON file" in err)
