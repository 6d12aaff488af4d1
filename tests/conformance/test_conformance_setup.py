"""The conformance tier's package cache: keyed by the pins, and a clear failure without network."""
from __future__ import annotations

import pytest

import conformance_packages as cp

pytestmark = pytest.mark.conformance


def test_offline_setup_fails_with_one_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_CONFORMANCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))  # nothing cached: pip must reach the index
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there: as offline
    with pytest.raises(cp.ConformanceSetupError, match="no network\\?") as info:
        cp.te_source()
    assert "python tests/conformance/conformance_packages.py" in str(info.value)
    assert not (tmp_path / "cache").exists() or not any(p.name.endswith("-" + cp._key(["transformer-engine"]))
                                                        for p in (tmp_path / "cache").iterdir()), "nothing half-made kept"


def test_cache_directories_are_keyed_by_the_pins(monkeypatch):
    key = cp._key(cp.SGLANG_SET)
    pins = cp.pins()
    monkeypatch.setattr(cp, "pins", lambda: {**pins, "msgspec": "0.0.1"})
    assert cp._key(cp.SGLANG_SET) != key
    assert set(cp.SGLANG_SET) <= set(pins) and pins["sglang"] == "0.5.23"
