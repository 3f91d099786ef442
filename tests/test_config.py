"""Configuration loading: precedence, strictness, durations, and the shipped
config/narad.toml documenting every key with its default."""

from __future__ import annotations

from pathlib import Path

import pytest

from narad.config import load_config, parse_duration, render_toml
from narad.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_config_lists_every_key_with_its_default() -> None:
    assert (ROOT / "config" / "narad.toml").read_text() == render_toml()
    cfg = load_config(str(ROOT / "config" / "narad.toml"), env={})
    assert cfg == load_config(None, env={})


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "n.toml"
    f.write_text('[http]\nport = 8000\nread_timeout = "5s"\n[node]\nworkers = 3\n')
    cfg = load_config(str(f), env={})
    assert cfg.http.port == 8000 and cfg.node.workers == "3" and cfg.seconds("http", "read_timeout") == 5
    cfg = load_config(str(f), env={"NARAD_HTTP_PORT": "9000"})
    assert cfg.http.port == 9000 and cfg.raft_port == 9001 and cfg.cluster_port == 9002
    cfg = load_config(str(f), env={"NARAD_HTTP_PORT": "9000"}, overrides={"http.port": 9100})
    assert cfg.http.port == 9100


def test_unknown_key_is_refused_with_its_name(tmp_path: Path) -> None:
    f = tmp_path / "n.toml"
    f.write_text("[http]\nprot = 8000\n")
    with pytest.raises(ConfigError, match=r"unknown config key http\.prot"):
        load_config(str(f), env={})
    f.write_text("[htp]\nport = 8000\n")
    with pytest.raises(ConfigError, match=r"unknown config section \[htp\]"):
        load_config(str(f), env={})


@pytest.mark.parametrize(
    "body, match",
    [
        ('[http]\nread_timeout = 10\n', "duration"),
        ('[http]\nport = "x"\n', "integer"),
        ('[topic]\ndefault_partitions = 2\n', "default_partitions"),
        ('[topic]\ndefault_retention_age_ms = 5\n', "retention"),
        ('[http]\nmax_consume_wait = "20s"\n', "max_consume_wait"),
        ('[node]\nworkers = "many"\n', "workers"),
    ],
)
def test_bad_values_are_refused(tmp_path: Path, body: str, match: str) -> None:
    f = tmp_path / "n.toml"
    f.write_text(body)
    with pytest.raises(ConfigError, match=match):
        load_config(str(f), env={})


def test_dev_mode_turns_security_off_and_binds_loopback() -> None:
    cfg = load_config(None, env={}, overrides={"node.dev": True})
    assert not cfg.security.enabled and cfg.http.host == "127.0.0.1" and cfg.cluster.host == "127.0.0.1"


def test_durations() -> None:
    assert parse_duration("250ms") == 0.25
    assert parse_duration("1m30s") == 90
    for bad in ("10", "", "s", "1d", "5 s"):
        with pytest.raises(ValueError):
            parse_duration(bad)
