"""Worker process entry point (runs in a child of the fork server).

Order: die with the parent, pin to the core, reset signals, attach the
shared version array read-only, open the FSM read-only (after fork, as LMDB
requires), connect to the supervisor, then serve HTTP/1.1 on the inherited
TCP listener and HTTP/3 on the inherited UDP socket until SIGTERM (drain)
or until the supervisor goes away (exit). From its first await the worker's
loop stamps its heartbeat slot every 250 ms (``narad.meta.versions``): the
supervisor restarts a worker whose loop stops turning, and /readyz on any
worker names one that went silent.

``portable_spec`` / ``forkserver_entry``: the spec as a replacement fork
server (a fresh ``python -m narad.supervisor.forkserver``) receives it, with
every socket as an inherited descriptor number.

Imports narad.api, narad.meta, narad.ipc, narad.metrics, narad.config.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import psutil
import uvloop

from narad import logs, metrics
from narad.api.app import build_app
from narad.api.auth import Authenticator
from narad.api.context import ApiContext
from narad.api.http1 import Http1Limits, Http1Server
from narad.api.ops import local_node_status
from narad.broker.broker import Broker
from narad.broker.caps import CapTable
from narad.broker.fanout import FanoutSettings
from narad.broker.idem_claims import ClaimTable
from narad.broker.peers import PeerLinks
from narad.cluster.remote import ClusterRemote
from narad.cluster.transport import NodeRpcClient, NodeRpcServer
from narad.config import Config
from narad.ipc import rpc
from narad.ipc.proctitle import set_title
from narad.meta import versions as V
from narad.meta.requests import (
    CaughtUpReq,
    CaughtUpResp,
    ConfirmEpochReq,
    ConfirmEpochResp,
    ConfirmGoneReq,
    ConfirmGoneResp,
    Forwarded,
    ForwardReq,
    ForwardResp,
    NodeStatusReq,
    NodeStatusView,
)
from narad.meta.store import MetaStore
from narad.worker.http_metrics import MeteredApp

log = logging.getLogger("narad.worker")


class WorkerHello(msgspec.Struct, tag=True):
    index: int
    pid: int


class HelloAck(msgspec.Struct):
    node_id: str


class WorkerServing(msgspec.Struct, tag=True):
    """Note to the supervisor: this worker accepts client connections now."""

    index: int
    pid: int


@dataclass
class WorkerSpec:
    cfg: Config
    node_id: str
    sockets: list[tuple[socket.socket, socket.socket | None]]
    shm_name: str
    caps_name: str
    claims_name: str
    data_dir: Path
    runtime_dir: Path
    fsm_path: Path
    worker_socket: Path
    cert_file: str
    key_file: str
    workers: int
    cluster_sockets: list[socket.socket]
    secret: bytes


def portable_spec(spec: WorkerSpec) -> tuple[WorkerSpec, list[int]]:
    """A picklable copy of `spec` (each socket replaced by its descriptor number)
    and the descriptors a replacement fork server must inherit."""
    fds: list[int] = []
    pairs: list[tuple[int, int | None]] = []
    for tcp, udp in spec.sockets:
        pairs.append((tcp.fileno(), None if udp is None else udp.fileno()))
        fds += [tcp.fileno()] + ([] if udp is None else [udp.fileno()])
    cluster = [s.fileno() for s in spec.cluster_sockets]
    fds += cluster
    return replace(spec, sockets=pairs, cluster_sockets=cluster), fds  # type: ignore[arg-type]


def forkserver_entry(spec: WorkerSpec) -> Callable[[int, int | None], int]:
    """In a replacement fork server (fresh interpreter): rebuild the sockets from
    the inherited descriptors; returns the function that runs worker `index`."""
    logs.setup("forkserver", spec.cfg.log.level, spec.cfg.log.format)
    pairs: list[tuple[socket.socket, socket.socket | None]] = [
        (socket.socket(fileno=t), None if u is None else socket.socket(fileno=u))  # type: ignore[arg-type]
        for t, u in spec.sockets]
    cluster = [socket.socket(fileno=fd) for fd in spec.cluster_sockets]  # type: ignore[call-overload]
    live = replace(spec, sockets=pairs, cluster_sockets=cluster)
    return lambda index, core: run(live, index, core)


def run(spec: WorkerSpec, index: int, core: int | None) -> int:
    """Runs in the forked worker; returns the exit code."""
    logs.setup(f"worker-{index}", spec.cfg.log.level, spec.cfg.log.format)
    set_title(f"narad: worker {index}" + ("" if core is None else f" (core {core})"))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    if core is not None:
        try:
            psutil.Process().cpu_affinity([core])
        except (OSError, ValueError) as e:
            log.warning("could not pin worker to core", extra={"core": core, "err": str(e)})
    # Keep only this worker's sockets.
    for i, (tcp, udp) in enumerate(spec.sockets):
        if i != index:
            tcp.close()
            if udp is not None:
                udp.close()
    for i, s in enumerate(spec.cluster_sockets):
        if i != index:
            s.close()
    metrics.setup()
    return uvloop.run(_main(spec, index, core))


async def _main(spec: WorkerSpec, index: int, core: int | None) -> int:
    loop = asyncio.get_running_loop()
    t_start = time.monotonic()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, logs.dump_tasks, loop)  # diagnostics: where requests wait
    versions = V.VersionTable.attach(spec.shm_name)
    heartbeat = loop.create_task(_heartbeat(versions.hb, V.worker_slot(index)))
    store = MetaStore(spec.fsm_path, versions)
    service = rpc.Service()
    service.on_close = lambda _c: stop.set()

    async def metrics_snapshot(_m: metrics.SnapshotReq, _c: rpc.Connection) -> metrics.Snapshot:
        return metrics.Snapshot(metrics.snapshot())

    service.register(metrics.SnapshotReq, metrics_snapshot)
    sup = await rpc.connect_unix(str(spec.worker_socket), service)
    await sup.call(WorkerHello(index, os.getpid()), HelloAck, timeout=10)
    cfg = spec.cfg
    links = PeerLinks(spec.runtime_dir, index, spec.workers)

    async def confirm_gone(topic: str, topic_id: str) -> bool:
        resp = await sup.call(ConfirmGoneReq(topic, topic_id), ConfirmGoneResp, timeout=15.0)
        return resp.gone

    # Fan-out's stale-replica defenses: is this node's replica provably current, and
    # does the leader (barrier, then a re-read) confirm an attach epoch?
    async def caught_up() -> bool:
        return (await sup.call(CaughtUpReq(), CaughtUpResp, timeout=5.0)).caught_up

    async def confirm_epoch(req: ConfirmEpochReq) -> ConfirmEpochResp:
        return await sup.call(req, ConfirmEpochResp, timeout=15.0)

    rpc_client = NodeRpcClient(spec.secret)
    remote = ClusterRemote(spec.node_id, store, rpc_client) if cfg.clustered else None
    broker = Broker(data_dir=spec.data_dir, store=store, versions=versions, index=index, workers=spec.workers,
                    links=links, confirm_gone=confirm_gone,
                    offset_sync_interval=cfg.storage.consumer_offset_commit_interval_ms / 1000.0,
                    remote=remote, node_id=spec.node_id, idle_eviction_ms=cfg.storage.idle_log_eviction_ms,
                    cold_walk_ms=cfg.storage.cold_retention_walk_ms, caught_up=caught_up,
                    group_sync=cfg.storage.group_sync, security=cfg.security.enabled,
                    delivery_counts=cfg.topic.delivery_counts,
                    claims=ClaimTable.attach(spec.claims_name),
                    idem_local=cfg.topic.idempotent_local_placement,
                    confirm_epoch=confirm_epoch,
                    meta_call=lambda req, typ, timeout: sup.call(req, typ, timeout=timeout),
                    fanout=FanoutSettings(cfg.fanout.max_batch_records, cfg.fanout.max_batch_bytes,
                                          cfg.fanout.linger_ms))
    await links.serve()

    # Node RPC (TLS over TCP on the cluster port): the broker's handlers serve other
    # nodes too; forwarded metadata writes go on to this node's supervisor.
    async def forward(m: ForwardReq, _c: object) -> ForwardResp:
        return await sup.call(Forwarded(m.origin, m.request_id, m.request), ForwardResp,
                              timeout=cfg.seconds("cluster", "write_timeout") + 5.0)

    links.service.register(ForwardReq, forward)  # type: ignore[arg-type]
    node_rpc = NodeRpcServer(spec.cluster_sockets[index], spec.secret, links.service)
    await node_rpc.start()
    logs.add_dumper(node_rpc.describe)
    logs.add_dumper(rpc_client.describe)
    await broker.start()
    caps = CapTable.attach(spec.caps_name, spec.workers)
    slots = max(1, 4 // max(1, spec.workers))
    auth = Authenticator(
        security=cfg.security.enabled,
        users=store.user,
        versions=versions,
        supervisor_call=lambda req, typ: sup.call(req, typ, timeout=5.0),
        supervisor_note=sup.notify,
        bcrypt_slots=slots,
    )
    _count_bcrypt(auth)
    ctx = ApiContext(cfg=cfg, node_id=spec.node_id, store=store, versions=versions, sup=sup, auth=auth,
                     worker_index=index, broker=broker, caps=caps)

    # Another node's members?detail=true asks any worker here for this node's status.
    async def node_status(_m: NodeStatusReq, _c: object) -> NodeStatusView:
        return await local_node_status(ctx)

    links.service.register(NodeStatusReq, node_status)  # type: ignore[arg-type]
    app = MeteredApp(build_app(ctx))  # in-flight and per-request series (narad.worker.http_metrics)
    tcp, udp = spec.sockets[index]
    alt_svc = f'h3=":{cfg.http.port}"; ma=86400' if udp is not None else None
    h1 = Http1Server(app, tcp, Http1Limits(
        read_timeout=cfg.seconds("http", "read_timeout"),
        idle_timeout=cfg.seconds("http", "idle_timeout"),
        max_header_bytes=cfg.http.max_header_bytes,
        max_connections=(cfg.http.max_connections // max(1, spec.workers)) if cfg.http.max_connections else 0,
        alt_svc=alt_svc,
    ))
    await h1.start()
    h3 = None
    if udp is not None:
        from narad.api.http3 import Http3Limits, Http3Server

        h3 = Http3Server(app, udp, spec.cert_file, spec.key_file, Http3Limits(
            idle_timeout=cfg.seconds("http", "idle_timeout"),
            max_header_bytes=cfg.http.max_header_bytes,
            read_timeout=cfg.seconds("http", "read_timeout"),
            max_connections=(cfg.http.max_connections // max(1, spec.workers)) if cfg.http.max_connections else 0,
        ))
        await h3.start()
    # Everything allocated so far lives as long as the worker: keep it out of
    # every collection, and collect the young generation less often (request
    # handling allocates a lot of short-lived objects; gen-0 passes showed up
    # at ~5% of worker CPU).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    log.info("worker serving", extra={"index": index, "core": core, "port": cfg.http.port,
                                      "startup_seconds": round(time.monotonic() - t_start, 3)})
    sup.notify(WorkerServing(index, os.getpid()))
    # A diagnostic for loadtest/bench.py --cprofile: NARAD_WORKER_CPROFILE=<prefix> runs the
    # worker under cProfile (deterministic, about twice the CPU) and writes <prefix>.<index>.<pid>
    # at a clean stop. Unset (always, in production): nothing.
    prof_prefix = os.environ.get("NARAD_WORKER_CPROFILE")
    prof = None
    # The same for loadtest/bench.py --opcount: NARAD_WORKER_OPCOUNT=<prefix> counts the Python
    # bytecodes the worker runs, by function (narad.worker.opcount), written at a clean stop.
    opc_prefix = os.environ.get("NARAD_WORKER_OPCOUNT")
    opc = None
    if opc_prefix:
        from narad.worker.opcount import OpCounter

        opc = OpCounter()
        opc.start()
    if prof_prefix:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    await stop.wait()
    if opc is not None:
        try:
            opc.stop(f"{opc_prefix}.{index}.{os.getpid()}")
        except OSError as e:
            log.warning("could not write the worker's opcode counts", extra={"err": str(e)})
    if prof is not None:
        prof.disable()
        try:
            prof.dump_stats(f"{prof_prefix}.{index}.{os.getpid()}")
        except OSError as e:
            log.warning("could not write the worker's profile", extra={"err": str(e)})
    t0 = time.monotonic()
    grace = cfg.seconds("http", "shutdown_grace")
    if not sup.closed:
        await asyncio.gather(h1.drain(grace), h3.drain(grace) if h3 else asyncio.sleep(0))
        await node_rpc.close()
        await broker.close()
        await rpc_client.close()
        links.close()
        log.info("worker drained", extra={"index": index, "seconds": round(time.monotonic() - t0, 3)})
        sup.close()
        heartbeat.cancel()
        return 0
    log.error("supervisor went away; worker exiting", extra={"index": index})
    heartbeat.cancel()
    return 3


def _count_bcrypt(auth: Authenticator) -> None:
    """narad_auth_verify_queued: bcrypt checks waiting for a slot or running (the
    authenticator's ``_bcrypt``, wrapped: one add before and after a check)."""
    inner = getattr(auth, "_bcrypt", None)
    if inner is None:
        return
    g = metrics.get().auth_verify_queued.labels()

    async def counted(pw: bytes, hashed: bytes) -> bool:
        g.value += 1
        try:
            return bool(await inner(pw, hashed))
        finally:
            g.value -= 1

    auth._bcrypt = counted  # type: ignore[method-assign]


async def _heartbeat(hb: V.Heartbeats, slot: int) -> None:
    """Stamp this worker's heartbeat slot while its event loop turns."""
    while True:
        hb.beat(slot)
        await asyncio.sleep(V.HB_EVERY)
