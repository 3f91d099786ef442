"""Secure by default: a cluster always runs with a real secret (at least 32 bytes),
whatever security.enabled says; security off never serves beyond loopback without
an acknowledgement; an admin password bcrypt cannot take stops the start with one
line; a metastore export (bcrypt hashes inside) is readable by its owner only;
/metrics names only the topics the caller may read.

Real nodes as subprocesses; the config rules also directly on load_config.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from narad.config import check_start, load_config
from narad.errors import ConfigError
from tests.harness import CLUSTER_SECRET, Node, basic, free_ports, wait_for


def _refused(tmp: Path, env: dict[str, str], args: list[str] | None = None) -> str:
    """Start a node that must refuse: exit code 2, returns its log."""
    n = Node(tmp / "data", workers=1, env=env, args=args or [])
    n.start(wait=False)
    assert n.proc is not None
    try:
        code = n.proc.wait(30)
    finally:
        n.close()
    assert code == 2, n.log()
    return n.log()


def _cluster_args(port: int) -> list[str]:
    return ["--peers", f"n1@127.0.0.1:{port},n2@127.0.0.1:1", "--initial-members", "n1,n2"]


# ---- the cluster secret ------------------------------------------------------------
@pytest.mark.parametrize("secret", [None, "short-secret-16b"])
def test_a_cluster_with_security_off_and_no_real_secret_is_refused(tmp_path: Path, secret: str | None) -> None:
    ports = free_ports(3)
    env = {"NARAD_SECURITY_ENABLED": "false", "NARAD_SECURITY_ALLOW_INSECURE_CLUSTER": "true"}
    if secret is not None:
        env["NARAD_CLUSTER_SECRET"] = secret
    n = Node(tmp_path / "data", workers=1, env=env, args=_cluster_args(ports[1]), ports=ports)
    n.start(wait=False)
    assert n.proc is not None
    try:
        assert n.proc.wait(30) == 2, n.log()
    finally:
        n.close()
    lines = [ln for ln in n.log().splitlines() if "refusing to start" in ln]
    assert len(lines) == 1 and "NARAD_CLUSTER_SECRET" in lines[0], n.log()
    assert ("at least 32" in lines[0]) if secret else ("needs NARAD_CLUSTER_SECRET" in lines[0])
    assert not (tmp_path / "data" / "metastore").exists()  # refused before anything was opened


def test_cluster_secret_rules() -> None:
    clustered = {"NARAD_CLUSTER_PEERS": "n1@127.0.0.1:7943,n2@127.0.0.1:8943", "NARAD_NODE_ID": "n1"}
    cfg = load_config(os.devnull, env=clustered)
    for env in ({}, {"NARAD_CLUSTER_SECRET": "x" * 31}):
        with pytest.raises(ConfigError, match="NARAD_CLUSTER_SECRET"):
            check_start(cfg, env)
    assert check_start(cfg, {"NARAD_CLUSTER_SECRET": CLUSTER_SECRET}) == CLUSTER_SECRET.encode()
    off = load_config(os.devnull, env={**clustered, "NARAD_SECURITY_ENABLED": "false",
                                       "NARAD_HTTP_HOST": "127.0.0.1"})
    with pytest.raises(ConfigError, match="allow_insecure_cluster"):
        check_start(off, {"NARAD_CLUSTER_SECRET": CLUSTER_SECRET})
    # A lone node without a secret makes a random one; a short one given is still refused.
    lone = load_config(os.devnull, env={})
    assert check_start(lone, {}) is None
    with pytest.raises(ConfigError, match="at least 32"):
        check_start(lone, {"NARAD_CLUSTER_SECRET": "abc"})


# ---- security off beyond loopback --------------------------------------------------------
def test_security_off_on_a_public_address_is_refused_without_the_acknowledgement(tmp_path: Path) -> None:
    log = _refused(tmp_path, {"NARAD_SECURITY_ENABLED": "false", "NARAD_HTTP_HOST": "0.0.0.0"})
    assert "security.allow_insecure_bind" in log and "0.0.0.0" in log


def test_security_off_bind_rules() -> None:
    with pytest.raises(ConfigError, match="allow_insecure_bind"):
        load_config(os.devnull, env={"NARAD_SECURITY_ENABLED": "false"})
    for env in ({"NARAD_HTTP_HOST": "127.0.0.1"}, {"NARAD_HTTP_HOST": "::1"}, {"NARAD_HTTP_HOST": "localhost"},
                {"NARAD_SECURITY_ALLOW_INSECURE_BIND": "true"}):
        assert not load_config(os.devnull, env={"NARAD_SECURITY_ENABLED": "false", **env}).security.enabled
    assert load_config(os.devnull, env={"NARAD_DEV": "true"}).http.host == "127.0.0.1"
    assert load_config(os.devnull, env={}).http.host == "0.0.0.0"  # security on: any address


def test_make_run_binds_loopback() -> None:
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    run = makefile.split("\nrun:", 1)[1].split("\n\n", 1)[0]
    assert "NARAD_HTTP_HOST=127.0.0.1" in run or "--dev" in run


# ---- the admin password --------------------------------------------------------------------
def test_an_admin_password_over_72_bytes_stops_the_start_with_one_line(tmp_path: Path) -> None:
    log = _refused(tmp_path, {"NARAD_ADMIN_PASSWORD": "p" * 73})
    lines = [ln for ln in log.splitlines() if "NARAD_ADMIN_PASSWORD" in ln]
    # The log line and the same words on stderr; never a repeating error.
    assert 1 <= len(lines) <= 2 and "73 bytes" in lines[0] and "72" in lines[0], log
    with pytest.raises(ConfigError, match="72"):
        check_start(load_config(os.devnull, env={}), {"NARAD_ADMIN_PASSWORD": "é" * 37})  # 74 bytes
    assert check_start(load_config(os.devnull, env={}), {"NARAD_ADMIN_PASSWORD": "p" * 72}) is None


def test_a_tls_certificate_that_cannot_be_loaded_stops_the_start_with_one_line(tmp_path: Path) -> None:
    # Before, a missing configured certificate was found by each worker's HTTP/3 setup:
    # workers died and were re-forked in a loop while /readyz said "not serving yet".
    env = {"NARAD_SECURITY_TLS_CERT_FILE": str(tmp_path / "missing.pem"),
           "NARAD_SECURITY_TLS_KEY_FILE": str(tmp_path / "missing.key")}
    log = _refused(tmp_path, env)
    lines = [ln for ln in log.splitlines() if "refusing to start" in ln]
    assert len(lines) == 1 and "security.tls_cert_file" in lines[0] and "missing.pem" in lines[0], log
    assert not (tmp_path / "data" / "metastore").exists()  # refused before the metastore was opened


# ---- a node for the export and /metrics checks ------------------------------------------
@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("secure") / "data", workers=1).start()
    yield n
    n.close()


def test_a_metastore_export_is_readable_by_its_owner_only(node: Node, tmp_path: Path) -> None:
    assert node.post("/v1/users", {"username": "hashed", "password": "hashed-pw"}).status == 201
    out = tmp_path / "export.json"
    out.write_text("old")
    os.chmod(out, 0o644)  # an older export, readable by everyone, is replaced
    old_umask = os.umask(0o022)
    try:
        node.ctl("metastore", "export", str(out))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert "password_hash" in out.read_text()
    assert not Path(f"{out}.tmp").exists()


def test_metrics_name_only_the_topics_the_caller_may_read(node: Node) -> None:
    for name in ("hidden-ledger", "team-a-orders"):
        assert node.post("/v1/topics", {"name": name}).status == 201
        r = node.post(f"/v1/topics/{name}/produce", {"payload": {"n": 1}})
        assert r.status in (200, 201, 202), r
    assert node.post("/v1/users", {"username": "nogrants", "password": "nogrants-pw"}).status == 201
    assert node.post("/v1/users", {"username": "teama", "password": "teama-pw",
                                   "grants": [{"action": "consume", "patterns": ["team-a-*"]}]}).status == 201

    def text(auth: str | None = None) -> str:
        r = node.get("/metrics", auth=auth) if auth else node.get("/metrics")
        assert r.status == 200, r
        return r.body.decode()

    wait_for(lambda: "hidden-ledger" in text() and "team-a-orders" in text(), 20, 0.2,
             "per-topic series for the admin")
    nobody = text(basic("nogrants", "nogrants-pw"))
    assert "hidden-ledger" not in nobody and "team-a-orders" not in nobody
    assert "narad_http_requests_total" in nobody  # node-wide series stay
    team = text(basic("teama", "teama-pw"))
    assert "team-a-orders" in team and "hidden-ledger" not in team
