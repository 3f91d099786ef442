"""``narad-supervisor``: the node. Its boot order is the checklist in
``Supervisor.boot`` below; the comment on each step says why it sits there.

The supervisor owns the data directory, runs the Raft node and the metastore
FSM (the only LMDB writer), the controller duties, the naradctl control
socket and the worker RPC socket, and keeps N workers running (forked from
the fork server, each pinned to a core, each serving HTTP/1.1 and HTTP/3 on
sockets the supervisor created once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import platform
import shutil
import signal
import ssl
import sys
import time
from collections import deque
from pathlib import Path

import uvloop

from narad import BUILD, __version__, logs, metrics
from narad.broker.caps import CapTable
from narad.broker.caps import shm_name_for as caps_shm_name_for
from narad.broker.idem_claims import ClaimTable, buckets_for
from narad.broker.idem_claims import shm_name_for as claims_shm_name_for
from narad.cluster import rpc_auth
from narad.cluster.transport import NodeRpcClient
from narad.config import Config, check_start, load_config, worker_count
from narad.errors import ConfigError, FailStop, NaradError, Unavailable
from narad.ipc import rpc
from narad.ipc.proctitle import set_title
from narad.meta import commands as C
from narad.meta import fsm as F
from narad.meta import requests as Q
from narad.meta import restart as RS
from narad.meta import versions as V
from narad.meta.raft import RaftNode, raft_password, read_snapshot_header
from narad.meta.records import MemberRecord
from narad.meta.service import MetaService
from narad.meta.store import MetaStore
from narad.supervisor import sdnotify, tls
from narad.supervisor.controller import Controller
from narad.supervisor.forkserver import ForkServer
from narad.supervisor.metadata import MetadataRouter
from narad.supervisor.metrics_listener import MetricsListener, parse_addr
from narad.supervisor.services import LoginThrottle, control_service, worker_service
from narad.supervisor.sockets import DataDirLock, check_port_free, make_client_sockets, make_cluster_sockets
from narad.supervisor.workers import WorkerManager
from narad.worker import main as worker_main

log = logging.getLogger("narad.supervisor")

READY_EVERY = 0.1
READER_CHECK_EVERY = 5.0
JOIN_EVERY = 2.0
LEADERLESS_PROBE = 15.0  # a member without a leader this long asks whether it was removed
METRICS_POLL_EVERY = 10.0
VITALS_EVERY = 5.0  # data directory size and free bytes
LEADER_CONTACT_FRESH = 5.0
TRANSFER_RETRY = 0.25  # a graceful stop asks for a leadership transfer again this often (pysyncobj drops a denied one)
# Readiness only: a replica is "behind" once it has not applied the commit index
# it saw this long ago (commit -> apply lag of ordinary writes is not behind).
# Destructive decisions use RaftNode.caught_up(), which has no such grace.
APPLY_GRACE = 1.5
ORPHAN_SWEEP_WAIT = 60.0  # the startup orphan sweep waits this long for a caught-up replica, else skips


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="narad-supervisor", description="Run a narad node.")
    p.add_argument("--config", help="TOML config file (default: $NARAD_CONFIG or /etc/narad/narad.toml)")
    p.add_argument("--data-dir", help="data directory (node.data_dir)")
    p.add_argument("--port", type=int, help="client port, TCP and UDP (http.port)")
    p.add_argument("--raft-port", type=int, help="Raft port (cluster.raft_port; default port+1)")
    p.add_argument("--cluster-port", type=int, help="node RPC port, TLS/TCP (cluster.cluster_port; default port+2)")
    p.add_argument("--node-id", help="node id (node.id)")
    p.add_argument("--workers", help='worker processes: a number or "auto" (node.workers)')
    p.add_argument("--peers", help="cluster nodes as id@host:raft_port,... (cluster.peers)")
    p.add_argument("--initial-members", help="node ids that bootstrap the cluster: id,id,... (cluster.initial_members)")
    p.add_argument("--dev", action="store_true", help="security off, every listener on 127.0.0.1")
    return p.parse_args(argv)


def overrides_from(ns: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    for flag, key in (("data_dir", "node.data_dir"), ("port", "http.port"), ("raft_port", "cluster.raft_port"),
                      ("cluster_port", "cluster.cluster_port"), ("node_id", "node.id"), ("workers", "node.workers"),
                      ("peers", "cluster.peers"), ("initial_members", "cluster.initial_members")):
        val = getattr(ns, flag)
        if val is not None:
            out[key] = str(val) if key == "node.workers" else val
    if ns.dev:
        out["node.dev"] = True
    return out


class Supervisor:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.data_dir = cfg.data_dir
        self.runtime_dir = cfg.runtime_dir
        self.n_workers = worker_count(cfg)
        # The newest Raft entry type this node applies and reports (a setting can stand in
        # for an older release; it can never claim more than this build applies).
        self.applies = C.types_up_to(cfg.cluster.newest_entry_type or C.NEWEST_ENTRY_TYPE)
        self.newest_type = max(self.applies)
        self.raft_addr = f"{cfg.cluster.host}:{cfg.raft_port}"
        self.throttle = LoginThrottle()
        self.exit_code = 0
        self.metrics = None
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop: asyncio.Event | None = None
        self._ready = False
        self._notified = False
        self.reconcile_done = False
        self.create_gate: asyncio.Event | None = None
        self.startup_commit_index = 0
        self._commit_seen: deque[tuple[float, int]] = deque()  # (when, commit target) as readiness saw it
        self.admitted = asyncio.Event()
        self.raft_mode = "single"
        self.join_rounds = 0
        self.removed = False  # the leader refused this node's id: it was decommissioned
        self.worker_conns: dict[int, rpc.Connection] = {}
        self.worker_metrics: dict[int, list[metrics.Family]] = {}  # last snapshot per worker pid
        self.retired_metrics: list[metrics.Family] = []  # counters of workers that died
        self.t_started = time.monotonic()  # for narad_boot_duration_seconds
        self.metrics_listener: MetricsListener | None = None
        self._older_joiner_logged: dict[str, float] = {}  # node id -> when its refusal was last logged
        self._tombstones_clearing: set[str] = set()  # removed ids rejoining with an empty disk (leader)
        self._backlog_cache: tuple[float, int] | None = None  # (when, value) of the heartbeat's dispatch backlog

    # ------------------------------------------------------------------------
    # Boot checklist. Steps 1-9 run before any thread or event loop exists.
    # ------------------------------------------------------------------------
    def boot_process(self) -> None:
        cfg = self.cfg
        # 0. Start checks (narad.config.check_start): a cluster always has a real
        #    node RPC and Raft secret (>= 32 bytes, env only), whatever
        #    security.enabled says; NARAD_ADMIN_PASSWORD fits bcrypt. A lone node
        #    without a secret makes its own.
        self.secret = check_start(cfg, os.environ) or os.urandom(32)
        # 1. The data directory exists and is ours alone (exclusive flock), so two
        #    supervisors can never write one FSM or one Raft log.
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.lock = DataDirLock(self.data_dir)
        self.lock.acquire()
        #    The restart table (seed "Restarts"): from the FSM, the Raft log and
        #    snapshots, and how this node enters Raft, decide to keep the FSM,
        #    restore the latest snapshot over it (step 8), set it aside as
        #    fsm.stale, or refuse to start with every file untouched.
        self.fsm_path = F.fsm_dir(self.data_dir)
        self.restart = self._restart_decision()
        # 2. The runtime directory holds the control socket (naradctl), the worker
        #    socket and the metrics files; stale ones from a crash are replaced.
        self.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.runtime_dir, 0o700)
        # 3. This process's metrics (workers start their own after fork; the
        #    supervisor merges them all when /metrics is scraped).
        self.metrics = metrics.setup()
        self.metrics.build_info.labels(__version__, platform.python_version()).set(1)
        set_title("narad: supervisor")
        # 4. The QUIC certificate: configured files, or a self-signed pair made at
        #    first start and kept in the data directory.
        if cfg.security.tls_cert_file:
            self.cert_file, self.key_file = cfg.security.tls_cert_file, cfg.security.tls_key_file
            # Loaded once here, so a missing or mismatched pair stops the start with one
            # line (exit 2) instead of every worker failing to serve HTTP/3 in a loop.
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"security.tls_cert_file / security.tls_key_file could not be loaded "
                                  f"({self.cert_file}, {self.key_file}): {e}") from None
        else:
            c, k = tls.ensure_self_signed(self.data_dir / "tls", self.node_id)
            self.cert_file, self.key_file = str(c), str(k)
        # 5. The shared version array: unlinked and recreated (a crash leaves the
        #    old segment in /dev/shm); workers attach to it by name, read-only.
        self.versions = V.VersionTable.create(V.shm_name_for(str(self.data_dir)))
        self.versions.store(V.WORKERS, self.n_workers)
        self.versions.store(V.READY_REASON, 1)
        self.versions.hb.beat(V.HB_SUPERVISOR)  # stamped from the loop's heartbeat task once it runs
        self.caps = CapTable.create(caps_shm_name_for(str(self.data_dir)), self.n_workers)
        #    The idempotency claims table (narad.broker.idem_claims): recreated empty; every
        #    worker maps it read-write and fills it from its partitions' logs as they open.
        self.claims = ClaimTable.create(claims_shm_name_for(str(self.data_dir)),
                                        buckets_for(cfg.storage.idempotency_table_keys))
        self.claims.set_workers(self.n_workers)  # (keyed commits wait until each loaded its keys)
        # 6. The client sockets: N TCP listeners and N UDP sockets, SO_REUSEPORT,
        #    created once and kept for the supervisor's life (a restarted worker
        #    gets its predecessor's pair, so the reuseport group never changes).
        self.sockets = make_client_sockets(cfg.http.host, cfg.http.port, self.n_workers, quic=cfg.http.quic)
        #    The Raft port is bound by pysyncobj at step 10; a holder is found now.
        check_port_free(cfg.cluster.host, cfg.raft_port, "Raft")
        #    The same for the node RPC port (TLS over TCP): one listener per worker.
        self.cluster_sockets = make_cluster_sockets(cfg.cluster.host, cfg.cluster_port, self.n_workers)
        #    The separate metrics listener (http.metrics_addr) binds in the loop (step 14);
        #    a bad address or a port someone holds stops the start now, with one line.
        self.metrics_addr = parse_addr(cfg.http.metrics_addr) if cfg.http.metrics_addr else None
        if self.metrics_addr is not None:
            check_port_free(self.metrics_addr[0], self.metrics_addr[1], "metrics")
        # 7. The fork server, forked now: this process still has no threads, no
        #    event loop and no LMDB environment to copy into workers.
        spec = worker_main.WorkerSpec(
            cfg=cfg, node_id=self.node_id, sockets=self.sockets, shm_name=self.versions.name,
            caps_name=self.caps.name, claims_name=self.claims.name, data_dir=self.data_dir,
            runtime_dir=self.runtime_dir,
            fsm_path=self.fsm_path, worker_socket=self.runtime_dir / "worker.sock",
            cluster_sockets=self.cluster_sockets, secret=self.secret,
            cert_file=self.cert_file, key_file=self.key_file,
            workers=self.n_workers,
        )
        def portable() -> tuple[str, object, list[int]]:
            # What a replacement fork server (a fresh interpreter) needs: the spec
            # with descriptor numbers for sockets, and those descriptors.
            pspec, fds = worker_main.portable_spec(spec)
            return "narad.worker.main:forkserver_entry", pspec, fds

        # The node-RPC key is derived from the secret here (PBKDF2, ~80 ms, before any
        # loop runs) so every worker forked below inherits it instead of deriving its own.
        rpc_auth.warm(self.secret)
        self.forkserver = ForkServer(lambda index, core: worker_main.run(spec, index, core),
                                     hb_name=self.versions.hb.name, portable=portable)
        self.forkserver.start(close_fds=(self.lock.fd,))
        # 8. The FSM (LMDB writer) opens only after the fork server exists, so no
        #    child ever inherits this environment. Leftovers of an interrupted
        #    snapshot or restore are removed first.
        F.remove_leftovers(self.fsm_path)
        if self.restart.action == RS.ASIDE:
            moved = RS.set_aside(self.fsm_path)
            log.warning(f"metastore: {self.restart.reason}", extra={"moved_to": str(moved)})
        elif self.restart.action == RS.UNTRUSTED:
            log.error(f"metastore: {self.restart.reason}")
        self.fsm = F.FSM(self.fsm_path, on_commit=self._on_fsm_commit, applies=self.applies)
        if self.restart.action == RS.RESTORE:
            log.info(f"metastore: {self.restart.reason}")
            snap = self.raft_dir / "snapshots" / "latest.snap"
            header, offset = read_snapshot_header(snap)
            try:
                self.fsm.restore_from(str(snap), offset, int(header["fsm_index"]))
            except FailStop as e:
                raise RuntimeError(str(e)) from None
        self.fsm.on_replace = self._on_fsm_replaced
        self.store = MetaStore(self.fsm_path, self.versions, fsm=self.fsm)
        self.versions.store(V.APPLIED_INDEX, self.fsm.applied_index)
        cores = sorted(os.sched_getaffinity(0)) if cfg.node.pin_workers else []
        self.worker_cores: list[int | None] = list(cores) if cores else [None]
        if cfg.node.pin_workers and self.n_workers > len(cores):
            log.warning("more workers than usable cores; some share a core",
                        extra={"workers": self.n_workers, "cores": len(cores)})

    async def boot_loop(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.create_gate = asyncio.Event()
        # 9. Signals: SIGTERM/SIGINT stop gracefully from here on.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        #    Fault seam (tests): SIGUSR2 blocks this loop (not the process, not
        #    Raft's tick thread) for NARAD_FAULT_BLOCK_LOOP_ON_USR2 seconds.
        if block := os.environ.get("NARAD_FAULT_BLOCK_LOOP_ON_USR2"):
            loop.add_signal_handler(signal.SIGUSR2, time.sleep, float(block))
        #    The heartbeat loop starts with the loop: it stamps this process's
        #    heartbeat, watches the workers' and the fork server's, feeds
        #    systemd's watchdog and keeps STATUS= current (ends after Raft closes).
        self._hb_task = asyncio.create_task(self._heartbeat_loop())
        # 10. Raft starts (its tick thread replays the log into the FSM, skipping
        #     what the FSM already holds). The commit index persisted on this disk
        #     is remembered: the node is not ready until its FSM reaches it.
        self.raft = RaftNode(
            self_addr=self.raft_addr, peers=[], raft_dir=self.raft_dir, sm=self.fsm,
            loop=loop, password=raft_password(self.secret), bind_host=cfg.cluster.host,
            election_timeout=(cfg.seconds("cluster", "raft_election_timeout_min"),
                              cfg.seconds("cluster", "raft_election_timeout_max")),
            snapshot_threshold=cfg.cluster.raft_snapshot_threshold,
            on_state_change=self._on_raft_role, on_fail_stop=self._on_fail_stop,
            on_commit=self._on_raft_tick,
            on_snapshot_failure=lambda: loop.call_soon_threadsafe(self._on_snapshot_failure),
        )
        self.raft.max_voters = cfg.cluster.max_voters
        self.raft.join_policy = self._join_policy
        self.meta = MetaService(cfg, self.raft, self.store, self.node_id, applies=self.applies)
        self.rpc_client = NodeRpcClient(self.secret)
        self.router = MetadataRouter(node_id=self.node_id, meta=self.meta, raft=self.raft, store=self.store,
                                     applied=lambda: self.versions.load(V.APPLIED_INDEX), client=self.rpc_client,
                                     write_timeout=cfg.seconds("cluster", "write_timeout"))
        #     How this node enters Raft: alone; as an initial member bootstrapping
        #     the same voter set as its peers; with the configuration it had
        #     before a restart; or join-only (admitted by the leader first, never
        #     bootstrapping a cluster of its own).
        self.raft_mode = self._raft_mode()
        if self.raft_mode == "join":
            self._tasks.append(asyncio.create_task(self._join_loop()))
        else:
            self._start_raft()
        if self.cfg.peer_map and self.raft_mode != "single":
            # A member that hears no leader for LEADERLESS_PROBE asks its peers to admit
            # it: the leader answers 409 "removed" to a decommissioned node's id.
            self._tasks.append(asyncio.create_task(self._removal_probe()))
        # 11. Local RPC: the worker socket (metadata writes, throttle) and the
        #     naradctl control socket, both mode 0600.
        self._servers.append(await rpc.serve_unix(str(self.runtime_dir / "worker.sock"),
                                                  lambda: worker_service(self)))
        self._servers.append(await rpc.serve_unix(str(cfg.control_socket), lambda: control_service(self)))
        # 12. Workers: forked from the fork server onto their socket pair, pinned.
        self.forkserver.attach(loop)
        self.workers = WorkerManager(self.forkserver, self.n_workers, self.worker_cores,
                                     on_exit=self._on_worker_exit, heartbeats=self.versions.hb,
                                     on_fatal=self._on_fatal)
        self.workers.start_all()
        # 13. Controller duties (member registration and heartbeats everywhere;
        #     root admin seeding, placement and dead marking on the leader).
        host = cfg.cluster.host if cfg.http.host in ("0.0.0.0", "::") else cfg.http.host
        member = MemberRecord(id=self.node_id, raft_addr=self.raft_addr, client_addr=f"{host}:{cfg.http.port}",
                              cluster_addr=f"{cfg.cluster.host}:{cfg.cluster_port}", build=BUILD,
                              newest_entry_type=self.newest_type, entry_types=sorted(self.applies))
        self.member = member
        self.controller = Controller(self.meta, self.router, member=member, data_dir=self.data_dir,
                                     security=cfg.security.enabled, versions=self.versions,
                                     heartbeat_every=cfg.seconds("cluster", "heartbeat_interval"),
                                     dead_after=cfg.seconds("cluster", "member_dead_after"),
                                     backlog=self._dispatch_backlog)
        self._tasks.append(asyncio.create_task(self.controller.run()))
        # 14. Readiness is recomputed continuously and published in shared memory;
        #     the metrics listener (http.metrics_addr) answers from here on.
        self._tasks.append(asyncio.create_task(self._readiness_loop()))
        self._tasks.append(asyncio.create_task(self._housekeeping_loop()))
        self._tasks.append(asyncio.create_task(self._vitals_loop()))
        if self.metrics_addr is not None:
            self.metrics_listener = MetricsListener(self.versions, self.n_workers, self.node_metrics)
            await self.metrics_listener.start(*self.metrics_addr)
        # 15. Startup reconcile, then the create gate opens: topic creates on every
        #     transport wait until here, and /readyz reports ready only after.
        self._tasks.append(asyncio.create_task(self._startup_reconcile()))
        # 16. The startup orphan sweep: topic directories of incarnations that are
        #     gone, removed only once this replica is provably current (60 s at
        #     most, else skipped) and the leader confirms each one gone.
        self._tasks.append(asyncio.create_task(self._orphan_sweep()))
        log.info("http listening", extra={"port": cfg.http.port, "workers": self.n_workers, "node": self.node_id,
                                          "raft": self.raft_addr, "security": cfg.security.enabled})

    # ---- entering Raft ---------------------------------------------------------------
    @property
    def raft_dir(self) -> Path:
        return self.data_dir / "metastore" / "raft"

    def _restart_decision(self) -> RS.Decision:
        """Read the FSM and the Raft state (writing nothing) and apply the restart
        table. A refusal raises: the node exits 2 with the reason, files untouched."""
        fsm_state = RS.inspect_fsm(self.fsm_path)
        raft_state = RS.inspect_raft(self.raft_dir)
        # Only a join-only node enters a cluster that is already running (it is
        # admitted by the leader, never bootstraps); any other start could found one.
        joining = (self.cfg.clustered and not (self.raft_dir / "cluster.json").exists()
                   and self.node_id not in self.cfg.cluster.initial_members)
        d = RS.decide(fsm_state, raft_state, joining=joining, applies=self.applies)
        log.info(f"metastore: restart decision: {d.reason}", extra={
            "action": d.action, "fsm_index": fsm_state.index, "index_trusted": fsm_state.trusted,
            "log_first": raft_state.log_first, "log_last": raft_state.log_last,
            "snapshot_index": raft_state.snapshot_index, "joining": joining})
        if d.action == RS.REFUSE:
            raise RuntimeError(f"metastore: {d.reason}")
        return d

    def _raft_mode(self) -> str:
        if not self.cfg.clustered:
            return "single"
        if self.raft.load_cluster_file() is not None:
            return "rejoin"
        if self.node_id in self.cfg.cluster.initial_members:
            return "bootstrap"
        return "join"

    def _start_raft(self, voters: list[str] | None = None, readonly: bool = False) -> None:
        if voters is None:
            if self.raft_mode == "rejoin":
                saved = self.raft.load_cluster_file() or {}
                voters, readonly = list(saved.get("voters", [])), bool(saved.get("readonly"))
            elif self.raft_mode == "bootstrap":
                peers = self.cfg.peer_map
                voters = [peers[m] for m in self.cfg.cluster.initial_members]
            else:
                voters = []
        self.raft.start(voters, readonly=readonly)
        self.startup_commit_index = self.raft.status().persisted_commit_index
        self.admitted.set()
        log.info("raft started", extra={"mode": self.raft_mode, "voters": voters, "readonly": readonly})

    async def _join_loop(self) -> None:
        """Join-only: ask the configured peers every 2 s until the leader admits
        this node. Until then the node is not ready and Raft does not run."""
        req = {"node_id": self.node_id, "raft_addr": self.raft_addr, "build": BUILD,
               "newest_entry_type": self.newest_type, "entry_types": sorted(self.applies)}
        # An empty data dir (no metadata, no partition directory) may clear a tombstone
        # its id left when it was decommissioned: it joins as a new node.
        topics = self.data_dir / "topics"
        req["empty_disk"] = self.fsm.is_empty() and not (topics.is_dir() and any(topics.iterdir()))
        peers = [addr for nid, addr in self.cfg.peer_map.items() if nid != self.node_id]
        last_refusal = 0.0
        while True:
            self.join_rounds += 1
            for addr in peers:
                ans = await asyncio.to_thread(self.raft.request_join, addr, req)
                hops = 0
                while ans.get("status") == 421 and ans.get("leader") and hops < 4:
                    hops += 1
                    ans = await asyncio.to_thread(self.raft.request_join, ans["leader"], req)
                status = ans.get("status")
                if status == 200:
                    voters = list(ans.get("voters", []))
                    readonly = not ans.get("voter", False)
                    log.info("admitted to the cluster", extra={"voters": voters, "voter": not readonly})
                    if os.environ.get("NARAD_FAULT_CRASH_AFTER_ADMIT") == "1":
                        # Test seam, never set in production: die like kill -9 between
                        # admission and registration (a Raft server without a member record).
                        log.error("fault injection: crashing after admission")
                        os.killpg(0, signal.SIGKILL)
                    self._start_raft(voters, readonly=readonly)
                    return
                if status == 409 and time.monotonic() - last_refusal > 60:
                    last_refusal = time.monotonic()
                    log.error("cluster join refused", extra={"code": ans.get("code"), "error": ans.get("error")})
            await asyncio.sleep(JOIN_EVERY)

    async def _removal_probe(self) -> None:
        """A decommissioned node is removed from the Raft voters first, so it never
        receives the entry that removes its member record and leaves its tombstone:
        it just stops hearing a leader. After LEADERLESS_PROBE without one, ask the
        peers the way a joiner does; the leader refuses a removed id with 409
        ``removed``: say so at error, report not ready with the reason, and stop
        Raft (its elections would only be ignored)."""
        since: float | None = None
        while not self.removed:
            await asyncio.sleep(2.0)
            if self.raft_mode == "join" and not self.admitted.is_set():
                continue  # the join loop asks already
            st = self.raft.status()
            if st.leader is not None and st.role in ("leader", "follower"):
                since = None
                continue
            now = time.monotonic()
            since = since or now
            if now - since < LEADERLESS_PROBE:
                continue
            since = now  # next probe after another LEADERLESS_PROBE
            req = {"node_id": self.node_id, "raft_addr": self.raft_addr, "build": BUILD,
                   "newest_entry_type": self.newest_type, "entry_types": sorted(self.applies), "probe": True}
            for nid, addr in self.cfg.peer_map.items():
                if nid == self.node_id:
                    continue
                ans = await asyncio.to_thread(self.raft.request_join, addr, req)
                hops = 0
                while ans.get("status") == 421 and ans.get("leader") and hops < 4:
                    hops += 1
                    ans = await asyncio.to_thread(self.raft.request_join, ans["leader"], req)
                if ans.get("status") == 409 and ans.get("code") == "removed":
                    self.removed = True
                    log.error("this node was removed from the cluster (decommissioned); it stops taking part. "
                              "To rejoin, start it with an empty data directory: it joins as a new node",
                              extra={"node": self.node_id, "leader_said": ans.get("error")})
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(self.raft.close)
                    return
                if ans.get("status") in (200, 409):
                    break  # the leader answered: still a server (a partition, not a removal) or refused otherwise

    def _join_policy(self, req: dict[str, object]) -> tuple[int, dict[str, object]] | None:
        """Leader, tick thread: refuse a joiner older than the cluster (it would
        skip entries the cluster already uses) or one that was removed."""
        node_id = str(req.get("node_id", ""))
        newest = int(req.get("newest_entry_type", 0) or 0)  # type: ignore[call-overload]
        listed = req.get("entry_types") or []
        joiner = C.types_reported([int(t) for t in listed] if isinstance(listed, list) else [], newest)
        with self.fsm.env.begin() as txn:
            from narad.meta.store import Reader

            r = Reader(txn, self.fsm.dbs)
            if txn.get(node_id.encode(), db=self.fsm.dbs["removed_members"]) is not None:
                if req.get("empty_disk") is True:
                    self.raft.loop.call_soon_threadsafe(self._clear_tombstone, node_id)
                    return 503, {"code": "removed", "error": f"node {node_id} was removed from the cluster; it "
                                                             "rejoins with an empty data dir: its tombstone is "
                                                             "being cleared, retry"}
                return 409, {"code": "removed", "error": f"node {node_id} was removed from the cluster; it "
                                                         "rejoins only with an empty data dir"}
            members = [m for m in r.members() if m.id != node_id]
            known = self.raft.voters()
            if str(req.get("raft_addr")) in known:
                return None  # already a server: never refused (its heartbeats hold new types back)
            # Older: it lacks a type the cluster already applied, or one every member applies.
            everywhere = frozenset.intersection(*[C.types_reported(m.entry_types, m.newest_entry_type)
                                                  for m in members]) if members else frozenset()
            missing = (self.fsm.applied_types | everywhere) - joiner
            if missing:
                why = (f"node {node_id} (newest entry type {newest}) does not apply entry types "
                       f"{sorted(missing)} that the cluster uses: upgrade it first")
                now = time.monotonic()
                if now - self._older_joiner_logged.get(node_id, -1e9) >= 60.0:  # once a minute per joiner
                    self._older_joiner_logged[node_id] = now
                    log.error("refused an older joiner", extra={"node": node_id, "error": why})
                return 409, {"code": "older_release", "error": why}
        return None

    async def _startup_reconcile(self) -> None:
        await self.admitted.wait()
        # The FSM must hold everything this disk knew to be committed (Felix
        # finding: a restart is not done until the state machine is).
        while self.raft.status().applied_index < self.startup_commit_index:
            await asyncio.sleep(0.01)
        await self.controller.registered.wait()
        if self.cfg.security.enabled:
            # With security on nothing can be served before the root admin exists.
            while True:
                with self.store.read() as r:
                    if r.root_user() is not None:
                        break
                await asyncio.sleep(0.02)
        # Every worker accepts connections (readiness also follows restarts below).
        await self.workers.wait_serving(60.0)
        self.reconcile_done = True
        assert self.create_gate is not None
        self.create_gate.set()
        log.info("startup reconcile finished", extra={"applied_index": self.fsm.applied_index})

    async def _orphan_sweep(self) -> int:
        """Remove ``topics/<name>@<id>/`` directories whose incarnation is gone.
        The local replica may be stale (restored from an old snapshot, still
        replaying): every doubt keeps the directory."""
        topics_dir = self.data_dir / "topics"
        if not topics_dir.is_dir():
            return 0
        await self.admitted.wait()
        deadline = time.monotonic() + ORPHAN_SWEEP_WAIT
        while not self.raft.caught_up():
            if time.monotonic() > deadline:
                log.warning("orphan sweep skipped: this replica did not catch up with the leader within 60 s")
                return 0
            await asyncio.sleep(0.1)
        candidates = []
        for d in sorted(topics_dir.iterdir()):
            name, sep, tid = d.name.rpartition("@")
            if not sep or not d.is_dir():
                continue
            t = self.store.topic(name)
            if t is not None and t.id == tid:
                continue
            candidates.append((d, name, tid))
        removed = 0
        for d, name, tid in candidates:
            try:
                ans = await self.router.execute(Q.ConfirmGoneReq(name, tid))
                gone = bool(ans.gone)
            except Exception as e:
                log.info("orphan sweep: kept a directory (the leader did not answer)",
                         extra={"topic": name, "id": tid, "err": str(e)})
                continue
            if not gone:
                log.info("orphan sweep: kept a directory the leader does not confirm gone",
                         extra={"topic": name, "id": tid})
                continue
            await asyncio.to_thread(shutil.rmtree, d, True)
            removed += 1
            log.info("orphan sweep: removed the data of a deleted topic incarnation (leader-confirmed)",
                     extra={"topic": name, "id": tid})
        log.info("orphan sweep finished", extra={"candidates": len(candidates), "removed": removed})
        return removed

    async def current_replica(self) -> None:
        """Return once this node's replica is provably current: on the leader after
        a barrier (everything committed applied), on a follower when it heard from
        the leader within 5 s and applied everything it knows committed."""
        if self.raft.is_leader():
            await self.meta.barrier()
            return
        if not self.raft.caught_up():
            raise Unavailable("this node's metastore replica is not provably current (no leader contact within "
                              "5 s, or committed entries not applied yet); retry, or run this on the leader",
                              headers=[("Retry-After", "1")])

    async def wait_create_gate(self) -> None:
        assert self.create_gate is not None
        if self.create_gate.is_set():
            return
        try:
            await asyncio.wait_for(self.create_gate.wait(), self.cfg.seconds("cluster", "write_timeout"))
        except TimeoutError:
            raise Unavailable("the node is still starting (startup reconcile); retry",
                              headers=[("Retry-After", "1")]) from None

    # ---- callbacks ------------------------------------------------------------
    def _on_snapshot_failure(self) -> None:
        self.metrics.snapshot_failures.inc()
        self.metrics.errors.labels("metastore", "snapshot_failed").inc()

    def _on_fsm_commit(self, touched: set[int], applied: int) -> None:
        """Tick thread, after the LMDB commit: move the counters workers watch."""
        if touched:
            self.versions.bump(touched)
        self.versions.store(V.APPLIED_INDEX, applied)

    def _on_fsm_replaced(self) -> None:
        self.versions.bump([V.EPOCH])
        self.versions.bump_all()
        self.versions.store(V.APPLIED_INDEX, self.fsm.applied_index)

    def _on_raft_role(self, role: str) -> None:
        self.versions.bump([V.RAFT])
        log.info("raft role changed", extra={"role": role})

    def _on_fail_stop(self, e: FailStop) -> None:
        self.metrics.errors.labels("metastore", "fail_stop").inc()
        self.versions.store(V.FAIL_STOPPED, 1)
        self.versions.store(V.READY, 0)
        self.meta.stopped = True
        self.exit_code = 1
        # Raft first: from now on this node neither votes, leads nor acknowledges
        # entries its replica lacks; the rest of the shutdown follows.
        self._tasks.append(asyncio.ensure_future(asyncio.to_thread(self.raft.close)))
        assert self._stop is not None
        self._stop.set()

    def _on_raft_tick(self) -> None:
        """Tick thread, at the end of every tick: Raft's heartbeat."""
        self.versions.hb.beat(V.HB_RAFT)

    def _on_fatal(self, message: str) -> None:
        """The node cannot go on (the fork server keeps dying): stop gracefully, exit 1."""
        self.exit_code = 1
        assert self._stop is not None
        self._stop.set()

    def _clear_tombstone(self, node_id: str) -> None:
        """Leader, loop: delete the tombstone of a removed node that asks to join with
        an empty data dir (type 42 with clear_tombstone); its next join request passes."""
        if node_id in self._tombstones_clearing:
            return
        self._tombstones_clearing.add(node_id)

        async def clear() -> None:
            try:
                if self.meta.use_type(C.EntryType.REMOVE_MEMBER):
                    res = await self.meta.write(C.RemoveMember(node_id, clear_tombstone=True))
                    log.info("tombstone cleared: a removed node rejoins with an empty data dir",
                             extra={"node": node_id, "outcome": res.message or "ok"})
            except NaradError as e:
                log.warning("clearing a tombstone failed; the node's next join retries", extra={"node": node_id,
                                                                                                "err": str(e)})
            finally:
                self._tombstones_clearing.discard(node_id)

        self._tasks.append(asyncio.create_task(clear()))

    async def _dispatch_backlog(self) -> int:
        """Records in this node's ingress WALs not yet confirmed at their owner (staged
        plus accepted, every worker, as of its last second), for the heartbeat; -1 unknown.
        The workers set those gauges once a second: asked at most that often (a short
        heartbeat interval does not gather every worker's metrics four times a second)."""
        now = time.monotonic()
        cached = self._backlog_cache
        if cached is not None and now - cached[0] < 1.0:
            return cached[1]
        families = await self._gather_metrics()
        names = ("narad_ingress_wal_pending_records", "narad_ingress_dispatch_backlog_records")
        found = [f for f in families if f.name in names and f.samples]
        value = -1
        if found and len(self.worker_metrics) >= sum(1 for w in self.workers.workers if w.alive):
            value = int(sum(v[0] for f in found for _, v in f.samples))
        self._backlog_cache = (now, value)
        return value

    def _on_worker_exit(self, pid: int) -> None:
        with contextlib.suppress(Exception):
            self.fsm.env.reader_check()
        for w in self.workers.workers:
            if w.pid == pid:
                self.caps.zero_row(w.index)  # its in-flight counts died with it
        last = self.worker_metrics.pop(pid, None)
        if last is not None:
            self.retired_metrics = metrics.merge([self.retired_metrics, last], only_counters=True)

    async def node_metrics(self) -> list[metrics.Family]:
        """Every process's metrics, merged (dead workers' counters included), with
        the ``process_*`` series of each process (read from /proc now)."""
        merged = await self._gather_metrics()
        pids = {"supervisor": os.getpid(), "forkserver": self.workers.fs.pid or 0}
        for w in self.workers.workers:
            if w.alive:
                pids[f"worker-{w.index}"] = w.pid
        return merged + await asyncio.to_thread(metrics.process_families, pids)

    async def _gather_metrics(self) -> list[metrics.Family]:
        async def one(pid: int, conn: rpc.Connection) -> None:
            with contextlib.suppress(Exception):
                snap = await conn.call(metrics.SnapshotReq(), metrics.Snapshot, timeout=2.0)
                if pid in self.worker_metrics or any(w.pid == pid and w.alive for w in self.workers.workers):
                    self.worker_metrics[pid] = snap.families

        conns = [(c.peer_info.get("pid", 0), c) for c in self.worker_conns.values() if not c.closed]
        await asyncio.gather(*(one(pid, c) for pid, c in conns))
        ages = self.heartbeat_ages()
        st = await asyncio.to_thread(self.claims.stats, int(time.time() * 1000))  # (a scan of the table)
        self.metrics.idem_table_keys.set(st["keys"])
        self.metrics.idem_table_pending.set(st["pending"])
        self.metrics.idem_table_capacity.set(st["capacity"])
        self.metrics.idem_table_evicted.set(st["evicted"])
        self.metrics.heartbeat_age.children.clear()
        for name, age in ages.items():
            self.metrics.heartbeat_age.labels(name).set(round(age, 3))
        return metrics.merge([metrics.snapshot(), self.retired_metrics, *self.worker_metrics.values()])

    # ---- readiness -------------------------------------------------------------
    def heartbeat_ages(self) -> dict[str, float]:
        """Seconds since each process's loop last stamped its heartbeat."""
        hb = self.versions.hb
        now = V.now_ms()
        ages = {"supervisor": hb.age(V.HB_SUPERVISOR, now) or 0.0}
        raft = hb.age(V.HB_RAFT, now)
        if raft is not None:
            ages["raft_tick"] = raft
        ages.update(self.workers.heartbeat_ages())
        return ages

    def not_responding(self) -> tuple[int, str] | None:
        """The first silent loop (Raft's tick thread, a worker, the fork server) as a
        readiness code and a sentence naming it, or None."""
        for name, age in V.not_responding(self.versions.hb, self.n_workers):
            code = 12 if name.startswith("raft") else 13 if name.startswith("fork") else 11
            if name != "supervisor":
                return code, f"{name} not responding for {age:.1f}s"
        return None

    def readiness(self) -> tuple[bool, int]:
        if self.versions.load(V.FAIL_STOPPED):
            return False, 7
        if self.versions.load(V.SHUTDOWN):
            return False, 8
        silent = self.not_responding()
        if silent is not None:
            return False, silent[0]
        ctl = getattr(self, "controller", None)
        if self.removed or (ctl is not None and ctl.removed):
            return False, 14  # the leader refused this node's id (the probe, or a refused heartbeat)
        if not self.admitted.is_set():
            return False, 9
        st = self.raft.status()
        if st.leader is None:
            return False, 2
        if st.role != "leader":
            if st.last_leader_contact is None:
                return False, 3
            if time.monotonic() - st.last_leader_contact > LEADER_CONTACT_FRESH:
                return False, 4
        if st.applied_index < self.startup_commit_index:
            return False, 5  # the startup rule: ready only once the FSM reached the commit index on disk
        if st.applied_index < self._commit_target_seen(max(st.commit_index, st.leader_commit_index)):
            return False, 5
        if not self.reconcile_done:
            return False, 6
        if not self.workers.all_serving:
            return False, 10
        return True, 0

    def _serving(self, ready: bool, reason: int) -> tuple[bool, int]:
        """`readiness()`'s answer with the workers' background loops counted: not ready
        (15) while one failed within V.FAULT_HOLD (what /readyz answers)."""
        if ready and V.failing(self.versions.hb, self.n_workers):
            return False, 15
        return ready, reason

    def _commit_target_seen(self, target: int) -> int:
        """The commit index seen APPLY_GRACE seconds ago (the oldest one seen while
        none is that old): what the replica must have applied by now."""
        now = time.monotonic()
        seen = self._commit_seen
        if not seen or seen[-1][1] != target:
            seen.append((now, target))
        while len(seen) >= 2 and seen[1][0] <= now - APPLY_GRACE:
            seen.popleft()
        return seen[0][1]

    async def _readiness_loop(self) -> None:
        while True:
            ready, reason = self.readiness()
            # V.READY is the metastore's readiness: what the latches wait for (a worker's
            # routes_trusted, the fan-out's first start) and systemd's READY=1. A worker's
            # failing background loop does not hold those back (a loop that fails every
            # pass would keep the node from ever starting, its WAL undispatched): it makes
            # /readyz answer 503 naming it (both listeners read V.failing themselves), and
            # narad_ready and the logged readiness say so (reason 15).
            self.versions.store(V.READY, 1 if ready else 0)
            ready, reason = self._serving(ready, reason)
            self.versions.store(V.READY_REASON, reason)
            if ready != self._ready:
                self._ready = ready
                log.info("readiness changed", extra={"ready": ready, "reason": V.READY_REASONS[reason]})
            if self.versions.load(V.READY) == 1 and not self._notified:
                self._notified = True
                self.metrics.boot_duration.set(round(time.monotonic() - self.t_started, 3))
                sdnotify.notify(f"READY=1\nSTATUS={self.status_line()}")
            await asyncio.sleep(READY_EVERY)

    async def _heartbeat_loop(self) -> None:
        """Stamp the supervisor's heartbeat; kill and restart stuck workers (and a
        stuck fork server); feed systemd's watchdog while this loop and Raft's tick
        thread turn; keep STATUS= current."""
        hb = self.versions.hb
        bound = self.cfg.seconds("node", "worker_stuck_after")
        watchdog = sdnotify.watchdog_interval()
        last_watchdog = last_status_at = 0.0
        status = ""
        while True:
            hb.beat(V.HB_SUPERVISOR)
            now = time.monotonic()
            workers = getattr(self, "workers", None)
            try:
                if workers is not None:
                    workers.check_stuck(bound)
                    workers.note_healthy()
                if watchdog is not None and now - last_watchdog >= watchdog:
                    raft_age = hb.age(V.HB_RAFT)
                    if raft_age is None or raft_age <= V.STALE_AFTER or self.versions.load(V.SHUTDOWN):
                        last_watchdog = now
                        sdnotify.notify("WATCHDOG=1")
                if workers is not None and now - last_status_at >= 1.0 and hasattr(self, "raft"):
                    last_status_at = now
                    text = self.status_line()
                    if text != status:
                        status = text
                        sdnotify.notify(f"STATUS={text}")
            except Exception:  # the stamp above must go on whatever fails here
                log.exception("heartbeat loop: a check failed")
            await asyncio.sleep(V.HB_EVERY)

    def status_line(self) -> str:
        """One line for systemd's STATUS= (systemctl status shows it)."""
        ready, reason = self._serving(*self.readiness())
        st = self.raft.status()
        silent = self.not_responding()
        why = silent[1] if silent is not None else V.READY_REASONS[reason]
        alive = sum(w.alive for w in self.workers.workers)
        return (f"{'ready' if ready else 'not ready: ' + why}; raft {st.role} term {st.term}, "
                f"leader {st.leader or '-'}; workers {alive}/{self.n_workers}")

    async def _housekeeping_loop(self) -> None:
        m = self.metrics
        last_check = last_metrics = 0.0
        last_snapshot = time.monotonic()
        snapshot_every = self.cfg.seconds("cluster", "raft_snapshot_interval")
        while True:
            st = self.raft.status()
            for role in ("leader", "follower", "candidate"):
                m.raft_state.labels(role).set(1 if st.role == role else 0)
            m.raft_has_leader.set(1 if st.leader else 0)
            m.raft_term.set(st.term)
            m.raft_commit.set(st.commit_index)
            m.raft_applied.set(st.applied_index)
            m.raft_log_entries.set(max(0, st.last_log_index - st.first_log_index + 1) if st.last_log_index else 0)
            m.snapshots_taken.set(self.raft.snapshots_taken)
            with contextlib.suppress(OSError):
                m.fsm_bytes.set((self.fsm_path / "data.mdb").stat().st_size)
            m.ready.set(1 if self._ready else 0)
            with self.store.read() as r:
                m.topics_total.set(r.topic_count())
            now = time.monotonic()
            if now - last_metrics >= METRICS_POLL_EVERY:
                # Keep each worker's counters recent, so a worker that dies
                # does not take its share of the node's totals with it.
                last_metrics = now
                await self._gather_metrics()
            if now - last_check >= READER_CHECK_EVERY:
                last_check = now
                with contextlib.suppress(Exception):
                    self.fsm.env.reader_check()
            if now - last_snapshot >= snapshot_every:
                # Compact the Raft log into a snapshot once it holds the threshold
                # (taken on Raft's tick thread; a failure is counted there and
                # simply tried again at the next interval).
                last_snapshot = now
                self.raft.maybe_snapshot()
            await asyncio.sleep(min(1.0, snapshot_every))

    async def _vitals_loop(self) -> None:
        """The data directory's size (a walk on a thread; slower walks run less often)
        and its filesystem's free bytes."""
        m = self.metrics
        ok = m.poller_last_success.labels("vitals")
        next_walk = 0.0
        while True:
            try:
                st = os.statvfs(self.data_dir)
                m.data_dir_available.set(st.f_bavail * st.f_frsize)
                now = time.monotonic()
                if now >= next_walk:
                    t0 = time.monotonic()
                    m.data_dir_size.set(await asyncio.to_thread(_disk_usage, self.data_dir))
                    next_walk = time.monotonic() + max(VITALS_EVERY, 20 * (time.monotonic() - t0))
                ok.set(time.time())
            except Exception:
                m.errors.labels("metrics", "poll_failed").inc()
                log.exception("vitals pass failed; next pass as planned")
            await asyncio.sleep(VITALS_EVERY)

    # ---- views for naradctl and /v1/cluster/members ------------------------------
    def node_status(self) -> Q.NodeStatus:
        st = self.raft.status()
        ready, reason = self._serving(*self.readiness())
        silent = self.not_responding()
        contact = None if st.last_leader_contact is None else round(time.monotonic() - st.last_leader_contact, 3)
        leader_id = None
        with self.store.read() as r:
            for mrec in r.members():
                if st.leader is not None and mrec.raft_addr == st.leader:
                    leader_id = mrec.id
        now = time.monotonic()
        hb = self.versions.hb
        return Q.NodeStatus(
            node_id=self.node_id, build=BUILD, ready=ready,
            reason=silent[1] if silent is not None and not ready else V.READY_REASONS[reason],
            raft=Q.RaftView(role=st.role, term=st.term, leader=st.leader, leader_id=leader_id,
                            commit_index=st.commit_index, applied_index=st.applied_index,
                            last_log_index=st.last_log_index, first_log_index=st.first_log_index,
                            persisted_commit_index=st.persisted_commit_index, has_quorum=st.has_quorum,
                            leader_contact_age_seconds=contact, voters=self.raft.voters()),
            workers=[Q.WorkerView(index=w.index, pid=w.pid, core=w.core,
                                  uptime_seconds=round(now - w.started, 3) if w.alive else 0.0,
                                  restarts=w.restarts, alive=w.alive,
                                  heartbeat_age_seconds=hb.age(V.worker_slot(w.index)))
                     for w in self.workers.workers],
            data_dir=str(self.data_dir), client_port=self.cfg.http.port, raft_port=self.cfg.raft_port,
            cluster_port=self.cfg.cluster_port, join_rounds=self.join_rounds,
            heartbeats={name: age for name, slot in (("supervisor", V.HB_SUPERVISOR), ("raft tick thread", V.HB_RAFT),
                                                     ("fork server", V.HB_FORKSERVER))
                        if (age := hb.age(slot)) is not None},
        )

    def members_view(self) -> Q.MembersResp:
        st = self.raft.status()
        voters = set(self.raft.voters())
        now_ms = self.meta.now_ms()
        with self.store.read() as r:
            members = r.members()
            owned: dict[str, int] = {}
            outbound: dict[str, int] = {}
            for _, _, a in r.all_assignments():
                owned[a.owner] = owned.get(a.owner, 0) + 1
                if a.target is not None:
                    outbound[a.owner] = outbound.get(a.owner, 0) + 1
        blocked = self.controller.decommission_blocked if self.raft.is_leader() else {}
        out = []
        for mrec in sorted(members, key=lambda x: x.id):
            out.append(Q.MemberView(
                id=mrec.id, addr=mrec.client_addr, status=mrec.status, draining=mrec.draining,
                owned_partitions=owned.get(mrec.id, 0), outbound_moves=outbound.get(mrec.id, 0),
                voter=mrec.raft_addr in voters,
                leader=st.leader is not None and mrec.raft_addr == st.leader,
                heartbeat_age_seconds=round(max(0.0, (now_ms - mrec.heartbeat_ms) / 1000), 3),
                build=mrec.build, newest_entry_type=mrec.newest_entry_type,
                entry_types=sorted(C.types_reported(mrec.entry_types, mrec.newest_entry_type)),
                decommission_blocked=list(blocked[mrec.id]) if mrec.draining and mrec.id in blocked else None,
            ))
        return Q.MembersResp(out)

    # ---- shutdown ----------------------------------------------------------------
    async def run_until_stopped(self) -> int:
        assert self._stop is not None
        await self._stop.wait()
        await self.shutdown()
        return self.exit_code

    async def shutdown(self) -> None:
        t0 = time.monotonic()
        # Health first: load balancers stop sending before anything closes.
        self.versions.store(V.SHUTDOWN, 1)
        self.versions.store(V.READY, 0)
        sdnotify.notify("STOPPING=1")
        log.info("shutting down", extra={"exit_code": self.exit_code})
        # Workers drain in-flight requests within the grace, then exit.
        await self.workers.stop_all(self.cfg.seconds("http", "shutdown_grace"))
        self.controller.stop()
        for t in self._tasks:
            t.cancel()
        for s in self._servers:
            s.close()
        if self.metrics_listener is not None:
            await self.metrics_listener.close()
        # Raft last: a graceful stop hands leadership over when a peer is connected
        # (with none there is nobody to hand it to: no 2 s wait for a transfer that cannot happen).
        if not self.meta.stopped and self.raft.is_leader() and any(self.raft.status().peers.values()):
            t_transfer = time.monotonic()
            self.raft.transfer_leadership()
            end = time.monotonic() + 2.0
            retry_at = time.monotonic() + TRANSFER_RETRY
            connected = True
            while self.raft.is_leader() and time.monotonic() < end and connected:
                await asyncio.sleep(0.005)
                connected = any(self.raft.status().peers.values())  # the peers may be stopping too
                if time.monotonic() >= retry_at:
                    # pysyncobj sends TimeoutNow only to a follower whose log matches the
                    # leader's at that instant, else it drops the request silently (an entry
                    # still in flight): ask again until one is caught up.
                    retry_at = time.monotonic() + TRANSFER_RETRY
                    self.raft.transfer_leadership()
            outcome = ("leadership handed over" if not self.raft.is_leader() else
                       "leadership transfer timed out" if connected else
                       "leadership not handed over: every peer disconnected")
            log.info(outcome, extra={"seconds": round(time.monotonic() - t_transfer, 3)})
        await self.rpc_client.close()
        await asyncio.to_thread(self.raft.close)
        self._hb_task.cancel()
        log.info("stopped", extra={"seconds": round(time.monotonic() - t0, 3), "exit_code": self.exit_code})

    def close_process(self) -> None:
        # Close the FSM environment and unmap the shared segments only when no Raft thread
        # can still touch them (one that outlived its join would crash the process with
        # SIGSEGV in LMDB or on unmapped memory); the exit reclaims both either way, and the
        # segments' names are removed regardless.
        raft = getattr(self, "raft", None)  # absent when the boot failed before Raft started
        busy = raft.threads_alive() if raft is not None else []
        if not busy:
            with contextlib.suppress(Exception):
                self.fsm.close()
        self.forkserver.stop()
        for tcp, udp in self.sockets:
            tcp.close()
            if udp is not None:
                udp.close()
        for s in self.cluster_sockets:
            s.close()
        self.versions.close(unlink=True, unmap=not busy)
        self.caps.close(unlink=True, unmap=not busy)
        self.claims.close(unlink=True, unmap=not busy)
        for p in (self.cfg.control_socket, self.runtime_dir / "worker.sock"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        self.lock.release()


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        cfg = load_config(ns.config, overrides=overrides_from(ns))
    except ConfigError as e:
        logs.setup("supervisor")
        logging.getLogger("narad.config").error(f"refusing to start: {e}")
        print(f"narad-supervisor: {e}", file=sys.stderr)
        return 2
    logs.setup("supervisor", cfg.log.level, cfg.log.format)
    sup = Supervisor(cfg)
    try:
        sup.boot_process()
    except (RuntimeError, OSError, ConfigError) as e:
        log.error(f"refusing to start: {e}")
        print(f"narad-supervisor: {e}", file=sys.stderr)
        return 2

    async def run() -> int:
        await sup.boot_loop()
        return await sup.run_until_stopped()

    try:
        code = uvloop.run(run())
    finally:
        sup.close_process()
    return code


def _disk_usage(root: Path) -> int:
    """Bytes allocated under `root` (st_blocks), not following symlinks; files
    vanishing meanwhile are skipped."""
    total = 0
    stack = [str(root)]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
        except OSError:
            continue
    return total


if __name__ == "__main__":
    sys.exit(main())
