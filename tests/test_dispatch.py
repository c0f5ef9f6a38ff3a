"""Backend selection on CPU: auto, PACKATTN_BACKEND / PACKATTN_DISABLE, reasons, DEBUG logs, the cache."""

import logging

import pytest
import torch

from packattn import NoBackendError, Varlen, attention, dispatch
from packattn.backends import REGISTRY
from packattn.mask import Mask
from packattn.ops.runtime import support

CPU_BACKENDS = {"sdpa", "reference"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("PACKATTN_BACKEND", raising=False)
    monkeypatch.delenv("PACKATTN_DISABLE", raising=False)
    monkeypatch.delenv("PACKATTN_LOG", raising=False)
    dispatch.clear_cache()
    yield monkeypatch
    dispatch.clear_cache()


@pytest.fixture
def ran(monkeypatch):
    """Records the name of every backend whose run() is called."""
    calls = []
    for backend in REGISTRY:
        original = backend.run

        def run(problem, _name=backend.name, _original=original):
            calls.append(_name)
            return _original(problem)

        monkeypatch.setattr(backend, "run", run)
    return calls


def params(**overrides):
    base = dict(
        device_type="cpu", dtype=torch.float32, heads_q=4, heads_kv=2, head_dim=32, head_dim_v=32, kind="varlen",
        pad_between_seqs=False, is_self=True, host_lengths=True, max_seqlen_q=17, max_seqlen_kv=17,
        mask=Mask.make(causal=True), return_lse=False, deterministic=False, requires_grad=False,
    )
    base.update(overrides)
    return dispatch.Params(**base)


def inputs(lengths=(5, 0, 9), heads=(4, 2), d=32):
    seqs = Varlen.from_lengths(list(lengths))
    torch.manual_seed(0)
    q = torch.randn(seqs.total_q, heads[0], d)
    k, v = torch.randn(seqs.total_kv, heads[1], d), torch.randn(seqs.total_kv, heads[1], d)
    return q, k, v, seqs


def first_capable(listing):
    return next(name for name, why in listing if why is None)


# ------------------------------------------------------------------------------------ auto
def test_auto_picks_the_first_capable_backend(ran):
    p = params()
    listing = dispatch.reasons(p)
    assert [name for name, _ in listing] == [b.name for b in REGISTRY]  # every backend, in priority order
    chosen = dispatch.select(p)
    assert chosen.name == first_capable(listing) and chosen.name in CPU_BACKENDS
    # every backend ahead of it says why it was skipped
    for name, why in listing[: [n for n, _ in listing].index(chosen.name)]:
        assert isinstance(why, str) and why, name
    q, k, v, seqs = inputs()
    out = attention(q, k, v, seqs, causal=True)
    assert ran == [chosen.name]
    ref = attention(q, k, v, seqs, causal=True, backend="reference")
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)


def test_cuda_backends_say_they_need_cuda():
    reasons = dict(dispatch.reasons(params()))
    for name in ("torch_varlen", "flex"):
        assert name in reasons, name
        assert "needs CUDA" in reasons[name], (name, reasons[name])
    for name in CPU_BACKENDS:
        assert reasons[name] is None


def test_explicit_backend_request(ran):
    q, k, v, seqs = inputs()
    attention(q, k, v, seqs, backend="reference")
    attention(q, k, v, seqs, backend="sdpa")
    assert ran == ["reference", "sdpa"]
    listing = dict(dispatch.reasons(params(), "reference"))
    assert listing["reference"] is None
    assert listing["sdpa"] == "not the requested backend (reference)"


def test_return_lse_excludes_sdpa_with_a_reason(ran):
    reasons = dict(dispatch.reasons(params(return_lse=True)))
    assert reasons["sdpa"] == "SDPA does not return the log-sum-exp"
    assert dispatch.select(params(return_lse=True)).name == "reference"
    q, k, v, seqs = inputs()
    out, lse = attention(q, k, v, seqs, return_lse=True)
    assert ran == ["reference"] and lse.shape == (4, seqs.total_q)


def test_sdpa_needs_host_lengths():
    assert dict(dispatch.reasons(params(host_lengths=False)))["sdpa"] == "per-sequence SDPA needs host lengths in the descriptor"
    assert dict(dispatch.reasons(params(host_lengths=False, kind="dense")))["sdpa"] is None


def test_tree_descriptors_go_to_tree_aware_backends():
    listing = dict(dispatch.reasons(params(kind="tree")))
    assert listing["sdpa"] == "tree descriptors need a tree-aware backend"
    assert "tree" in listing["triton"] or "CUDA" in listing["triton"]  # the device reason comes first on GPUs
    assert dispatch.select(params(kind="tree")).name == "reference"  # on CPU


# ------------------------------------------------------------------------------------ environment
def test_packattn_backend_forces_one(clean_env, ran):
    clean_env.setenv("PACKATTN_BACKEND", "reference")
    assert dispatch.select(params()).name == "reference"
    listing = dict(dispatch.reasons(params()))
    assert listing["sdpa"] == "not the requested backend (reference) from PACKATTN_BACKEND"
    q, k, v, seqs = inputs()
    attention(q, k, v, seqs)
    attention(q, k, v, seqs, backend="sdpa")  # the environment wins over the argument
    assert ran == ["reference", "reference"]


def test_packattn_backend_that_cannot_run(clean_env):
    clean_env.setenv("PACKATTN_BACKEND", "sdpa")
    with pytest.raises(NoBackendError, match=r"sdpa: SDPA does not return the log-sum-exp"):
        dispatch.select(params(return_lse=True))


def test_packattn_disable_skips_sdpa_and_logs_why(clean_env, ran, caplog):
    assert dispatch.select(params()).name == "sdpa"  # what auto picks otherwise
    clean_env.setenv("PACKATTN_DISABLE", "sdpa")
    caplog.set_level(logging.DEBUG, logger="packattn.dispatch")
    q, k, v, seqs = inputs()
    attention(q, k, v, seqs, causal=True)
    assert ran == ["reference"]
    assert dict(dispatch.reasons(params()))["sdpa"] == "disabled by PACKATTN_DISABLE"
    records = [r for r in caplog.records if r.name == "packattn.dispatch" and r.levelno == logging.DEBUG]
    skipped = [r.getMessage() for r in records if "skipping" in r.getMessage()]
    assert any("sdpa" in m and "disabled by PACKATTN_DISABLE" in m for m in skipped), skipped
    # every backend ahead of the chosen one is logged with its reason
    for b in REGISTRY[: [x.name for x in REGISTRY].index("reference")]:
        assert any(f"backend {b.name}:" in m for m in skipped), (b.name, skipped)
    assert any("using backend reference" in r.getMessage() for r in records)


def test_packattn_disable_list_with_spaces(clean_env):
    clean_env.setenv("PACKATTN_DISABLE", " sdpa , torch_varlen ,")
    reasons = dict(dispatch.reasons(params()))
    assert reasons["sdpa"] == reasons["torch_varlen"] == "disabled by PACKATTN_DISABLE"
    assert dispatch.select(params()).name == "reference"


def test_nothing_fits_lists_every_backend(clean_env):
    clean_env.setenv("PACKATTN_DISABLE", "sdpa,reference")
    with pytest.raises(NoBackendError) as info:
        dispatch.select(params())
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith("no packattn backend can run this call (varlen cpu float32 heads 4/2 d=32, causal, "
                              "longest 17-128)")
    reasons = dict(dispatch.reasons(params()))
    for backend in REGISTRY:
        assert f"  {backend.name}: {reasons[backend.name]}" in message
    assert "  sdpa: disabled by PACKATTN_DISABLE" in message and "  reference: disabled by PACKATTN_DISABLE" in message
    q, k, v, seqs = inputs()
    with pytest.raises(NoBackendError, match="reference: disabled by PACKATTN_DISABLE"):
        attention(q, k, v, seqs)


# ------------------------------------------------------------------------------------ cache
def test_cache_hits_and_env_changes(clean_env, monkeypatch):
    p = params()
    first = dispatch.select(p)
    # a hit does not ask the backends again
    with monkeypatch.context() as m:
        m.setattr(dispatch, "reasons", lambda *a, **k: pytest.fail("cache miss"))
        assert dispatch.select(p) is first
        assert dispatch.select(params()) is first  # equal Params, new object
    # environment changes are part of the key: no stale answer
    clean_env.setenv("PACKATTN_DISABLE", first.name)
    second = dispatch.select(p)
    assert second.name != first.name
    clean_env.delenv("PACKATTN_DISABLE")
    assert dispatch.select(p) is first
    clean_env.setenv("PACKATTN_BACKEND", "reference")
    assert dispatch.select(p).name == "reference"


def test_cache_distinguishes_params_and_requests():
    assert dispatch.select(params()).name == "sdpa"
    assert dispatch.select(params(return_lse=True)).name == "reference"
    assert dispatch.select(params(), "reference").name == "reference"
    assert dispatch.select(params()).name == "sdpa"


def test_cache_is_bounded():
    for n in range(dispatch._CACHE_SIZE + 20):
        dispatch.select(params(head_dim=n + 1, head_dim_v=n + 1))
    assert len(dispatch._cache) == dispatch._CACHE_SIZE
    dispatch.clear_cache()
    assert len(dispatch._cache) == 0


def test_params_bucket_and_describe():
    lengths = (0, 1, 16, 17, 18, 128, 129, 256, 257, 512, 513, 100000)
    assert [dispatch.Params.bucket(n) for n in lengths] == [0, 1, 16, 17, 17, 17, 129, 129, 257, 257, 513, 513]
    assert params(max_seqlen_q=257, max_seqlen_kv=257).short_seqs  # mid and short: both short batches
    assert params(max_seqlen_q=17, max_seqlen_kv=17).short_seqs and params(max_seqlen_q=1, max_seqlen_kv=5).short_seqs
    assert not params(max_seqlen_q=513).short_seqs and not params(max_seqlen_kv=513).short_seqs
    assert hash(params()) == hash(params()) and params() == params()
    text = dispatch.describe(params(pad_between_seqs=True, return_lse=True, deterministic=True, dtype=torch.bfloat16))
    assert text == "varlen cpu bfloat16 heads 4/2 d=32, causal, padded, lse, deterministic, longest 17-128"
    assert dispatch.describe(params(max_seqlen_q=129, max_seqlen_kv=129)).endswith("longest 129-256")
    assert dispatch.describe(params(max_seqlen_q=257, max_seqlen_kv=129)).endswith("longest 257-512/129-256")
    text = dispatch.describe(params(max_seqlen_q=1, max_seqlen_kv=513, head_dim_v=64, requires_grad=True))
    assert text == "varlen cpu float32 heads 4/2 d=32/64, causal, grad, longest 1/>512"


@pytest.fixture
def hopper_with_fa4(monkeypatch):
    """FA4 and the triton backend available on a CUDA device of ``capability`` (set ``hopper_with_fa4[0]``)."""
    from packattn.backends import get

    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability[0])
    # the sm_90 kernels on for every call (not the interpreter the CPU tests run in, a Triton they are built for)
    monkeypatch.setattr(support, "interpreting", lambda: False)
    monkeypatch.setattr(support, "installed_gluon_unsupported", lambda: None)
    monkeypatch.delenv("PACKATTN_PORTABLE", raising=False)
    monkeypatch.setattr(type(get("fa4")), "unavailable", lambda self: None)
    monkeypatch.setattr(type(get("triton")), "unavailable", lambda self: None)
    monkeypatch.setattr(type(get("small_seq")), "unavailable", lambda self: "not in this test")
    return capability


def test_auto_passes_fa4_over_for_short_batches_with_gradients(hopper_with_fa4, monkeypatch):
    """Auto dispatch gives short batches (<= 512 rows) with gradients at d = 128, MHA, on Hopper to the triton
    backend (its short-batch backward measured faster than FA4's), with the reason logged; FA4 keeps the rest."""
    from packattn.backends import get
    from packattn.backends import triton_varlen

    monkeypatch.setattr(triton_varlen, "device_unsupported", lambda device_type: None)
    w8 = dict(device_type="cuda", dtype=torch.bfloat16, heads_q=16, heads_kv=16, head_dim=128, head_dim_v=128,
              max_seqlen_q=dispatch.Params.bucket(512), max_seqlen_kv=dispatch.Params.bucket(512), requires_grad=True)
    listing = dict(dispatch.reasons(params(**w8)))
    assert "short sequences" in listing["fa4"] and listing["triton"] is None
    assert dispatch.select(params(**w8)).name == "triton"
    assert dispatch.select(params(**w8), "fa4").name == "fa4"  # asked for by name: still runs
    longer = dict(w8, max_seqlen_q=dispatch.Params.bucket(513), max_seqlen_kv=dispatch.Params.bucket(513))
    for other in (longer, dict(w8, requires_grad=False), dict(w8, heads_kv=4), dict(w8, head_dim=64, head_dim_v=64)):
        assert get("fa4").defers_to(params(**other)) is None
        assert dispatch.select(params(**other)).name == "fa4"
    hopper_with_fa4[0] = (10, 0)
    assert get("fa4").defers_to(params(**w8)) is None  # measured on Hopper only
    hopper_with_fa4[0] = (9, 0)
    dispatch.clear_cache()
    monkeypatch.setenv("PACKATTN_DISABLE", "triton")  # FA4 stays in front of the slower anchors
    assert dispatch.select(params(**w8)).name == "fa4"
    monkeypatch.setenv("PACKATTN_DISABLE", "")
    monkeypatch.setattr(triton_varlen, "device_unsupported", lambda device_type: "not this device")
    assert dispatch.select(params(**w8)).name == "fa4"  # nor when the triton backend cannot run the call


def test_fa4_defers_only_where_the_sm90_kernels_run(hopper_with_fa4, monkeypatch):
    """The deferral holds for the triton backend's sm_90 kernels: not under PACKATTN_PORTABLE=1, Triton's
    interpreter or a Triton the Gluon kernels are not built for (`support.sm90_kernels_off`), where only the
    portable Triton kernels would run."""
    from packattn.backends import get

    w8 = params(device_type="cuda", dtype=torch.bfloat16, heads_q=16, heads_kv=16, head_dim=128, head_dim_v=128,
                max_seqlen_q=dispatch.Params.bucket(512), max_seqlen_kv=dispatch.Params.bucket(512),
                requires_grad=True)
    from packattn.backends import triton_varlen

    monkeypatch.setattr(triton_varlen, "device_unsupported", lambda device_type: None)
    assert get("fa4").defers_to(w8)[0] == "triton" and dispatch.select(w8).name == "triton"
    monkeypatch.setenv("PACKATTN_PORTABLE", "1")
    assert "PACKATTN_PORTABLE" in support.sm90_kernels_off() and get("fa4").defers_to(w8) is None
    assert dispatch.select(w8).name == "fa4"  # set after a call with the same params: not a stale cached pick
    monkeypatch.delenv("PACKATTN_PORTABLE")
    monkeypatch.setattr(support, "installed_gluon_unsupported", lambda: "Gluon kernels off: test reason")
    assert get("fa4").defers_to(w8) is None
    monkeypatch.setattr(support, "installed_gluon_unsupported", lambda: None)
    monkeypatch.setattr(support, "interpreting", lambda: True)
    assert get("fa4").defers_to(w8) is None


# ------------------------------------------------------------------------------------ names in the environment
def test_packattn_disable_rejects_an_unknown_name(clean_env):
    """A misspelt name is an error listing the known ones (it was ignored, leaving the backend on)."""
    clean_env.setenv("PACKATTN_DISABLE", "sdpa,refernce")
    with pytest.raises(ValueError, match=r"PACKATTN_DISABLE='sdpa,refernce' names unknown backend\(s\) refernce; "
                                         r"known: .*reference.*sdpa"):
        dispatch.select(params())
    q, k, v, seqs = inputs()
    with pytest.raises(ValueError, match="unknown backend"):
        attention(q, k, v, seqs)
    clean_env.setenv("PACKATTN_DISABLE", "sdpa")
    assert dispatch.select(params()).name == "reference"


def test_packattn_log_rejects_an_unknown_topic(clean_env):
    clean_env.setenv("PACKATTN_LOG", "dispach")
    with pytest.raises(ValueError, match="PACKATTN_LOG='dispach' names unknown topic.*known: dispatch"):
        dispatch.select(params())


# ------------------------------------------------------------------------------------ PACKATTN_LOG=dispatch
def test_packattn_log_dispatch_logs_each_new_decision_once(clean_env, caplog, restore_logger):
    clean_env.setenv("PACKATTN_LOG", "dispatch")
    q, k, v, seqs = inputs()
    with caplog.at_level(logging.INFO, logger="packattn.dispatch"):
        for _ in range(3):
            attention(q, k, v, seqs, causal=True)  # one decision, cached
        attention(q, k, v, seqs, causal=True, return_lse=True)  # a new one
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "packattn.dispatch"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("packattn dispatch: varlen cpu float32 heads 4/2 d=32, causal, longest 9 "
                               "(backend=auto) -> sdpa (passed over: small_seq: ")
    assert "torch_varlen: needs CUDA" in lines[0]
    assert lines[1].endswith("-> reference (passed over: " + lines[1].split("(passed over: ")[1])
    assert "sdpa: SDPA does not return the log-sum-exp" in lines[1]
    clean_env.delenv("PACKATTN_LOG")
    caplog.clear()
    dispatch.clear_cache()
    attention(q, k, v, seqs, causal=True)
    assert not [r for r in caplog.records if r.levelno == logging.INFO]  # off without the variable


def test_packattn_log_dispatch_prints_without_logging_setup(tmp_path):
    """In a fresh interpreter with no logging configured, the variable alone prints the lines on stderr."""
    import os
    import subprocess
    import sys

    script = ("import torch, packattn\n"
              "seqs = packattn.Varlen.from_lengths([3, 5])\n"
              "q = torch.randn(8, 2, 16)\n"
              "for _ in range(4): packattn.attention(q, q, q, seqs, causal=True)\n"
              "packattn.attention(q, q, q, seqs)\n")
    env = {**os.environ, "PACKATTN_LOG": "dispatch"}
    env.pop("PACKATTN_BACKEND", None)
    env.pop("PACKATTN_DISABLE", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("packattn dispatch:")]
    assert len(lines) == 2, done.stderr
    assert ", causal, longest 5 (backend=auto) -> sdpa" in lines[0] and ", full, longest 5 (backend=auto)" in lines[1]


def test_the_short_batch_rule_has_one_place():
    """Dispatch keys FA4's deferral and the triton backend picks its short-batch tiles on one rule,
    `packattn.lengths` (light enough for dispatch to import): no other module of packattn/ defines it."""
    import re
    from pathlib import Path

    from packattn import lengths

    assert dispatch.short_batch is lengths.short_batch
    root = Path(lengths.__file__).parent
    defining = [str(p.relative_to(root)) for p in root.rglob("*.py")
                if re.search(r"^(SHORT_SEQLEN\s*=|def short_batch\b)", p.read_text(), re.M)]
    assert defining == ["lengths.py"], defining
