"""`tether serve` refuses to expose an engine to other machines without an API key."""

from __future__ import annotations

import pytest

from tether.engine.serve import serve


def test_serve_on_all_interfaces_needs_tether_api_key(monkeypatch, tmp_path):
    monkeypatch.delenv("TETHER_API_KEY", raising=False)
    with pytest.raises(SystemExit) as info:
        serve("embedded", str(tmp_path), "0.0.0.0", 0, "float32", None, str(tmp_path))
    assert "TETHER_API_KEY" in str(info.value) and "0.0.0.0" in str(info.value)
