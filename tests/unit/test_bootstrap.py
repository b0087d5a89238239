"""How components find a broker: flag, then environment variable, then the embedded broker's state file."""

from __future__ import annotations

from pathlib import Path

import pytest

from trajbus.infra import bootstrap


def test_bootstrap_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TRAJBUS_STATE_DIR", str(tmp_path / "none"))
    monkeypatch.delenv(bootstrap.ENV_VAR, raising=False)
    with pytest.raises(bootstrap.BrokerNotFound, match="trajbus broker up"):
        bootstrap.resolve_bootstrap_servers()
    monkeypatch.setenv(bootstrap.ENV_VAR, "from-env:1")
    assert bootstrap.resolve_bootstrap_servers() == "from-env:1"
    assert bootstrap.resolve_bootstrap_servers("explicit:2") == "explicit:2"
