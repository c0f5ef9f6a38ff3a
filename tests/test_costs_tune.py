"""`packattn tune` on CPU: the grid and the check sweep, the table it writes (rows from measurements, validated,
read back by dispatch), its budget and ``--resume``, the compile-first worker processes, the timing helper it
shares with `packattn bench`, and the CLI. The timings themselves need a GPU (fakes stand in for them here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_costs
import torch
from test_costs import META, call

from packattn import cli, costs, dispatch
from packattn.bench import runner, tune, tune_check
from packattn.bench.workloads import Workload, doc_lengths

clean, hopper = test_costs.clean, test_costs.hopper  # its fixtures, here too


# ------------------------------------------------------------------------------------ the grids
def test_tune_grid_covers_the_head_dims_groups_regimes_and_masks():
    shapes = tune.tune_grid()
    names = [s.name for s in shapes]
    assert len(set(names)) == len(names)
    keys = {s.key(True) for s in shapes}
    assert {(k.head_dim, k.head_dim_v) for k in keys} == {(64, 64), (96, 96), (128, 128), (192, 192), (256, 256),
                                                          (192, 128), (128, 64)}
    assert len(shapes) == 156
    for d, dv in tune.DIMS:  # every head dim: groups 1 and 4, every regime above small, causal and none
        for group in (1, 4):
            for regime in ("long", "short", "mid", "tiny"):
                for mask in ("causal", "none"):
                    assert costs.Key(d, dv, group, regime, mask, True) in keys, (d, dv, group, regime, mask)
    assert {k.head_dim for k in keys if k.mask == "window"} == {64, 128}
    assert {k.head_dim for k in keys if k.group == 8} == {64, 128}
    assert {k.regime for k in keys} == {"long", "short", "mid", "tiny"}
    for s in shapes:
        if s.key(False).regime == "long":
            total = 16384 if max(s.head_dim, s.head_dim_v) >= 192 else 32768
            assert list(s.lengths) == doc_lengths(total, 0) and s.label == f"doc_lengths({total}, 0)"
        else:
            assert set(s.lengths) in ({512}, {320}, {256}, {128}) and 32768 - s.lengths[0] < sum(s.lengths) <= 32768
    labels = {regime: [s.label for s in shapes if s.key(True) == costs.Key(128, 128, 4, regime, "causal", True)]
              for regime in ("short", "mid", "tiny")}
    # documents of each bound, and short's three-tile end
    assert labels == {"short": ["64x512", "102x320"], "mid": ["128x256"], "tiny": ["256x128"]}
    for s in shapes:  # each regime measured at its longest length (short at 320 tokens too)
        if s.key(False).regime != "long":
            assert max(s.lengths) in {"tiny": {128}, "mid": {256}, "short": {512, 320}}[s.key(False).regime]


def test_check_sweep_has_30_rows_on_other_lengths():
    shapes = tune_check.check_grid()
    assert 2 * len(shapes) >= 30 and len({s.name for s in shapes}) == len(shapes)
    tuned = {tuple(s.lengths) for s in tune.tune_grid()}
    assert not [s.name for s in shapes if tuple(s.lengths) in tuned]  # lengths the table never measured
    keys = [s.key(True) for s in shapes]
    assert {(k.head_dim, k.head_dim_v) for k in keys} == set(tune.DIMS)
    assert {k.group for k in keys} == {1, 2, 4, 8} and {k.regime for k in keys} == {"long", "short", "mid", "tiny"}
    names = {s.name for s in shapes}
    assert {"s200 d64 g1 causal", "s200 d128 g8 causal", "s200 d256 g1 causal", "s200 d128v64 g4 none"} <= names
    assert {"s300 d64 g1 causal", "s160 d96 g1 causal"} <= names  # the low ends of short and mid
    assert {k.mask for k in keys} == {"causal", "none", "window"}


# ------------------------------------------------------------------------------------ the table
def _measurement(shape, fwd, fwdbwd, refused=None):
    return tune.record(shape, {"fwd": fwd, "fwdbwd": fwdbwd, "refused": refused or {}})


def test_rows_sum_a_key_over_its_shapes(tmp_path, hopper):
    s512, s384 = tune.make_shape("s512", 128, 128, 4, "causal"), tune.make_shape("s384", 128, 128, 4, "causal")
    s128, long = tune.make_shape("s128", 128, 128, 4, "causal"), tune.make_shape("long", 128, 128, 4, "causal")
    measurements = [
        _measurement(s512, {"fa4": 1.0, "triton": 1.5}, {"fa4": 3.0, "triton": 2.0}),
        _measurement(s384, {"fa4": 1.0, "triton": 0.25, "torch_varlen": 2.0}, {"fa4": 3.0, "triton": 1.5}),
        _measurement(s128, {"fa4": 0.25, "triton": 0.5}, {"fa4": 3.0, "triton": 1.5}),
        _measurement(long, {"fa4": 1.0, "triton": 2.0}, {"fa4": 4.0}, {"triton": "with gradients: test"}),
    ]
    rows = {(r["regime"], r["grad"]): r for r in tune.rows_from(measurements)}
    assert rows["short", False]["ms"] == {"fa4": 2.0, "triton": 1.75}  # torch_varlen: one shape only
    assert rows["short", True]["ms"] == {"fa4": 6.0, "triton": 3.5}
    assert [s["lengths"] for s in rows["short", True]["shapes"]] == ["64x512", s384.label]
    assert rows["tiny", False]["ms"] == {"fa4": 0.25, "triton": 0.5}
    assert rows["long", True]["ms"] == {"fa4": 4.0} and rows["long", True]["refused"] == {"triton": "with gradients: test"}
    path = tmp_path / "costs_sm90.json"
    tune.write_table(path, "sm90", META, measurements, [])
    data = json.loads(path.read_text())
    assert data["meta"]["complete"] is True and data["measurements"] == measurements
    loaded = costs.use(path)  # what tune writes is what dispatch reads
    dispatch.clear_cache()
    assert len(loaded.rows) == 6
    short = {"max_seqlen_q": 129, "max_seqlen_kv": 129}
    assert dispatch.select(call(**short)).name == "triton"
    assert dispatch.select(call(**short, requires_grad=False)).name == "triton"
    assert dispatch.select(call(max_seqlen_q=17, max_seqlen_kv=17, requires_grad=False)).name == "fa4"  # tiny row
    assert dispatch.select(call(requires_grad=False)).name == "fa4"


def test_write_table_refuses_an_invalid_table(tmp_path):
    shape = tune.make_shape("s512", 128, 128, 4, "causal")
    with pytest.raises(ValueError, match="meta device"):
        tune.write_table(tmp_path / "t.json", "sm90", {**META, "device": ""}, [_measurement(shape, {"a": 1.0}, {})], [])
    assert not (tmp_path / "t.json").exists()


@pytest.fixture
def fake_gpu(monkeypatch):
    """run_tune's GPU parts replaced: a clock that advances one second per measured shape, fixed times."""
    clock, lines, measured = [0.0], [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune, "device_meta", lambda command: ("sm90", {**META, "command": command}))
    monkeypatch.setattr(tune, "usable", lambda names, log: list(names))
    monkeypatch.setattr(tune, "compile_first", lambda *a, **k: 0)
    monkeypatch.setattr(tune, "start_clock", lambda: (lambda: clock[0], lines.append))

    def measure(shape, names, device, timing=None):
        clock[0] += 1.0
        measured.append(shape.name)
        return {"fwd": {n: 1.0 + i for i, n in enumerate(names)}, "fwdbwd": {n: 2.0 for n in names}, "refused": {}}

    monkeypatch.setattr(tune, "measure", measure)
    return measured, lines


def test_run_tune_stops_at_its_budget_and_resumes(tmp_path, fake_gpu, monkeypatch):
    measured, lines = fake_gpu
    shapes = tune.tune_grid()[:5]
    monkeypatch.setattr(tune, "tune_grid", lambda: shapes)
    out = tmp_path / "costs.json"
    assert tune.run_tune(out, budget=1.5, names=["triton", "fa4"], command="packattn tune --out x") == 3
    data = json.loads(out.read_text())
    assert measured == [s.name for s in shapes[:2]]
    assert data["meta"]["complete"] is False and data["meta"]["unmeasured"] == [s.name for s in shapes[2:]]
    assert data["meta"]["command"] == "packattn tune --out x"
    assert costs.load(out).rows and any("budget of 2 s spent: 3 shapes left" in ln for ln in lines)
    assert tune.run_tune(out, budget=100, resume=True, names=["triton", "fa4"]) == 0
    assert measured == [s.name for s in shapes]  # the first two were not measured again
    data = json.loads(out.read_text())
    assert data["meta"]["complete"] is True and [m["shape"] for m in data["measurements"]] == measured
    forward = {(r["head_dim"], r["regime"]): r["ms"] for r in data["rows"] if not r["grad"]}
    assert set(forward) == {(s.head_dim, s.key(False).regime) for s in shapes}
    # one shape a row, the short regime's two (512 and 320 tokens) summed
    assert all(ms == ({"fa4": 4.0, "triton": 2.0} if regime == "short" else {"fa4": 2.0, "triton": 1.0})
               for (_, regime), ms in forward.items())
    monkeypatch.setattr(tune, "device_meta", lambda command: ("sm90", {**META, "device": "another GPU"}))
    with pytest.raises(ValueError, match="--resume: .* was measured on 'NVIDIA H100 80GB HBM3', this is 'another"):
        tune.run_tune(out, resume=True)


def test_run_tune_only_filters_the_grid(tmp_path, fake_gpu):
    measured, _ = fake_gpu
    assert tune.run_tune(tmp_path / "c.json", only=r"^long d256 g4") == 0
    assert measured == ["long d256 g4 causal", "long d256 g4 none"]


def test_check_rows_ratio_and_summary(capsys):
    shape = tune.make_shape("s384", 128, 128, 4, "causal")
    times = {"fwd": {"auto": 1.02, "fa4": 1.0, "triton": 1.2}, "fwdbwd": {"auto": 3.3, "fa4": 3.0, "triton": 4.0},
             "refused": {}}
    rows = tune_check.check_rows(shape, times, {False: ("fa4", "table"), True: ("triton", "rule")})
    assert [(r["pass"], r["fastest"], r["ratio"]) for r in rows] == [("fwd", "fa4", 1.02), ("f+b", "fa4", 1.1)]
    assert tune_check.print_rows(rows) == 1
    text = capsys.readouterr().out
    assert "s384 d128 g4 causal" in text and "fa4 (table)" in text and "<-- slow" in text
    assert "auto within 5% of the fastest backend on 1 of 2 rows; worst 1.100 (s384 d128 g4 causal f+b)" in text


# ------------------------------------------------------------------------------------ timing and compiling
def test_tune_times_with_the_bench_helper(monkeypatch):
    assert tune.time_fwd_fwdbwd is runner.time_fwd_fwdbwd
    for path in (Path(tune.__file__), Path(tune_check.__file__)):
        assert "do_bench(" not in path.read_text()  # no timing code of its own
    calls = []

    def do_bench(fn, warmup=250, rep=100):
        calls.append((warmup, rep))
        fn()
        return float(len(calls))

    monkeypatch.setattr(runner, "_do_bench", do_bench)
    seen = []

    def fn(q, k, v):
        seen.append(torch.is_grad_enabled())
        return (q * 2).sum(-1, keepdim=True).expand(*q.shape[:-1], v.shape[-1]) + v.mean() + k.mean()

    q, k, v = (torch.randn(6, 2, 4, requires_grad=True) for _ in range(3))
    assert runner.time_fwd_fwdbwd(fn, q, k, v, warmup=5, rep=7, forward_grad=False) == (1.0, 2.0)
    assert calls == [(5, 7), (5, 7)] and seen == [False, True]  # the forward without autograd, then f+b
    assert runner.time_fwd_fwdbwd(fn, q, k, v, backward=False)[1] is None and seen[-1] is True
    monkeypatch.setattr(runner, "time_fwd_fwdbwd", lambda *a, **k: (1.5, 2.5))
    monkeypatch.setitem(runner.IMPLS, "fake", lambda w, seqs: lambda q, k, v: q)
    row = runner.run_one(Workload("T fake", [8, 4], heads_q=2, heads_kv=2, head_dim=16), "fake", "cpu")
    assert (row["fwd_ms"], row["fwdbwd_ms"]) == (1.5, 2.5)  # the bench times through the same helper


def test_compile_first_runs_every_task_in_worker_processes(monkeypatch):
    """Real spawned workers run each (backend, shape) once on the CPU (the reference backend), and a spent
    budget stops them."""
    shapes = [tune.Shape("tiny causal", 16, 16, 2, 1, (5, 9), "5,9", (("causal", True),)),
              tune.Shape("tiny none", 16, 16, 2, 2, (7,), "7")]
    tasks = tune.warm_tasks(shapes, ["reference", "sdpa"], "cpu")
    assert sorted(t[1] for t in tasks) == ["reference d16 causal small", "reference d16 none small",
                                           "sdpa d16 causal small", "sdpa d16 none small"]
    assert tune._warm(tasks[0])[2] == []  # in this process: no error
    lines = []
    assert tune.compile_first(shapes, ["reference", "sdpa"], 2, 240, lines.append, "cpu") == 4
    assert lines[0] == "compiling first: 4 tasks in 2 processes, at most 240 s"
    assert len([ln for ln in lines if ln.startswith("compiled ")]) == 4
    lines.clear()
    assert tune.compile_first(shapes, ["reference"], 1, 0.001, lines.append, "cpu") == 0
    assert "compile budget spent after 0 of 2 tasks" in lines[-1]
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    assert tune.compile_first(shapes, ["fa4"], 1, 10, lines.append, "cpu") == 0  # no disk cache: not worth it
    assert "set FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1" in lines[-1]


# ------------------------------------------------------------------------------------ the CLI
def test_cli_tune(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        cli.main(["tune"])
    assert info.value.code == 2 and "packattn tune needs --out FILE (or --check" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--out", str(tmp_path / "x.json")]) == 1
    assert cli.main(["tune", "--check"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out
    got = {}
    monkeypatch.setattr(tune, "run_tune", lambda out, **kw: got.update(out=out, **kw) or 0)
    assert cli.main(["tune", "--out", "t.json", "--budget", "100", "--backends", "triton", "--workers", "0"]) == 0
    assert got == {"out": "t.json", "budget": 100.0, "resume": False, "names": ["triton"], "workers": 0,
                   "only": None, "command": "packattn tune --out t.json --budget 100 --backends triton --workers 0"}
    monkeypatch.setattr(tune_check, "run_check", lambda *a: got.update(check=a) or 0)
    assert cli.main(["tune", "--check", "--table", "t.json", "--json", "c.json"]) == 0
    assert got["check"] == ("t.json", None, "c.json", None, 290.0)


def test_run_check_times_auto_against_every_backend(tmp_path, fake_gpu, monkeypatch, capsys):
    """The sweep's driver with the GPU parts replaced: auto measured 3% over the fastest on every row passes (its
    median over the rounds: one round's 50% is an outlier), one row 10% over fails; --table makes dispatch rank
    by that file; --json gets every row."""
    for name in ("device_meta", "usable", "compile_first", "start_clock"):
        monkeypatch.setattr(tune_check, name, getattr(tune, name))
    slow = tune_check.check_grid()[3].name
    calls: dict = {}
    firsts: dict = {}

    def measure(shape, names, device, timing=None):
        assert sorted(names) == ["auto", "fa4", "triton"] and timing == tune_check.TIMING
        firsts.setdefault(shape.name, []).append(names[0])
        calls[shape.name] = calls.get(shape.name, 0) + 1
        auto = 1.1 if shape.name == slow else 1.5 if calls[shape.name] == 2 else 1.03
        return {"fwd": {"auto": auto, "triton": 1.0, "fa4": 1.5}, "fwdbwd": {"auto": 2.06, "triton": 2.0},
                "refused": {}}

    monkeypatch.setattr(tune_check, "measure", measure)
    monkeypatch.setattr(tune_check, "picks_of", lambda shape: {False: ("triton", "table"), True: ("triton", "rule")})
    path = tmp_path / "costs_sm90.json"
    tune.write_table(path, "sm90", META, [], [])
    out = tmp_path / "check.json"
    assert tune_check.run_check(str(path), ["triton", "fa4"], str(out)) == 1
    assert costs.table("sm90").source == str(path)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(tune_check.check_grid()) >= 30
    assert [r["shape"] for r in rows if r["ratio"] > tune_check.TOLERANCE] == [slow]
    assert set(calls.values()) == {tune_check.ROUNDS} and tune_check.ROUNDS >= 3
    assert all(len(set(first)) == 3 for first in firsts.values())  # each backend timed first in one round
    assert f"auto within 5% of the fastest backend on {len(rows) - 1} of {len(rows)} rows" in capsys.readouterr().out
