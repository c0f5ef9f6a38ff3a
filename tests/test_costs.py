"""The measured-cost table (`packattn.costs`) and auto dispatch by it, on CPU: a fake table on a fake Hopper
GPU with FA4 and the triton backend available drives the pick; the committed tables load and validate."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from packattn import costs, dispatch, explain, lengths
from packattn.mask import Mask
from packattn.ops.runtime import support

DATA = Path(costs.__file__).parent / "data"
META = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "fa4": "4.0.0b36",
        "packattn": "0.1.0", "date": "2026-01-02", "command": "packattn tune --out x.json", "dtype": "bfloat16"}


def row(ms, head_dim=128, head_dim_v=None, group=4, regime="long", mask="causal", grad=True, **extra):
    return {"head_dim": head_dim, "head_dim_v": head_dim_v or head_dim, "group": group, "regime": regime,
            "mask": mask, "grad": grad, "ms": ms, **extra}


def table_data(*rows, meta=None, arch="sm90"):
    return {"schema": 1, "arch": arch, "meta": dict(META if meta is None else meta), "rows": list(rows)}


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("PACKATTN_BACKEND", "PACKATTN_DISABLE", "PACKATTN_LOG", "PACKATTN_PORTABLE"):
        monkeypatch.delenv(name, raising=False)
    costs.use(None)
    dispatch.clear_cache()
    yield
    costs.use(None)
    dispatch.clear_cache()


@pytest.fixture
def use_table(tmp_path):
    """``use_table(*rows)``: dispatch ranks by a table file of these rows (returns the `costs.Table`)."""
    def use(*rows, meta=None):
        path = tmp_path / "costs_test.json"
        path.write_text(json.dumps(table_data(*rows, meta=meta)))
        loaded = costs.use(path)
        dispatch.clear_cache()
        return loaded

    return use


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of sm_90 where FA4 and the triton backend can run (small_seq off); the table of sm90 is
    looked up for CUDA calls."""
    from packattn.backends import get, triton_varlen

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(support, "interpreting", lambda: False)
    monkeypatch.setattr(support, "installed_gluon_unsupported", lambda: None)
    monkeypatch.setattr(type(get("fa4")), "unavailable", lambda self: None)
    monkeypatch.setattr(type(get("triton")), "unavailable", lambda self: None)
    monkeypatch.setattr(type(get("small_seq")), "unavailable", lambda self: "not in this test")
    monkeypatch.setattr(triton_varlen, "device_unsupported", lambda device_type: None)
    monkeypatch.setattr(costs, "device_arch", lambda params: "sm90" if params.device_type == "cuda" else None)


def call(**overrides):
    """A CUDA bf16 call: W1-like (long, causal, GQA 16/4, d = 128) with gradients."""
    base = {"device_type": "cuda", "dtype": torch.bfloat16, "heads_q": 16, "heads_kv": 4, "head_dim": 128,
            "head_dim_v": 128, "kind": "varlen", "pad_between_seqs": False, "is_self": True, "host_lengths": True,
            "max_seqlen_q": 513, "max_seqlen_kv": 513, "mask": Mask.make(causal=True), "return_lse": False,
            "deterministic": False, "requires_grad": True}
    return dispatch.Params(**{**base, **overrides})


# ------------------------------------------------------------------------------------ the committed tables
def test_committed_tables_load_validate_and_ship():
    files = sorted(DATA.glob("costs_*.json"))
    assert "costs_sm90.json" in [f.name for f in files]  # H100 / H200
    for path in files:
        loaded = costs.load(path)
        assert loaded.arch == path.stem.removeprefix("costs_")
        assert set(costs.META_KEYS) <= set(loaded.meta) and loaded.meta["dtype"] == "bfloat16"
        if loaded.rows:  # a measured table names its device, versions, date and command
            assert all(loaded.meta[k] for k in ("device", "torch", "triton", "packattn", "date", "command"))
            assert "tune" in loaded.meta["command"]
    assert costs.packaged_path("sm90").is_file() and costs.table("sm90") is not None
    assert costs.table("sm100") is None  # no table: the rule decides on that GPU
    pyproject = (DATA.parent.parent / "pyproject.toml").read_text()
    assert '"data/*.json"' in pyproject  # in the wheel and the sdist


def test_empty_table_is_the_priority_rule(hopper, use_table):
    """No rows: exactly the rule (FA4 leads, but gives short MHA batches with gradients at d = 128 to triton)."""
    use_table()
    long_gqa = call()
    short_mha = call(heads_kv=16, max_seqlen_q=17, max_seqlen_kv=17)
    assert dispatch.select(long_gqa).name == "fa4"
    assert dispatch.select(short_mha).name == "triton"
    assert "short sequences" in dict(dispatch.reasons(short_mha))["fa4"]
    _, decision = dispatch.decide(long_gqa)
    assert decision.choice is None and "has no row for d=128 group 4 long causal fwd+bwd" in decision.why


# ------------------------------------------------------------------------------------ selection by the table
def test_the_faster_measured_backend_wins(hopper, use_table):
    use_table(row({"fa4": 2.0, "triton": 1.0, "torch_varlen": 3.0}))
    assert dispatch.select(call()).name == "triton"  # though FA4 comes first in priority order
    reasons = dict(dispatch.reasons(call()))
    assert reasons["fa4"] == "2 ms vs triton 1 ms in the cost table row d=128 group 4 long causal fwd+bwd"
    assert reasons["triton"] is None
    assert "not measured" in reasons["sdpa"] and "not measured" in reasons["reference"]
    use_table(row({"fa4": 0.9, "triton": 1.0}))
    assert dispatch.select(call()).name == "fa4"
    assert dispatch.select(call(), "triton").name == "triton"  # a named backend is not ranked


def test_the_table_replaces_the_fa4_deferral_where_it_covers_the_call(hopper, use_table):
    """The short MHA batch with gradients at d = 128, which the rule gives to triton, goes to FA4 where the
    table measured FA4 faster (and to triton where it measured triton faster)."""
    short_mha = call(heads_kv=16, max_seqlen_q=129, max_seqlen_kv=129)
    use_table(row({"fa4": 1.0, "triton": 1.2}, group=1, regime="short"))
    assert dispatch.select(short_mha).name == "fa4"
    use_table(row({"fa4": 1.3, "triton": 1.2}, group=1, regime="short"))
    assert dispatch.select(short_mha).name == "triton"
    assert "1.3 ms vs triton 1.2 ms" in dict(dispatch.reasons(short_mha))["fa4"]


def test_disabled_unsupported_and_absent_backends_are_skipped(hopper, use_table, monkeypatch):
    from packattn.backends import get

    use_table(row({"fa4": 1.0, "triton": 2.0, "sdpa": 3.0}))
    assert dispatch.select(call()).name == "fa4"
    monkeypatch.setenv("PACKATTN_DISABLE", "fa4")
    assert dispatch.select(call()).name == "triton"
    assert dict(dispatch.reasons(call()))["fa4"] == "disabled by PACKATTN_DISABLE"
    monkeypatch.setenv("PACKATTN_DISABLE", "fa4,triton")
    assert dispatch.select(call()).name == "sdpa"  # the next fastest measured, not the next by priority
    monkeypatch.delenv("PACKATTN_DISABLE")
    deterministic = call(deterministic=True)  # FA4 does not take it: the fastest of the others
    assert "deterministic" in dict(dispatch.reasons(deterministic))["fa4"]
    assert dispatch.select(deterministic).name == "triton"
    monkeypatch.setattr(type(get("fa4")), "unavailable", lambda self: "flash_attn.cute is not importable")
    dispatch.clear_cache()
    assert dispatch.select(call()).name == "triton"  # FA4 not installed: the table's next fastest


def test_a_row_that_measured_no_capable_backend_leaves_the_rule(hopper, use_table):
    use_table(row({"flex": 0.5}))  # flex needs a real CUDA device: it cannot run here
    _, decision = dispatch.decide(call())
    assert decision.choice is None and "measured none of fa4, triton" in decision.why
    assert dispatch.select(call()).name == "fa4"


@pytest.mark.parametrize("overrides, why", [
    ({"head_dim": 80, "head_dim_v": 80}, "has no row for d=80"),
    ({"head_dim_v": 64}, "has no row for d=128/64"),
    ({"requires_grad": False}, "has no row for d=128 group 4 long causal fwd"),
    ({"max_seqlen_q": 17, "max_seqlen_kv": 17}, "no row for d=128 group 4 tiny"),
    ({"max_seqlen_q": 257, "max_seqlen_kv": 257}, "no row for d=128 group 4 short"),
    ({"max_seqlen_q": 129, "max_seqlen_kv": 129}, "no row for d=128 group 4 mid causal fwd+bwd (nor a short row"),
    ({"mask": Mask.make(causal=True, window=(64, 0))}, "no row for d=128 group 4 long window"),
    ({"mask": Mask.make(causal="top_left"), "is_self": False}, "long causal_top_left"),
    ({"dtype": torch.float32}, "measured in bf16"),
    ({"kind": "tree"}, "tree calls are not in the table"),
    ({"device_type": "cpu"}, "no cost table for cpu"),
])
def test_calls_no_row_covers_fall_back_to_the_rule(hopper, use_table, overrides, why):
    use_table(row({"triton": 1.0, "fa4": 2.0}))
    params = call(**overrides)
    listing, decision = dispatch.decide(params)
    assert decision.choice is None and why in decision.why, decision.why
    assert decision.describe().startswith("the priority rule (")
    chosen = next(name for name, reason in listing if reason is None)
    assert dispatch.select(params).name == chosen
    use_table()  # an empty table: the same pick, the same reasons
    assert dispatch.select(params).name == chosen and dispatch.reasons(params) == listing


def test_fp16_and_dense_calls_are_covered(hopper, use_table):
    use_table(row({"fa4": 2.0, "triton": 1.0}))
    assert dispatch.select(call(dtype=torch.float16)).name == "triton"
    assert dispatch.select(call(kind="dense")).name == "triton"


def test_the_nearest_measured_group_covers_a_call(hopper, use_table):
    use_table(row({"fa4": 1.0, "triton": 2.0}, group=1), row({"fa4": 2.0, "triton": 1.0}, group=4))
    picks = {hq // hkv: dispatch.select(call(heads_q=hq, heads_kv=hkv)).name
             for hq, hkv in ((16, 16), (16, 8), (12, 4), (16, 4), (32, 4), (64, 2))}
    # group 2 is as far from 1 as from 4 (log scale): the smaller; 3, 8 and 32 are nearest to 4
    assert picks == {1: "fa4", 2: "fa4", 3: "triton", 4: "triton", 8: "triton", 32: "triton"}
    found, covering, _ = costs.lookup(call(heads_q=16, heads_kv=2))
    assert covering.key.group == 4 and found.describe() == "costs_test.json (NVIDIA H100 80GB HBM3, 2026-01-02)"


def test_ties_keep_the_priority_order(hopper, use_table):
    use_table(row({"triton": 1.0, "fa4": 1.0}))
    assert dispatch.select(call()).name == "fa4"


def test_a_cached_decision_does_not_read_the_table_again(hopper, use_table, monkeypatch):
    use_table(row({"fa4": 2.0, "triton": 1.0}))
    assert dispatch.select(call()).name == "triton"
    monkeypatch.setattr(costs, "decide", lambda *a: pytest.fail("the table was read on a cache hit"))
    assert dispatch.select(call()).name == "triton"


def test_compiled_calls_rank_by_the_long_rows(hopper, use_table):
    """Under torch.compile dispatch decides outside the trace on `Params.traced_buckets` (the long regime, FA4
    not traceable): the table's long row ranks the rest."""
    use_table(row({"fa4": 0.5, "triton": 1.0, "sdpa": 3.0}), row({"triton": 9.0, "sdpa": 1.0}, regime="short"))
    max_q, max_kv = dispatch.Params.traced_buckets(300, 300)
    traced = call(max_seqlen_q=max_q, max_seqlen_kv=max_kv, traced=True)
    assert costs.regime(max_q, max_kv) == "long"
    assert dispatch._select_outside_trace(*dispatch._constant_key(traced), requested="auto") == "triton"


def test_the_length_views_agree_at_every_boundary():
    """One table of regime bounds (`lengths.REGIME_BOUNDS`): the cost table's regime (`costs.regime`), its range
    (`costs.REGIME_LENGTHS`), dispatch's bucket (`Params.bucket`) and the range ``describe`` prints agree on
    each side of every boundary, and each range holds the lengths it names."""
    assert [bound for _, bound in lengths.REGIME_BOUNDS] == [16, lengths.TINY_SEQLEN, lengths.MID_SEQLEN,
                                                             lengths.SHORT_SEQLEN, None]
    assert costs.REGIMES == ("small", "tiny", "mid", "short", "long")
    for n in (16, 17, 128, 129, 256, 257, 512, 513):
        name, bucketed = costs.regime(n, n), dispatch.Params.bucket(n)
        assert costs.regime(bucketed, bucketed) == name == lengths.regime(n), n
        assert dispatch.Params.bucket(bucketed) == bucketed, n
        params = call(max_seqlen_q=bucketed, max_seqlen_kv=bucketed)
        shown = dispatch.describe(params).rsplit("longest ", 1)[1]
        assert shown == (str(n) if name == "small" else costs.REGIME_LENGTHS[name]), n
        assert explain._key_line(params).endswith(f"(length regime {name}: longest {costs.REGIME_LENGTHS[name]})")
        text = costs.REGIME_LENGTHS[name]
        low, high = ((0, int(text[2:])) if text.startswith("<=") else (int(text[1:]) + 1, None) if text[0] == ">"
                     else tuple(map(int, text.split("-"))))
        assert low <= n and (high is None or n <= high) and (bucketed == n if name == "small" else bucketed == low)


def test_regimes_and_mask_kinds():
    bucket = dispatch.Params.bucket
    lengths = (1, 16, 17, 128, 129, 200, 256, 257, 384, 512, 513, 10**6)
    assert [costs.regime(bucket(n), bucket(n)) for n in lengths] == \
        ["small", "small", "tiny", "tiny", "mid", "mid", "mid", "short", "short", "short", "long", "long"]
    assert [costs.regime(n, n) for n in lengths] == [costs.regime(bucket(n), bucket(n)) for n in lengths]
    assert costs.regime(bucket(1), bucket(600)) == "long"  # the longer of queries and keys
    assert costs.regime(bucket(300), bucket(200)) == "short"
    assert list(costs.REGIME_LENGTHS) == list(costs.REGIMES)
    assert [costs.REGIME_LENGTHS[r] for r in costs.REGIMES] == ["<=16", "17-128", "129-256", "257-512", ">512"]
    kinds = [costs.mask_kind(Mask.make(**o), s) for o, s in (
        ({"causal": True}, False), ({"causal": "top_left"}, True), ({"causal": "top_left"}, False), ({}, True),
        ({"window": (8, 8)}, True), ({"causal": True, "window": (8, 0)}, True), ({"chunk_size": 4}, True),
        ({"chunk_size": 4, "window": (2, 0), "causal": True}, True))]
    assert kinds == ["causal", "causal", "causal_top_left", "none", "window", "window", "chunk", "chunk"]


# ------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(schema=2), "not a schema 1 cost table"),
    (lambda d: d.update(arch="hopper"), "arch 'hopper'"),
    (lambda d: d["meta"].pop("device"), "meta lacks device"),
    (lambda d: d["meta"].pop("fa4"), "meta lacks fa4"),
    (lambda d: d["meta"].update(torch=""), "meta torch must name"),
    (lambda d: d["meta"].update(date=None), "meta date must name"),
    (lambda d: d["meta"].update(fa4=4), "meta fa4 is the FlashAttention-4 version or null"),
    (lambda d: d["rows"].append(copy.deepcopy(d["rows"][0])), "appears twice"),
    (lambda d: d["rows"][0].update(regime="medium"), "regime 'medium'"),
    (lambda d: d["rows"][0].update(mask="sliding"), "mask 'sliding'"),
    (lambda d: d["rows"][0].update(group=0), "group must be a positive int"),
    (lambda d: d["rows"][0].update(head_dim=True), "head_dim must be a positive int"),
    (lambda d: d["rows"][0].update(grad="yes"), "grad must be true or false"),
    (lambda d: d["rows"][0].update(ms={}), "ms must map at least one backend"),
    (lambda d: d["rows"][0].update(ms={"triton": -1.0}), "ms['triton'] must be a positive number"),
    (lambda d: d["rows"][0].update(ms={"triton": float("nan")}), "ms['triton'] must be a positive number"),
    (lambda d: d.update(rows={}), "a 'rows' list"),
])
def test_a_bad_table_is_a_clear_error(tmp_path, change, message):
    data = table_data(row({"triton": 1.0}))
    costs.validate(copy.deepcopy(data))  # the unchanged table is valid
    change(data)
    path = tmp_path / "costs_sm90.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="costs_sm90.json: .*" + message.replace("(", r"\(").replace("[", r"\[")):
        costs.load(path)
    with pytest.raises(ValueError):
        costs.use(path)


def test_an_empty_table_may_leave_its_meta_blank_but_present():
    empty = table_data(meta={**{k: "" for k in costs.META_KEYS}, "fa4": None})
    costs.validate(empty)
    with pytest.raises(ValueError, match="meta device, torch, triton, packattn, date, command must name"):
        costs.validate({**empty, "rows": [row({"triton": 1.0})]})
    with pytest.raises(ValueError, match="not a readable JSON cost table"):
        costs.load(Path(__file__))


def test_triton_times_do_not_apply_where_its_sm90_kernels_are_off(hopper, use_table, monkeypatch):
    """The table measured the triton backend's sm_90 kernels: with them off for every call (PACKATTN_PORTABLE=1
    here) its times do not describe what would run, so the table ranks the others, or the rule decides."""
    use_table(row({"fa4": 2.0, "triton": 1.0, "sdpa": 3.0}), row({"triton": 1.0}, head_dim=192, head_dim_v=128))
    assert dispatch.select(call()).name == "triton"
    monkeypatch.setenv("PACKATTN_PORTABLE", "1")
    assert dispatch.select(call()).name == "fa4"
    reason = dict(dispatch.reasons(call()))["triton"]
    assert reason.startswith("its 1 ms in the cost table row d=128 group 4 long causal fwd+bwd are not what runs "
                             "here: PACKATTN_PORTABLE=1")
    _, decision = dispatch.decide(call(head_dim=192, head_dim_v=128))  # only triton measured: the rule
    assert decision.choice is None and "times only triton, not what runs here (PACKATTN_PORTABLE=1" in decision.why
    assert dispatch.select(call(head_dim=192, head_dim_v=128)).name == "triton"  # (FA4 refuses MLA)


# ------------------------------------------------------------------------------------ the mid regime
MID = {"max_seqlen_q": 129, "max_seqlen_kv": 129}  # bucketed: longest 129-256


def test_a_mid_call_ranks_by_the_mid_row(hopper, use_table):
    """200-token documents at d = 64 MHA with gradients: the mid row (256-token documents, triton ahead) decides,
    not the short one (512, FA4 ahead)."""
    mha64 = {"heads_kv": 16, "head_dim": 64, "head_dim_v": 64}
    use_table(row({"fa4": 1.45, "triton": 1.53}, head_dim=64, group=1, regime="short"),
              row({"fa4": 1.8, "triton": 1.5}, head_dim=64, group=1, regime="mid"))
    assert dispatch.select(call(**mha64, **MID)).name == "triton"
    assert dispatch.select(call(**mha64, max_seqlen_q=257, max_seqlen_kv=257)).name == "fa4"  # short: its own row
    _, decision = dispatch.decide(call(**mha64, **MID))
    assert decision.row.key.regime == "mid" and decision.stand_in == ""
    assert "row d=64 group 1 mid causal fwd+bwd: triton 1.5 ms, fa4 1.8 ms" in decision.describe()


def test_a_table_without_mid_rows_loads_and_its_short_rows_stand_in(hopper, use_table, tmp_path):
    """A table tuned before the mid regime (tiny, short and long rows only) loads, and ranks a mid call by its
    short row, as it did before the split; the decision says so. A short call never takes a mid row."""
    old = use_table(row({"fa4": 1.0, "triton": 1.2}, regime="short"), row({"fa4": 2.0, "triton": 1.0}, regime="tiny"),
                    row({"fa4": 1.0, "triton": 3.0}))
    assert {r.key.regime for r in old.rows} == {"short", "tiny", "long"}
    assert dispatch.select(call(**MID)).name == "fa4"
    _, decision = dispatch.decide(call(**MID))
    assert decision.row.key.regime == "short"
    assert decision.stand_in == "standing in for the mid regime (longest 129-256; the table has no mid row here)"
    assert decision.describe() == ("cost table costs_test.json (NVIDIA H100 80GB HBM3, 2026-01-02), row d=128 group 4 "
                                   "short causal fwd+bwd, standing in for the mid regime (longest 129-256; the table "
                                   "has no mid row here): fa4 1 ms, triton 1.2 ms")
    assert dict(dispatch.reasons(call(**MID)))["triton"] == \
        "1.2 ms vs fa4 1 ms in the cost table row d=128 group 4 short causal fwd+bwd"
    use_table(row({"fa4": 1.0, "triton": 1.2}, regime="mid"))  # no reverse stand-in: short -> the rule
    _, decision = dispatch.decide(call(max_seqlen_q=257, max_seqlen_kv=257))
    assert decision.choice is None and decision.why.endswith("has no row for d=128 group 4 short causal fwd+bwd")
    assert dispatch.decide(call(**MID))[1].stand_in == ""


def test_a_mid_call_without_mid_or_short_row_goes_to_the_rule(hopper, use_table):
    use_table(row({"fa4": 2.0, "triton": 1.0}, regime="tiny"), row({"fa4": 2.0, "triton": 1.0}, regime="mid",
                                                                  mask="none"))
    _, decision = dispatch.decide(call(**MID))
    assert decision.choice is None and decision.why == (
        "costs_test.json (NVIDIA H100 80GB HBM3, 2026-01-02) has no row for d=128 group 4 mid causal fwd+bwd (nor a "
        "short row to stand in)")
    assert dispatch.select(call(**MID)).name == "fa4"  # the rule (GQA: FA4 does not defer)


def test_covering_takes_other_stand_ins():
    """`costs.covering` with a what-if ``stand_ins`` (the replay's): mid ranked by the tiny row."""
    loaded = costs.Table("sm90", META, tuple(costs.Row(costs._row_key(r, None), r["ms"]) for r in (
        row({"triton": 1.0}, regime="tiny"), row({"fa4": 1.0}, regime="short"))), "t.json")
    key = costs.Key(128, 128, 4, "mid", "causal", True)
    assert costs.covering(loaded, key)[0].key.regime == "short"
    found, note = costs.covering(loaded, key, {"mid": "tiny"})
    assert found.key.regime == "tiny" and "standing in for the mid regime" in note
    assert costs.covering(loaded, key, {})[0] is None


def test_mid_rows_validate():
    costs.validate(table_data(row({"triton": 1.0}, regime="mid"), row({"triton": 1.0}, regime="short")))
    with pytest.raises(ValueError, match="appears twice"):
        costs.validate(table_data(row({"triton": 1.0}, regime="mid"), row({"fa4": 1.0}, regime="mid")))
