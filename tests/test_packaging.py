"""Packaging: the declared dependency ranges (bounded on both sides, floors CI can install), the LICENSE, the
README's CPU install, and the Triton release gates (`packattn.ops.runtime.support.GLUON_TRITON`, `FAST_LAUNCH_TRITON`):
on an unchecked release the Gluon kernels and fast launches stay off, with the reason logged once."""

from __future__ import annotations

import importlib.util
import logging
import os
import tomllib

import pytest
import torch

from packattn.ops.runtime import support

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _ci_pins():
    spec = importlib.util.spec_from_file_location("ci_pins", os.path.join(ROOT, "scripts", "ci_pins.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_and_triton_ranges_are_bounded_and_their_floors_pair_up():
    deps = {d.split(">")[0].split("<")[0].strip(): d for d in _project()["dependencies"]}
    assert set(deps) == {"torch", "triton"}
    for name, requirement in deps.items():
        assert ">=" in requirement and "<" in requirement.replace("<=", "<"), requirement
    pins = _ci_pins().floor_pins(_project(), [])
    # torch 2.11 requires triton 3.6.0: the floors must be one installable pair
    assert pins == ["torch==2.11", "triton==3.6 ; platform_system == 'Linux'"]
    assert ".".join(pins[1].split("==")[1].split()[0].split(".")[:2]) in support.GLUON_TRITON


def test_floor_pins_follow_every_lower_bound():
    ci_pins = _ci_pins()
    assert ci_pins.floor_pin("transformers>=5.22,<6") == "transformers==5.22"
    assert ci_pins.floor_pin("triton>=3.6,<3.10; platform_system == 'Linux'") == \
        "triton==3.6 ; platform_system == 'Linux'"
    assert ci_pins.floor_pin("numpy") is None and ci_pins.floor_pin("jax[cpu] >= 0.10") == "jax==0.10"
    pins = ci_pins.floor_pins(_project(), list(_project()["optional-dependencies"]))
    assert {p.split("==")[0] for p in pins} >= {"torch", "triton", "transformers", "jax", "pytest"}
    with pytest.raises(KeyError):
        ci_pins.floor_pins(_project(), ["no-such-extra"])


def test_license_file_matches_the_declared_license():
    assert _project()["license"] == "Apache-2.0" and _project()["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_readme_tells_cpu_users_how_to_get_the_cpu_build():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    install = readme[readme.index("## Install"):]
    install = install[:install.index("\n## ", 1)]
    assert "/whl/cpu" in install and "packattn[jax]" in install


@pytest.mark.parametrize("version, on", [("3.6.0", True), ("3.6.1+git0123", True), ("3.9.0", True), ("3.9.1", True),
                                         ("3.8.0", False), ("3.10.0", False), ("3.60.0", False), ("3.96.0", False)])
def test_gluon_runs_only_on_listed_triton_releases(version, on):
    reason = support.gluon_unsupported(version)
    assert (reason is None) == on
    if not on:
        assert version in reason and "3.6 / 3.9" in reason and "Triton kernels run instead" in reason


def test_release_configs_replace_table_entries_on_their_release_only():
    """`RELEASE_FWD_CONFIGS` entries are what the tables (and `config_for`) hold on the release they name (from
    import); on another release they are not. Each release's tables pass the head-dim checks."""
    pytest.importorskip("triton")
    from packattn.ops.varlen import configs

    release = support.triton_release(support.triton_version())
    entries = configs.RELEASE_FWD_CONFIGS.get(release, {})
    assert "3.9" in configs.RELEASE_FWD_CONFIGS and release is not None
    for name, table in configs.fwd_tables().items():
        for dim, cfg in entries.get(name, {}).items():
            assert table[dim] == cfg
    if release == "3.9":
        assert configs.config_for(192) == configs.RELEASE_FWD_CONFIGS["3.9"]["CONFIGS"][192]
    else:
        assert configs.config_for(192) != configs.RELEASE_FWD_CONFIGS["3.9"]["CONFIGS"][192]
    assert support.triton_release("3.9.1+git0123") == "3.9" and support.triton_release(None) is None
    with pytest.raises(ValueError, match="applied at import"):
        with configs.override(RELEASE_FWD_CONFIGS={}):
            pass
    for other in configs.RELEASE_FWD_CONFIGS.values():  # `override` runs the tables' checks on entry
        tables = configs.fwd_tables()
        with configs.override(**{name: {**tables[name], **changes} for name, changes in other.items()}):
            if "CONFIGS" in other:
                assert all(configs.config_for(dim) == cfg for dim, cfg in other["CONFIGS"].items())


def test_no_triton_is_a_reason_too(monkeypatch):
    monkeypatch.setattr(support, "triton_version", lambda: None)
    assert "not installed" in support.gluon_unsupported()


def test_gluon_off_hides_hopper_from_every_gluon_test_and_logs_once(monkeypatch, caplog):
    """`sm90._capability` is the one device test of the Gluon forward, backward and tree paths."""
    from packattn.ops.runtime import sm90

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(sm90, "_GLUON_OFF", "Gluon kernels off: test reason")
    monkeypatch.setattr(support, "_logged", set())
    sm90._capability.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="packattn.triton"):
            assert sm90._capability(0) == (0, 0) and sm90._capability(1) == (0, 0)
        assert [r.getMessage() for r in caplog.records] == ["Gluon kernels off: test reason"]
        monkeypatch.setattr(sm90, "_GLUON_OFF", None)
        sm90._capability.cache_clear()
        assert sm90._capability(0) == (9, 0)
    finally:
        sm90._capability.cache_clear()


def test_fast_launch_stays_off_on_an_unchecked_release(monkeypatch, caplog):
    pytest.importorskip("triton")
    from packattn.ops.runtime import fast_launch

    reason = support.release_unsupported("fast launches", support.FAST_LAUNCH_TRITON, "3.8.0", "slow path")
    built = " / ".join(support.FAST_LAUNCH_TRITON)
    assert reason == f"fast launches off: built for Triton {built}, found 3.8.0; slow path"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PACKATTN_PORTABLE", raising=False)
    monkeypatch.setattr(fast_launch, "_RELEASE_OFF", reason)
    monkeypatch.setattr(support, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="packattn.triton"):
        assert not fast_launch.enabled() and not fast_launch.enabled()
    assert [r.getMessage() for r in caplog.records] == [reason]
