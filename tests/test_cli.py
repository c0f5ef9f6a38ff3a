"""`packattn info | demo` through `packattn.cli.main`."""

import pytest
import torch

import packattn
from packattn import __version__, cli
from packattn.backends import REGISTRY
from packattn.mask import Mask


def test_info_lists_every_backend(capsys):
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"packattn: {__version__}" in text and "torch:" in text and "device:" in text
    lines = text.splitlines()
    for backend in REGISTRY:
        line = next((ln for ln in lines if ln.split()[:1] == [backend.name]), None)
        assert line is not None, f"{backend.name} missing from:\n{text}"
        why = backend.unavailable()
        assert ("available" if why is None else f"unavailable: {why}") in line
    assert any(ln.split()[:2] == ["reference", "available"] for ln in lines)


def test_demo_small(capsys, monkeypatch):
    # as a user runs it on CPU: without Triton's interpreter (conftest turns it on for the kernel
    # tests; the demo would then time the interpreted kernels, minutes per case)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["demo", "--size", "small"]) == 0
    text = capsys.readouterr().out
    assert "all backends agree with the reference" in text
    assert "MISMATCH" not in text and "error:" not in text
    # a backend that cannot run here is one line with its reason, not a row per case
    lines = text.splitlines()
    for backend in REGISTRY:
        why = backend.unavailable()
        mentions = [ln for ln in lines if backend.name in ln.replace("|", " ").replace("│", " ").split()
                    or ln.strip().startswith(f"{backend.name}:")]
        if why is not None:
            assert mentions == [f"  {backend.name}: {why}"], mentions
        else:
            assert len(mentions) >= 7  # a row per case (6 varlen cases and the tree case)
    assert "fwd+bwd ms (median of 5)" in text and "(median of 5 steps)" in text


def test_demo_times_are_medians(monkeypatch):
    """A row's time is the median of its timed runs (after one warm-up run): one slow run does not set it."""
    from packattn import demo

    now = [0.0]
    durations = iter([5.0, 0.001, 0.002, 0.003, 9.0, 0.004])  # seconds: the warm-up, then five runs

    def step():
        now[0] += next(durations)

    monkeypatch.setattr(demo.time, "perf_counter", lambda: now[0])
    assert demo._time(step, torch.device("cpu"), 5) == pytest.approx(3.0, abs=1e-9)  # ms; the mean would be 1802


def test_bad_command_lines_exit_with_usage():
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--size", "huge"])
    assert info.value.code == 2


def test_bench_cp_needs_torchrun(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["bench", "--cp"]) == 2
    assert "torchrun" in capsys.readouterr().out


def test_cp_accuracy_check_allows_twice_the_single_gpu_error():
    from packattn.bench.cp import GRADS, _accuracy_word, check_against_fp32

    single = {n: 1e-3 for n in GRADS}
    assert check_against_fp32({n: 2e-3 for n in GRADS}, single)
    assert not check_against_fp32(dict({n: 1e-3 for n in GRADS}, dk=2.2e-3), single)
    row = {"accuracy_ok": True, "errors_vs_fp32": dict(single, dq=1.5e-3), "single_errors_vs_fp32": single}
    assert _accuracy_word(row) == "OK (1.50x one GPU)"
    assert _accuracy_word({}) == "unchecked"


def test_cp_row_says_unchecked_when_the_checks_did_not_run():
    from packattn.bench.cp import _format_row

    row = {"impl": "packattn:cp:p2p:zigzag", "fwd_ms": 1.0, "fwd_tflops": 2.0, "fwdbwd_ms": 3.0, "fwdbwd_tflops": 4.0,
           "comm_ms_fwdbwd": 0.5, "exposed_comm_ms_fwdbwd": 0.1, "peak_mem_gib": 1.0}
    line = _format_row(row)  # --no-check: no errors, no determinism run
    assert "max rel err unchecked" in line and "deterministic unchecked" in line and "DIFFERS" not in line
    checked = _format_row(dict(row, errors={"out": 1e-3, "dq": 3e-3}, deterministic_bitwise=False))
    assert "max rel err 3.0e-03" in checked and "deterministic DIFFERS" in checked


def test_exposed_communication_counts_only_uncovered_nccl_time():
    from packattn.bench.cp import exposed_communication

    kernels = [("ncclDevKernel_AllGather", 0.0, 100.0), ("attn_fwd", 50.0, 80.0),
               ("ncclDevKernel_ReduceScatter", 90.0, 200.0), ("attn_bwd", 150.0, 160.0), ("attn_bwd", 300.0, 400.0)]
    comm, exposed = exposed_communication(kernels)
    assert comm == 0.2 and abs(exposed - 0.16) < 1e-12
    assert exposed_communication([("k", 0.0, 5.0)]) == (0.0, 0.0)


def test_profiled_kernels_start_after_the_barrier():
    from packattn.bench.cp import after_first_nccl

    barrier = ("ncclDevKernel_AllReduce_Sum_u8", 10.0, 600.0)  # waited for a peer whose profiler started late
    early = ("warm_kernel", 0.0, 5.0)
    work = [("ncclDevKernel_AllGather", 610.0, 700.0), ("attn_fwd", 650.0, 900.0)]
    assert after_first_nccl([work[1], barrier, early, work[0]]) == [work[1], work[0]]
    assert after_first_nccl([early]) == [early]


def test_cp_scaling_plot(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    paths = []
    for world, eff in ((1, 0.94), (2, 0.99), (4, 0.97)):
        path = tmp_path / f"w{world}.json"
        rows = [{"workload": "W10", "impl": "packattn:cp:allgather:documents", "world": world, "eff_fwdbwd": eff},
                {"workload": "W10", "impl": "packattn:cp:p2p:zigzag", "world": world, "error": "boom"}]
        path.write_text(json.dumps({"env": {"gpu": "test"}, "rows": rows}))
        paths.append(str(path))
    png = tmp_path / "scaling.png"
    assert cli.main(["bench", "--cp-scaling", *paths, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cp_rows_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from packattn.bench.cp import plot_rows

    rows = [{"impl": "packattn:cp:allgather:documents", "eff_fwd": 0.93, "eff_fwdbwd": 0.96},
            {"impl": "packattn:cp:p2p:zigzag", "error": "boom"}]
    png = tmp_path / "cp.png"
    plot_rows(rows, "W10 on 2x test", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from packattn.bench import runner

    rows = [{"workload": "W1", "impl": "packattn:triton", "fwd_tflops": 480.0, "fwdbwd_tflops": 420.0},
            {"workload": "W1", "impl": "torch_varlen", "fwd_tflops": 280.0, "fwdbwd_tflops": 260.0},
            {"workload": "W8", "impl": "torch_varlen", "error": "boom"},
            {"workload": "W9", "impl": "packattn:small_seq", "fwd_TBps": 3.0}]
    png = tmp_path / "bench.png"
    runner.plot(rows, png, {"gpu": "test", "torch": "x", "date": "today"})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib_skip_with_a_message(tmp_path, monkeypatch, capsys):
    import sys

    from packattn.bench.cp import plot_rows

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    plot_rows([{"impl": "packattn:cp:p2p:documents", "eff_fwd": 0.9, "eff_fwdbwd": 0.9}], "t", str(tmp_path / "x.png"))
    assert "matplotlib missing" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


def test_bench_table_shows_the_gpu_state_of_each_row(capsys):
    """Rows carry the SM clock / temperature `_gpu_state` recorded after them (a GPU that heats up
    over a run clocks down); without NVML (CPU here) the state is empty and the row prints without it."""
    from packattn.bench import runner

    assert runner._gpu_state(torch.device("cpu")) == {}
    assert runner._heat_up(torch.device("cpu"), 0) == {}
    rows = [
        {"workload": "W1", "impl": "packattn:triton", "fwd_ms": 1.0, "fwd_tflops": 400.0, "fwdbwd_ms": 3.0,
         "fwdbwd_tflops": 350.0, "sm_mhz": 1755, "temp_c": 61, "power_w": 500},
        {"workload": "W1", "impl": "flex", "fwd_ms": 1.5, "fwd_tflops": 300.0, "fwdbwd_ms": 4.0,
         "fwdbwd_tflops": 250.0},
    ]
    runner.print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    ours = next(line for line in lines if "packattn:triton" in line)
    assert "flex 1.33/1.40" in ours and ours.endswith("[1755 MHz 61 C]")
    assert "MHz" not in next(line for line in lines if line.startswith("W1     flex"))


def test_bench_passes_heat_up_and_pause(monkeypatch):
    from packattn.bench import runner

    seen = {}
    monkeypatch.setattr(runner, "run_bench", lambda *args: seen.setdefault("args", args) and 0)
    assert cli.main(["bench", "--workloads", "W3", "--heat-up", "5", "--pause", "2.5",
                     "--autograd-threads", "off", "--rounds", "3"]) == 0
    assert seen["args"] == (["W3"], None, None, None, False, 5.0, 2.5, 3)


def test_bench_sweep_head_dims_names_every_head_dim_and_mla(monkeypatch):
    """`--sweep head-dims` runs the sweep's workloads after any named ones; each one resolves in the runner's
    table (an unknown name would make it return 2 before timing anything)."""
    from packattn.bench import runner
    from packattn.bench.workloads import head_dim_workloads

    seen = {}
    monkeypatch.setattr(runner, "run_bench", lambda *args: seen.setdefault("args", args) and 0)
    assert cli.main(["bench", "--sweep", "head-dims", "--workloads", "W1"]) == 0
    names = seen["args"][0]
    sweep = head_dim_workloads()
    assert names == ["W1", *sweep]
    assert {sweep[n].head_dim for n in ("D64", "D96", "D128", "D192", "D256")} == {64, 96, 128, 192, 256}
    assert (sweep["MLA"].head_dim, sweep["MLA"].value_dim) == (192, 128)
    assert {(w.heads_q, w.heads_kv) for n, w in sweep.items() if n.startswith("S128")} == {(32, 8)}
    assert sum(sweep["D192"].lengths_q) == 16384 and sum(sweep["D64"].lengths_q) == 32768


def test_mla_workload_inputs_and_flops():
    """A workload with a value head dim of its own makes v of that dim and counts 2 * (d + d_v) FLOPs per
    visible pair and query head; with d_v = d that is the usual 4 * d."""
    import dataclasses

    from packattn.bench.workloads import Workload

    w = Workload("mla", [5, 3], heads_q=4, heads_kv=2, head_dim=24, head_dim_v=8, options={"causal": True})
    seqs, q, k, v = w.make_inputs("cpu", torch.float32)
    assert q.shape == (8, 4, 24) and k.shape == (8, 2, 24) and v.shape == (8, 2, 8)
    pairs = 5 * 6 // 2 + 3 * 4 // 2
    assert w.visible_pairs() == pairs and w.fwd_flops() == 2.0 * (24 + 8) * 4 * pairs
    assert dataclasses.replace(w, head_dim_v=None).fwd_flops() == 4.0 * 24 * 4 * pairs


def test_bench_rounds_merge_to_the_median_of_each_time(capsys):
    """`--rounds N`: each time is the median over the rounds (the lower one for an even count, so a measured
    value), with the rate measured with it; failed rounds are kept apart, a row failing every round stays
    its first error."""
    from packattn.bench import runner

    def sample(fwd, fwdbwd):
        return {"workload": "W1", "impl": "packattn:triton", "fwd_ms": fwd, "fwd_tflops": 1000 / fwd,
                "fwdbwd_ms": fwdbwd, "fwdbwd_tflops": 3500 / fwdbwd}

    rows = [sample(1.0, 3.3), sample(1.2, 3.0), sample(0.9, 3.6)]
    merged = runner.merge_rounds(rows)
    assert (merged["fwd_ms"], merged["fwd_tflops"]) == (1.0, 1000.0)
    assert (merged["fwdbwd_ms"], merged["fwdbwd_tflops"]) == (3.3, 3500 / 3.3)
    assert merged["rounds_ms"] == {"fwd_ms": [1.0, 1.2, 0.9], "fwdbwd_ms": [3.3, 3.0, 3.6]}
    assert runner.merge_rounds([sample(2.0, 5.0), sample(1.0, 4.0)])["fwd_ms"] == 1.0  # lower median
    failed = {"workload": "W1", "impl": "packattn:triton", "error": "OutOfMemoryError: boom"}
    partial = runner.merge_rounds([failed, sample(1.0, 3.0), sample(1.1, 3.1)])
    assert partial["fwd_ms"] == 1.0 and partial["failed_rounds"] == ["OutOfMemoryError: boom"]
    assert runner.merge_rounds([failed, dict(failed, error="other")]) == failed
    assert runner.merge_rounds(rows[:1]) is rows[0]
    runner.print_table([merged], {"rounds": 3})
    out = capsys.readouterr().out
    assert "median of 3 rounds" in out and "spread 30%/18%" in out
    with pytest.raises(ValueError, match="rounds"):
        runner.run_bench(rounds=0)


# ------------------------------------------------------------------------------------ --version, explain
def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"packattn {__version__}"


def _explain(capsys, *args):
    code = cli.main(["explain", *args])
    return code, capsys.readouterr().out


def test_explain_names_the_pick_and_every_other_reason(capsys, monkeypatch):
    """The pick is what `dispatch.select` returns for the same call; every backend has one line."""
    from packattn import dispatch

    monkeypatch.delenv("PACKATTN_BACKEND", raising=False)
    monkeypatch.delenv("PACKATTN_DISABLE", raising=False)
    code, text = _explain(capsys, "--lengths", "300,0,1,1200", "--heads", "8/2", "--head-dim", "64",
                          "--dtype", "float32", "--device", "cpu", "--causal", "--window=128,0", "--lse")
    assert code == 0
    lines = text.splitlines()
    assert lines[0] == ("call: varlen cpu float32 heads 8/2 d=64, causal+window=(128, 0), lse, grad, longest >512, "
                        "backend='auto'")
    assert "4 sequences: 1501 query / 1501 key rows, longest 1200 / 1200" in lines[1]
    seqs = packattn.Varlen.from_lengths([300, 0, 1, 1200])
    params = dispatch.call_params(seqs, device_type="cpu", dtype=torch.float32, heads_q=8, heads_kv=2, head_dim=64,
                                  mask=Mask.make(True, (128, 0)), return_lse=True, requires_grad=True)
    chosen = dispatch.select(params).name
    assert f"picks: {chosen}" in lines
    for name, why in dispatch.reasons(params):
        want = "<- picked" if name == chosen else (why or "could run it (lower priority)")
        assert any(ln.split(None, 1) == [name, want] for ln in lines), (name, want, text)


def test_explain_tree_dense_and_small_seq(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, text = _explain(capsys, "--workload", "W6", "--device", "cpu")
    assert code == 0 and text.startswith("call: tree cpu bfloat16 heads 16/16 d=128, causal, grad, longest >512")
    assert "tree of 16 sequences: 20480 packed rows (49152 expanded), deepest 3072" in text
    assert "picks: reference" in text and "sdpa          tree descriptors need a tree-aware backend" in text
    code, text = _explain(capsys, "--kind", "dense", "--lengths", "4x256", "--device", "cpu", "--no-grad")
    assert code == 0 and "call: dense cpu bfloat16 heads 16/16 d=128, full, longest 129-256" in text
    assert "dense batch 4 x 256 queries x 256 keys" in text
    code, text = _explain(capsys, "--lengths", "1000x1", "--lengths-kv", "1000x16", "--device", "cpu")
    assert code == 0 and ", full, grad, longest 1/16," in text


def test_explain_follows_the_environment_and_says_when_nothing_fits(capsys, monkeypatch):
    monkeypatch.setenv("PACKATTN_DISABLE", "sdpa,reference")
    code, text = _explain(capsys, "--device", "cpu", "--lengths", "5,7")
    assert code == 1 and "picks: nothing (no backend can run this call)" in text
    assert "sdpa          disabled by PACKATTN_DISABLE" in text
    monkeypatch.setenv("PACKATTN_DISABLE", "")
    code, text = _explain(capsys, "--device", "cpu", "--lengths", "5,7", "--backend", "reference")
    assert code == 0 and "picks: reference" in text and "not the requested backend (reference)" in text


@pytest.mark.parametrize("args, message", [
    (["--lengths", "5,x"], "--lengths: 'x' is not a length or NxL"),
    (["--lengths", "5,-2"], "negative"),
    (["--heads", "16/a"], "--heads: '16/a' is not N or N/M"),
    (["--workload", "W99"], "--workload 'W99': known workloads are W1"),
    (["--kind", "dense", "--lengths", "3,4"], "--kind dense takes equal lengths"),
    (["--backend", "fast"], "unknown backend backend='fast'"),
])
def test_explain_bad_descriptions_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        cli.main(["explain", "--device", "cpu", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err
