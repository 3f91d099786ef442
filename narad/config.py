"""Node configuration: every setting, its default, its env name, and loading.

Precedence, lowest to highest: built-in default < TOML file (``--config``) <
``NARAD_*`` environment < command-line flags. The file is strict: an unknown
section or key stops the start with the key named. Durations are strings
("10s", "250ms"); a bare number is refused, as in Narad.

``config/narad.toml`` documents every key here with its default; a test keeps
the two in step. Bottom layer: imports only narad.errors.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from narad.errors import ConfigError

DEFAULT_CONFIG_PATH = "/etc/narad/narad.toml"

_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Parse "250ms", "10s", "2m", "1h" (or a sum like "1m30s") into seconds."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"duration must be a string such as \"10s\", got {text!r}")
    total = 0.0
    pos = 0
    for m in re.finditer(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text):
        if m.start() != pos:
            raise ValueError(f"invalid duration {text!r}")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or pos == 0:
        raise ValueError(f"invalid duration {text!r} (use e.g. \"500ms\", \"10s\", \"2m\")")
    return total


def _s(default: Any, doc: str, env: str | None = None, kind: str | None = None) -> Any:
    meta = {"doc": doc, "env": env, "kind": kind}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class NodeConfig:
    id: str = _s("", "Stable node id (default: the host name). Raft and member records use it.",
                 "NARAD_NODE_ID")
    data_dir: str = _s("data", "Directory holding metastore/, topics/, ingress/, tls/ and admin-password.",
                       "NARAD_DATA_DIR")
    runtime_dir: str = _s("", "Directory for the naradctl and worker sockets (default: <data_dir>/run).",
                          "NARAD_RUNTIME_DIR")
    workers: str = _s("auto", "Worker processes: a number, or \"auto\" for one per usable CPU.",
                      "NARAD_WORKERS")
    pin_workers: bool = _s(True, "Pin each worker to its own core (psutil).", "NARAD_PIN_WORKERS")
    dev: bool = _s(False, "Development mode: security off, every listener on 127.0.0.1 only.", "NARAD_DEV")
    worker_stuck_after: str = _s("10s", "A worker (or the fork server) whose loop has not turned for this long is "
                                 "logged, killed and restarted (at least 60s before a worker first serves).",
                                 "NARAD_NODE_WORKER_STUCK_AFTER", "duration")


@dataclass(frozen=True)
class HttpConfig:
    host: str = _s("0.0.0.0", "Client API bind address (TCP for HTTP/1.1 and UDP for HTTP/3).",
                   "NARAD_HTTP_HOST")
    port: int = _s(7942, "Client API port, TCP and UDP.", "NARAD_HTTP_PORT")
    quic: bool = _s(True, "Serve HTTP/3 over QUIC beside HTTP/1.1 on the same port number.", "NARAD_HTTP_QUIC")
    read_timeout: str = _s("10s", "Time allowed to read one request (headers and body).",
                           "NARAD_HTTP_READ_TIMEOUT", "duration")
    idle_timeout: str = _s("60s", "Keep-alive connections idle this long are closed.",
                           "NARAD_HTTP_IDLE_TIMEOUT", "duration")
    shutdown_grace: str = _s("10s", "On SIGTERM, in-flight requests get this long to finish.",
                             "NARAD_HTTP_SHUTDOWN_GRACE", "duration")
    max_consume_wait: str = _s("10s", "Ceiling for a consume's wait; longer waits are clamped.",
                               "NARAD_HTTP_MAX_CONSUME_WAIT", "duration")
    max_header_bytes: int = _s(65536, "Largest request header block; larger gets 431.",
                               "NARAD_HTTP_MAX_HEADER_BYTES")
    max_connections: int = _s(4096, "Open client connections per node and transport (HTTP/1.1 and HTTP/3 each; "
                              "QUIC handshakes under way count; 0 = unlimited).",
                              "NARAD_HTTP_MAX_CONNECTIONS")
    max_consume_in_flight_per_identity: int = _s(
        1024, "Concurrent consumes per identity per node (0 = unlimited); over it: 429.",
        "NARAD_HTTP_MAX_CONSUME_IN_FLIGHT_PER_IDENTITY")
    max_produce_in_flight_per_identity: int = _s(
        0, "Concurrent produced messages per identity per node (0 = off); over it: 429.",
        "NARAD_HTTP_MAX_PRODUCE_IN_FLIGHT_PER_IDENTITY")
    metrics_unauthenticated: bool = _s(False, "Serve /metrics without credentials.",
                                       "NARAD_HTTP_METRICS_UNAUTHENTICATED")
    metrics_addr: str = _s("", "host:port of a separate metrics listener (/metrics, /healthz, /readyz; no auth); "
                           "when set, the API port answers /metrics with 404. Empty: metrics on the API port.",
                           "NARAD_HTTP_METRICS_ADDR")
    debug_headers: bool = _s(False, "Add X-Narad-Node and X-Narad-Worker to every response (debugging).",
                             "NARAD_HTTP_DEBUG_HEADERS")


@dataclass(frozen=True)
class ClusterConfig:
    host: str = _s("127.0.0.1", "Address the Raft and cluster (TLS node RPC) ports bind to and advertise.",
                   "NARAD_CLUSTER_HOST")
    raft_port: int = _s(0, "Raft TCP port (0 = client port + 1).", "NARAD_CLUSTER_RAFT_PORT")
    cluster_port: int = _s(0, "Node-to-node RPC port, TLS over TCP (0 = client port + 2).", "NARAD_CLUSTER_PORT")
    peers: list[str] = _s([], "Cluster nodes as id@host:raft_port (empty: a single node).", "NARAD_CLUSTER_PEERS")
    initial_members: list[str] = _s([], "Node ids that bootstrap the cluster together; any other node only joins.",
                                    "NARAD_CLUSTER_INITIAL_MEMBERS")
    max_voters: int = _s(5, "Raft voters at most; later joiners become non-voting replicas.",
                         "NARAD_CLUSTER_MAX_VOTERS")
    write_timeout: str = _s("10s", "Deadline of a metadata write, elections and forwarding included.",
                            "NARAD_CLUSTER_WRITE_TIMEOUT", "duration")
    heartbeat_interval: str = _s("5s", "How often a member heartbeats to the leader (build, newest entry type).",
                                 "NARAD_CLUSTER_HEARTBEAT_INTERVAL", "duration")
    member_dead_after: str = _s("30s", "A member silent this long is marked dead by the leader (its partitions "
                                "are not reassigned).", "NARAD_CLUSTER_MEMBER_DEAD_AFTER", "duration")
    newest_entry_type: int = _s(0, "The newest Raft entry type this node applies and reports (0: every type this "
                                "build applies). Lower it only to stand in for an older release (upgrade drills, "
                                "tests).", "NARAD_CLUSTER_NEWEST_ENTRY_TYPE")
    raft_snapshot_threshold: int = _s(8192, "Compact the Raft log into a snapshot after this many entries.",
                                      "NARAD_CLUSTER_RAFT_SNAPSHOT_THRESHOLD")
    raft_snapshot_interval: str = _s("120s", "How often the snapshot threshold is checked.",
                                     "NARAD_CLUSTER_RAFT_SNAPSHOT_INTERVAL", "duration")
    raft_election_timeout_min: str = _s("300ms", "Raft election timeout, lower bound.",
                                        "NARAD_CLUSTER_RAFT_ELECTION_TIMEOUT_MIN", "duration")
    raft_election_timeout_max: str = _s("700ms", "Raft election timeout, upper bound.",
                                        "NARAD_CLUSTER_RAFT_ELECTION_TIMEOUT_MAX", "duration")


@dataclass(frozen=True)
class StorageConfig:
    consumer_offset_commit_interval_ms: int = _s(
        1000, "Acks reach the page cache every 100 ms and are fsynced this often (10-60000).",
        "NARAD_STORAGE_CONSUMER_OFFSET_COMMIT_INTERVAL_MS")
    idle_log_eviction_ms: int = _s(
        1800000, "A partition log untouched this long (no produce, consume or ack; stats do not count), with no "
        "lease out and its acks synced, is closed and reopened on demand (0 = never; else >= 100; Narad's floor "
        "is 60000, shorter is for tests).", "NARAD_STORAGE_IDLE_LOG_EVICTION_MS")
    cold_retention_walk_ms: int = _s(
        300000, "How often each worker lists the partition directories it owns on disk and applies retention to "
        "those not open (opened, swept once, closed) (0 = never; else >= 100; Narad's floor is 60000).",
        "NARAD_STORAGE_COLD_RETENTION_WALK_MS")
    group_sync: bool = _s(
        True, "Partition commits of a worker that are ready together share one syncfs of the data directory's "
        "filesystem instead of one fdatasync each (only on Linux >= 5.8 with ext4, xfs or btrfs; elsewhere each log "
        "gets its own fdatasync whatever this says). Set false when the data directory shares its "
        "filesystem with heavy writers: a syncfs waits for their dirty pages too, and their write errors fail it.",
        "NARAD_STORAGE_GROUP_SYNC")
    idempotency_table_keys: int = _s(
        786432, "Idempotency keys the node's shared-memory claims table holds (rounded up to 6 times a power of "
        "two; 42.7 bytes a key: 32 MiB by default; 6 to 100663296). A key may live in either of two buckets of "
        "6; when both are full the key that expires first is dropped (narad_idempotency_table_evicted_total): "
        "none at half the capacity, about 0.2 % of the keys at 80 %.",
        "NARAD_STORAGE_IDEMPOTENCY_TABLE_KEYS")


@dataclass(frozen=True)
class TopicConfig:
    default_partitions: int = _s(3, "Partitions of a topic created without a count.",
                                 "NARAD_TOPIC_DEFAULT_PARTITIONS")
    max_partitions: int = _s(108, "Most partitions a topic may have.", "NARAD_TOPIC_MAX_PARTITIONS")
    default_retention_age_ms: int = _s(604800000, "Retention of a topic created without one (0 = forever).",
                                       "NARAD_TOPIC_DEFAULT_RETENTION_AGE_MS")
    default_visibility_timeout_ms: int = _s(30000, "Lease length of a topic created without one.",
                                            "NARAD_TOPIC_DEFAULT_VISIBILITY_TIMEOUT_MS")
    default_max_in_flight_per_partition: int = _s(1024, "Default cap on leases out per partition.",
                                                  "NARAD_TOPIC_DEFAULT_MAX_IN_FLIGHT_PER_PARTITION")
    default_max_acked_ahead_per_partition: int = _s(1024, "Default cap on acks held above the frontier.",
                                                    "NARAD_TOPIC_DEFAULT_MAX_ACKED_AHEAD_PER_PARTITION")
    delivery_counts: bool = _s(True, "Count each record's deliveries and answer delivery_count on every consume "
                               "(an extension). False: a topic without max_deliveries neither counts nor answers it "
                               "(Narad v3.1's consume answers, byte for byte); a topic with max_deliveries and a "
                               "dead-letter topic counts and answers it whatever this says.",
                               "NARAD_TOPIC_DELIVERY_COUNTS")
    idempotent_local_placement: bool = _s(
        True, "A record with an idempotency key and neither a message key nor a partition, whose key's partition "
        "is on this node and not moving, is committed into a partition of the worker that received it (its key "
        "checked in the node's claims table) instead of its key's partition: no spread over partitions, no hop "
        "to another worker. A partition move carries the keys homed at the moved partition. False: each such "
        "record goes to its key's partition, as before.", "NARAD_TOPIC_IDEMPOTENT_LOCAL_PLACEMENT")


@dataclass(frozen=True)
class FanoutConfig:
    max_batch_records: int = _s(4096, "Records a fan-out cursor reads into one slab at most (1-65536).",
                                "NARAD_FANOUT_MAX_BATCH_RECORDS")
    max_batch_bytes: int = _s(4194304, "Key and payload bytes of one fan-out slab at most (4096-8388608).",
                              "NARAD_FANOUT_MAX_BATCH_BYTES")
    linger_ms: int = _s(25, "How long a fan-out cursor waits for more records to fill a slab (0-1000).",
                        "NARAD_FANOUT_LINGER_MS")


@dataclass(frozen=True)
class SecurityConfig:
    enabled: bool = _s(True, "HTTP Basic auth and grants on every /v1 route.", "NARAD_SECURITY_ENABLED")
    allow_insecure_cluster: bool = _s(False, "Allow a multi-node cluster with security off (client API "
                                      "unauthenticated; NARAD_CLUSTER_SECRET is still required).",
                                      "NARAD_SECURITY_ALLOW_INSECURE_CLUSTER")
    allow_insecure_bind: bool = _s(False, "With security off, let http.host be an address other than loopback "
                                   "(anyone who reaches the port acts as an admin).",
                                   "NARAD_SECURITY_ALLOW_INSECURE_BIND")
    tls_cert_file: str = _s("", "PEM certificate for HTTP/3 (empty: self-signed, kept in <data_dir>/tls).",
                            "NARAD_SECURITY_TLS_CERT_FILE")
    tls_key_file: str = _s("", "PEM private key for tls_cert_file.", "NARAD_SECURITY_TLS_KEY_FILE")


@dataclass(frozen=True)
class LogConfig:
    level: str = _s("info", "debug, info, warning or error.", "NARAD_LOG_LEVEL")
    format: str = _s("json", "json (one object per line) or text.", "NARAD_LOG_FORMAT")


@dataclass(frozen=True)
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    topic: TopicConfig = field(default_factory=TopicConfig)
    fanout: FanoutConfig = field(default_factory=FanoutConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    log: LogConfig = field(default_factory=LogConfig)

    # ---- derived values -------------------------------------------------
    @property
    def node_id(self) -> str:
        return self.node.id or socket.gethostname()

    @property
    def data_dir(self) -> Path:
        return Path(self.node.data_dir).absolute()

    @property
    def runtime_dir(self) -> Path:
        return Path(self.node.runtime_dir).absolute() if self.node.runtime_dir else self.data_dir / "run"

    @property
    def control_socket(self) -> Path:
        return self.runtime_dir / "narad.sock"

    @property
    def peer_map(self) -> dict[str, str]:
        """node id -> Raft address, from cluster.peers."""
        out = {}
        for p in self.cluster.peers:
            nid, _, addr = p.partition("@")
            out[nid] = addr
        return out

    @property
    def clustered(self) -> bool:
        return bool(self.cluster.peers)

    @property
    def raft_port(self) -> int:
        return self.cluster.raft_port or self.http.port + 1

    @property
    def cluster_port(self) -> int:
        return self.cluster.cluster_port or self.http.port + 2

    def seconds(self, section: str, key: str) -> float:
        return parse_duration(getattr(getattr(self, section), key))


SECTIONS: dict[str, type] = {f.name: f.default_factory().__class__ for f in fields(Config)}  # type: ignore[misc]


def iter_settings() -> list[tuple[str, str, Any, dict[str, Any]]]:
    """(section, key, default, metadata) for every setting, in declaration order."""
    out = []
    for sec_name, cls in SECTIONS.items():
        inst = cls()
        for f in fields(cls):
            out.append((sec_name, f.name, getattr(inst, f.name), dict(f.metadata)))
    return out


def _coerce(section: str, key: str, value: Any, default: Any, kind: str | None, source: str) -> Any:
    name = f"{section}.{key}"
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and source != "file":
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        raise ConfigError(f"{name} must be true or false (from {source}), got {value!r}")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and source != "file":
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{name} must be an integer (from {source}), got {value!r}")
    if isinstance(default, list):
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return [v.strip() for v in value if v.strip()]
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        raise ConfigError(f"{name} must be a list of strings (from {source}), got {value!r}")
    if isinstance(default, str):
        if key == "workers" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            what = 'a duration string such as "10s"' if kind == "duration" else "a string"
            raise ConfigError(f"{name} must be {what} (from {source}), got {value!r}")
        if kind == "duration":
            try:
                parse_duration(value)
            except ValueError as e:
                raise ConfigError(f"{name}: {e} (from {source})") from None
        return value
    raise ConfigError(f"{name}: unsupported setting type")


def load_config(
    path: str | None = None,
    *,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Build the configuration: defaults < file < env < overrides ("section.key" -> value).

    ``path`` None means: $NARAD_CONFIG, else /etc/narad/narad.toml if it exists, else no file.
    """
    env = dict(os.environ) if env is None else env
    if path is None:
        path = env.get("NARAD_CONFIG") or (DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None)
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    defaults = {(s, k): (d, m) for s, k, d, m in iter_settings()}

    if path:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for sec, body in doc.items():
            if sec not in SECTIONS:
                raise ConfigError(f"unknown config section [{sec}] in {path}")
            if not isinstance(body, dict):
                raise ConfigError(f"unknown config key {sec!r} in {path} (settings live in sections)")
            for key, val in body.items():
                if (sec, key) not in defaults:
                    raise ConfigError(f"unknown config key {sec}.{key} in {path}")
                d, m = defaults[(sec, key)]
                values[sec][key] = _coerce(sec, key, val, d, m.get("kind"), f"file {path}")

    for (sec, key), (d, m) in defaults.items():
        name = m.get("env")
        if name and name in env:
            values[sec][key] = _coerce(sec, key, env[name], d, m.get("kind"), f"env {name}")

    for dotted, val in (overrides or {}).items():
        sec, _, key = dotted.partition(".")
        if (sec, key) not in defaults:
            raise ConfigError(f"unknown setting {dotted}")
        d, m = defaults[(sec, key)]
        values[sec][key] = _coerce(sec, key, val, d, m.get("kind"), "flag")

    cfg = Config(**{sec: SECTIONS[sec](**vals) for sec, vals in values.items()})
    if cfg.node.dev:
        cfg = replace(
            cfg,
            security=replace(cfg.security, enabled=False),
            http=replace(cfg.http, host="127.0.0.1"),
            cluster=replace(cfg.cluster, host="127.0.0.1"),
        )
    validate(cfg)
    return cfg


def worker_count(cfg: Config) -> int:
    if cfg.node.workers == "auto":
        return max(1, len(os.sched_getaffinity(0)))
    return int(cfg.node.workers)


MIN_CLUSTER_SECRET_BYTES = 32
MAX_PASSWORD_BYTES = 72  # bcrypt reads no further


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_start(cfg: Config, env: dict[str, str] | os._Environ[str]) -> bytes | None:
    """The node's own start checks on secrets that come from the environment only
    (naradctl loads the same configuration without them). Returns the cluster
    secret (None: unset, a lone node makes a random one); a problem is a
    ConfigError that stops the start with one line.

    A multi-node cluster always needs NARAD_CLUSTER_SECRET, whatever
    security.enabled says: it authenticates the Raft port, where pysyncobj
    unpickles what it receives, and the node RPC port."""
    secret = env.get("NARAD_CLUSTER_SECRET", "")
    if secret and len(secret.encode()) < MIN_CLUSTER_SECRET_BYTES:
        raise ConfigError(f"NARAD_CLUSTER_SECRET is {len(secret.encode())} bytes; it must be at least "
                          f"{MIN_CLUSTER_SECRET_BYTES} (e.g. openssl rand -hex 32), the same on every node")
    if cfg.clustered:
        if not secret:
            raise ConfigError("a multi-node cluster (cluster.peers) needs NARAD_CLUSTER_SECRET in the environment, "
                              f"at least {MIN_CLUSTER_SECRET_BYTES} bytes and the same on every node "
                              "(e.g. openssl rand -hex 32), whatever security.enabled says")
        if not cfg.security.enabled and not cfg.security.allow_insecure_cluster:
            raise ConfigError("a multi-node cluster with security off needs security.allow_insecure_cluster = true")
    admin = env.get("NARAD_ADMIN_PASSWORD", "")
    if len(admin.encode()) > MAX_PASSWORD_BYTES:
        raise ConfigError(f"NARAD_ADMIN_PASSWORD is {len(admin.encode())} bytes; passwords are at most "
                          f"{MAX_PASSWORD_BYTES} bytes (bcrypt): choose a shorter one")
    return secret.encode() if secret else None


def validate(cfg: Config) -> None:
    """Cross-field checks; every problem is a ConfigError naming the setting."""
    if not cfg.security.enabled and not is_loopback(cfg.http.host) and not cfg.security.allow_insecure_bind:
        raise ConfigError(f"security.enabled = false would serve the client API without authentication on "
                          f"{cfg.http.host}: set http.host to a loopback address (or use --dev), or set "
                          "security.allow_insecure_bind = true to accept that")
    w = cfg.node.workers
    if w != "auto" and (not w.isdigit() or not 1 <= int(w) <= 256):
        raise ConfigError(f"node.workers must be \"auto\" or a number from 1 to 256, got {w!r}")
    if cfg.seconds("node", "worker_stuck_after") < 1.0:
        raise ConfigError(f"node.worker_stuck_after must be at least 1s, got {cfg.node.worker_stuck_after!r}")
    for name, port in (("http.port", cfg.http.port), ("cluster.raft_port", cfg.cluster.raft_port),
                       ("cluster.cluster_port", cfg.cluster.cluster_port)):
        if not 0 <= port <= 65535 or (name == "http.port" and port == 0):
            raise ConfigError(f"{name} must be a port number, got {port}")
    if len({cfg.http.port, cfg.raft_port, cfg.cluster_port}) != 3:
        raise ConfigError("http.port, cluster.raft_port and cluster.cluster_port must differ")
    if cfg.http.max_header_bytes < 4096:
        raise ConfigError("http.max_header_bytes must be >= 4096")
    for key in ("max_connections", "max_consume_in_flight_per_identity", "max_produce_in_flight_per_identity"):
        if getattr(cfg.http, key) < 0:
            raise ConfigError(f"http.{key} must be >= 0")
    wait = cfg.seconds("http", "max_consume_wait")
    if wait > cfg.seconds("http", "shutdown_grace"):
        raise ConfigError(
            f"http.max_consume_wait ({cfg.http.max_consume_wait}) must be <= "
            f"http.shutdown_grace ({cfg.http.shutdown_grace})")
    t = cfg.topic
    if not 3 <= t.max_partitions <= 4096:
        raise ConfigError("topic.max_partitions must be between 3 and 4096")
    if not 3 <= t.default_partitions <= t.max_partitions:
        raise ConfigError("topic.default_partitions must be between 3 and topic.max_partitions")
    if t.default_retention_age_ms != 0 and t.default_retention_age_ms < 3_600_000:
        raise ConfigError("topic.default_retention_age_ms must be 0 (forever) or >= 3600000 (1 h)")
    if t.default_visibility_timeout_ms <= 0:
        raise ConfigError("topic.default_visibility_timeout_ms must be > 0")
    if t.default_retention_age_ms and t.default_visibility_timeout_ms > t.default_retention_age_ms:
        raise ConfigError("topic.default_visibility_timeout_ms must be <= topic.default_retention_age_ms")
    if t.default_max_in_flight_per_partition <= 0 or t.default_max_acked_ahead_per_partition <= 0:
        raise ConfigError("topic.default_max_in_flight/acked_ahead_per_partition must be > 0")
    if not 10 <= cfg.storage.consumer_offset_commit_interval_ms <= 60000:
        raise ConfigError("storage.consumer_offset_commit_interval_ms must be between 10 and 60000")
    for key in ("idle_log_eviction_ms", "cold_retention_walk_ms"):
        v = getattr(cfg.storage, key)
        if v != 0 and not 100 <= v <= 86_400_000:
            raise ConfigError(f"storage.{key} must be 0 (off) or between 100 and 86400000")
    if not 6 <= cfg.storage.idempotency_table_keys <= 6 << 24:
        raise ConfigError("storage.idempotency_table_keys must be between 6 and 100663296")
    f = cfg.fanout
    if not 1 <= f.max_batch_records <= 65536:
        raise ConfigError("fanout.max_batch_records must be between 1 and 65536")
    if not 4096 <= f.max_batch_bytes <= 8 << 20:
        raise ConfigError("fanout.max_batch_bytes must be between 4096 and 8388608")
    if not 0 <= f.linger_ms <= 1000:
        raise ConfigError("fanout.linger_ms must be between 0 and 1000")
    if cfg.log.level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log.level must be debug, info, warning or error, got {cfg.log.level!r}")
    if cfg.log.format not in ("json", "text"):
        raise ConfigError(f"log.format must be json or text, got {cfg.log.format!r}")
    if bool(cfg.security.tls_cert_file) != bool(cfg.security.tls_key_file):
        raise ConfigError("security.tls_cert_file and security.tls_key_file must be set together")
    for p in cfg.cluster.peers:
        nid, at, addr = p.partition("@")
        host, colon, port = addr.rpartition(":")
        if not at or not nid or not colon or not host or not port.isdigit():
            raise ConfigError(f"cluster.peers entry {p!r} must look like id@host:raft_port")
    peers = cfg.peer_map
    if len(peers) != len(cfg.cluster.peers):
        raise ConfigError("cluster.peers names a node id twice")
    for m in cfg.cluster.initial_members:
        if m not in peers:
            raise ConfigError(f"cluster.initial_members names {m!r}, which is not in cluster.peers")
    if cfg.cluster.peers and cfg.node_id in peers and cfg.node_id in cfg.cluster.initial_members:
        mine = f"{cfg.cluster.host}:{cfg.raft_port}"
        if peers[cfg.node_id] != mine:
            raise ConfigError(f"cluster.peers gives this node ({cfg.node_id}) the Raft address "
                              f"{peers[cfg.node_id]}, but it listens on {mine} (cluster.host, cluster.raft_port)")
    hb, dead = cfg.seconds("cluster", "heartbeat_interval"), cfg.seconds("cluster", "member_dead_after")
    if not 0.1 <= hb <= 60:
        raise ConfigError("cluster.heartbeat_interval must be between 100ms and 60s")
    if dead < 3 * hb:
        raise ConfigError(f"cluster.member_dead_after ({cfg.cluster.member_dead_after}) must be at least three "
                          f"heartbeat intervals ({cfg.cluster.heartbeat_interval})")
    if not 0 <= cfg.cluster.newest_entry_type <= 255:
        raise ConfigError("cluster.newest_entry_type must be between 0 and 255 (0: this build's newest)")
    if cfg.cluster.max_voters < 1:
        raise ConfigError("cluster.max_voters must be >= 1")
    if cfg.cluster.raft_snapshot_threshold < 16:
        raise ConfigError("cluster.raft_snapshot_threshold must be >= 16")
    lo = cfg.seconds("cluster", "raft_election_timeout_min")
    hi = cfg.seconds("cluster", "raft_election_timeout_max")
    if not 0.1 <= lo < hi:
        raise ConfigError("cluster.raft_election_timeout_min must be >= 100ms and below ..._max")
    if cfg.seconds("cluster", "write_timeout") < 1:
        raise ConfigError("cluster.write_timeout must be >= 1s")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", cfg.node_id):
        raise ConfigError(f"node.id must be 1-64 characters [A-Za-z0-9._-], got {cfg.node_id!r}")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(f'"{x}"' for x in v) + "]"
    return f'"{v}"'


def render_toml() -> str:
    """The documented default configuration (config/narad.toml is this text)."""
    lines = [
        "# narad node configuration: every setting with its default.",
        "# Precedence: defaults < this file < NARAD_* environment < command-line flags.",
        "# Unknown sections or keys stop the start. Durations are strings such as \"10s\".",
        "# Secrets are never read from this file: NARAD_ADMIN_PASSWORD and NARAD_CLUSTER_SECRET",
        "# come from the environment only.",
    ]
    current = None
    for sec, key, default, meta in iter_settings():
        if sec != current:
            lines += ["", f"[{sec}]"]
            current = sec
        env = f" (env {meta['env']})" if meta.get("env") else ""
        lines.append(f"# {meta['doc']}{env}")
        lines.append(f"{key} = {_toml_value(default)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_toml(), end="")
