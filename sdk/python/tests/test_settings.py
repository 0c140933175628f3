"""Settings: arguments, then the environment, then the CLI's config file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import clade
from clade._settings import resolve_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("CLADE_API_URL", "CLADE_API_KEY", "CLADE_CONFIG", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def write_config(home: Path, **values: str) -> None:
    path = home / ".config" / "clade" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(values))


def test_arguments_win_over_the_environment_and_the_file(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    write_config(clean_env, api_url="http://file:1", api_key="file-key")
    monkeypatch.setenv("CLADE_API_URL", "http://env:2/v1/")
    monkeypatch.setenv("CLADE_API_KEY", "env-key")
    assert resolve_settings("http://arg:3/v1", "arg-key").base_url == "http://arg:3"
    assert resolve_settings("http://arg:3/v1", "arg-key").api_key == "arg-key"
    from_env = resolve_settings()
    assert (from_env.base_url, from_env.api_key) == ("http://env:2", "env-key")


def test_the_config_file_is_the_clis(clean_env: Path) -> None:
    write_config(clean_env, api_url="http://file:1", token="file-token")
    settings = resolve_settings()
    assert (settings.base_url, settings.api_key) == ("http://file:1", "file-token")


def test_no_key_anywhere_says_where_to_put_one() -> None:
    with pytest.raises(clade.CladeError, match="CLADE_API_KEY"):
        clade.Clade()


def test_the_default_url_is_a_local_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLADE_API_KEY", "k")
    assert resolve_settings().base_url == "http://127.0.0.1:8080"
