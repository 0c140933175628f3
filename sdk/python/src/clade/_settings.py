"""Where a client finds its server and key: the arguments, then the
environment (`CLADE_API_URL`, `CLADE_API_KEY`), then the config file the
`clade` CLI reads (`$CLADE_CONFIG`, else `$XDG_CONFIG_HOME/clade/config.json`,
else `~/.config/clade/config.json`; keys `api_url` and `api_key`, or
`token`), then the default URL. There is no default key."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from ._errors import CladeError

DEFAULT_API_URL = "http://127.0.0.1:8080"


@dataclass(frozen=True)
class Settings:
    #: The server's URL without `/v1`, e.g. `http://127.0.0.1:8080`.
    base_url: str
    api_key: str


def config_path() -> Optional[Path]:
    def env_path(name: str) -> Optional[Path]:
        value = os.environ.get(name, "")
        return Path(value) if value else None

    explicit = env_path("CLADE_CONFIG")
    if explicit:
        return explicit
    xdg = env_path("XDG_CONFIG_HOME")
    if xdg:
        return xdg / "clade" / "config.json"
    home = env_path("HOME")
    return home / ".config" / "clade" / "config.json" if home else None


def read_config(path: Optional[Path]) -> Dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise CladeError(f"{path} is not a JSON object with api_url / api_key: {e}") from e
    if not isinstance(data, dict):
        raise CladeError(f"{path} is not a JSON object with api_url / api_key")
    return data


def normalize_base_url(url: str) -> str:
    """The URL without a trailing `/` or `/v1`: requests add `/v1/...`."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def resolve_settings(api_url: Optional[str] = None, api_key: Optional[str] = None) -> Settings:
    def first(*values: Any) -> Optional[str]:
        for value in values:
            if isinstance(value, str) and value.strip():
                return value.strip()
        return None

    path = config_path()
    file = read_config(path)
    url = first(api_url, os.environ.get("CLADE_API_URL"), file.get("api_url")) or DEFAULT_API_URL
    key = first(api_key, os.environ.get("CLADE_API_KEY"), file.get("api_key"), file.get("token"))
    if key is None:
        where = str(path) if path else "~/.config/clade/config.json"
        raise CladeError(
            "no API key: pass api_key=, set CLADE_API_KEY, or write "
            f'{{"api_url": "...", "api_key": "clade_..."}} to {where}'
        )
    return Settings(base_url=normalize_base_url(url), api_key=key)
