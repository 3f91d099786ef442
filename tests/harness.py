"""Test harness: real narad nodes as subprocesses on 127.0.0.1, real HTTP/1.1
clients, naradctl, and waits on conditions with deadlines (never fixed sleeps).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ADMIN_PASSWORD = "test-admin-password-1"


def database_digest(env: Any, dbs: dict[str, Any]) -> str:
    """SHA-256 of every table of a metastore database, all but the LMDB transaction id
    (it depends on how entries were batched into commits): equal digests = same data."""
    from narad.meta import fsm as F

    h = hashlib.sha256()
    with env.begin() as txn:
        for name in F.DB_NAMES:
            for k, v in txn.cursor(db=dbs[name]):
                if name == "fsm_meta" and bytes(k) == F.K_TXN:
                    continue
                h.update(name.encode() + b"\0" + bytes(k) + b"\0" + bytes(v) + b"\n")
    return h.hexdigest()


def _bindable(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _port_range() -> tuple[int, int]:
    """10000-32000, or this pytest-xdist worker's share of it (gw0, gw1, ...): parallel
    test processes never pick the same port for nodes that have not bound it yet."""
    lo, hi = 10000, 32000
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        share = (hi - lo) // count
        lo += int(worker[2:]) % count * share
        hi = lo + share - 1
    return lo, hi


_GIVEN: set[int] = set()  # ports handed out by this process: never handed out twice


def free_ports(n: int) -> list[int]:
    """n ports free for both TCP and UDP on 127.0.0.1 (chosen at run time), below the
    kernel's ephemeral range: a port in it can be taken by any outgoing connection
    while a node is down between a stop and its restart. A port is handed out once per
    process (the nodes of a cluster, or a stopped node and a newcomer, never share one)."""
    lo, hi = _port_range()
    if len(_GIVEN) > (hi - lo) // 2:
        _GIVEN.clear()
    out: list[int] = []
    while len(out) < n:
        p = random.randint(lo, hi)
        if p not in _GIVEN and _bindable(p):
            _GIVEN.add(p)
            out.append(p)
    return out


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, interval: float = 0.02, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < end:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})"
                                                                            if last_exc else ""))


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<Response {self.status} {self.body[:200]!r}>"


def basic(user: str, pw: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()


class Node:
    def __init__(
        self,
        data_dir: Path,
        *,
        workers: int = 2,
        security: bool = True,
        node_id: str = "n1",
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        ports: list[int] | None = None,
        tmpfs_mb: int = 0,
        tmpfs_sub: str = "",
        wrap: list[str] | None = None,
    ) -> None:
        self.data_dir = data_dir
        # wrap: a command the node runs under (valgrind, for loadtest/bench_instructions.py);
        # its start and stop are then given ten times as long.
        self.wrap = wrap or []
        self.slow = 10.0 if wrap else 1.0
        self.workers = workers
        self.security = security
        self.node_id = node_id
        self.port, self.raft_port, self.cluster_port = ports or free_ports(3)
        self.extra_env = env or {}
        self.extra_args = args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.auth = basic("admin", ADMIN_PASSWORD)
        # tmpfs_mb: run the node in its own mount namespace with the data dir on a
        # small tmpfs (disk-full tests); the runtime dir stays outside it.
        # tmpfs_sub: mount it on that directory under the data dir instead (made first).
        self.tmpfs_mb = tmpfs_mb
        self.tmpfs_sub = tmpfs_sub
        whole = tmpfs_mb and not tmpfs_sub
        self.runtime_dir = data_dir.parent / f"{data_dir.name}-run" if whole else data_dir / "run"

    # ---- process ----------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "narad.supervisor.main", "--data-dir", str(self.data_dir),
               "--port", str(self.port), "--raft-port", str(self.raft_port),
               "--cluster-port", str(self.cluster_port), "--workers", str(self.workers),
               "--node-id", self.node_id]
        if not self.security:
            cmd.append("--dev")
        cmd += self.extra_args
        cmd = [*self.wrap, *cmd]
        if self.tmpfs_mb:
            ns = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
            target = self.data_dir / self.tmpfs_sub if self.tmpfs_sub else self.data_dir
            script = f'mount -t tmpfs -o size={self.tmpfs_mb}m tmpfs "{target}" && exec "$@"'
            cmd = [*ns, "sh", "-c", script, "sh", *cmd]
        return cmd

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NARAD_")}
        env.update({"NARAD_ADMIN_PASSWORD": ADMIN_PASSWORD, "NARAD_HTTP_HOST": "127.0.0.1",
                    "NARAD_LOG_FORMAT": "text", "NARAD_HTTP_DEBUG_HEADERS": "true",
                    "NARAD_CONFIG": os.devnull})
        if self.tmpfs_mb and not self.tmpfs_sub:
            env["NARAD_RUNTIME_DIR"] = str(self.runtime_dir)
        env.update(self.extra_env)
        return env

    def start(self, wait: bool = True) -> Node:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if self.tmpfs_mb:
            (self.data_dir / self.tmpfs_sub).mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=logf, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        logf.close()
        if wait:
            self.wait_ready()
        return self

    def in_namespace(self, path: Path) -> Path:
        """``path`` as this node's processes see it (its tmpfs mount included)."""
        assert self.proc is not None
        return Path(f"/proc/{self.proc.pid}/root{path}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"node exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                return self.get("/readyz", auth=None).status == 200
            except OSError:
                return False

        try:
            timeout *= self.slow
            wait_for(ready, timeout, 0.05, "the node to be ready")
        except RuntimeError as e:
            raise AssertionError(str(e)) from None
        except AssertionError:
            raise AssertionError(f"node not ready in {timeout}s:\n{self.log()[-4000:]}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        timeout *= self.slow
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise AssertionError(f"node did not stop within {timeout}s:\n{self.log()[-3000:]}") from None
        if rc < 0 and -rc != sig:
            # Died of a signal it was not sent to die of (SIGSEGV, SIGABRT): the log's tail holds
            # faulthandler's stacks; printed so a failing test's captured output shows them.
            print(f"node {self.node_id} exited with signal {-rc}; log tail:\n{self.log()[-6000:]}", flush=True)
        return rc

    def kill9(self) -> None:
        """SIGKILL every process of the node (supervisor, fork server, workers)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.stop(timeout=15)
        if self.proc is not None and self.proc.poll() is None:
            self.kill9()

    # ---- HTTP/1.1 ---------------------------------------------------------
    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        auth: str | bool | None = True,
        conn: http.client.HTTPConnection | None = None,
    ) -> Response:
        h = dict(headers or {})
        if auth is True:
            if self.security:
                h["Authorization"] = self.auth
        elif isinstance(auth, str):
            h["Authorization"] = auth
        data: bytes | None
        if body is None:
            data = None
        elif isinstance(body, bytes):
            data = body
        else:
            data = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        if method in ("POST", "PUT", "PATCH"):
            h.setdefault("X-Narad-Client", "tests")
        own = conn is None
        c = conn or self.conn()
        try:
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            if own:
                c.close()

    def get(self, path: str, **kw: Any) -> Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Response:
        return self.request("POST", path, body, **kw)

    def topic_names(self) -> set[str]:
        """Every topic, page by page."""
        names: set[str] = set()
        token = ""
        while True:
            page = self.get(f"/v1/topics?limit=1000&page_token={token}").json()
            names |= {t["name"] for t in page["topics"]}
            token = page["next_page_token"]
            if not token:
                return names

    def metric(self, name: str) -> float:
        """The node-wide value of a label-less metric (summed over labels)."""
        total, found = 0.0, False
        for line in self.get("/metrics").body.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        return total if found else float("nan")

    def wait_parked(self, n: int, timeout: float = 10.0) -> None:
        """Wait until n long polls are parked on the node."""
        wait_for(lambda: self.metric("narad_consume_waiters") >= n, timeout, 0.02, f"{n} parked long polls")

    # ---- naradctl -----------------------------------------------------------
    def ctl(self, *args: str, check: bool = True) -> Any:
        sock = self.runtime_dir / "narad.sock"
        p = subprocess.run([sys.executable, "-m", "narad.ctl.main", "--socket", str(sock), "--json", *args],
                           capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise AssertionError(f"naradctl {' '.join(args)} failed ({p.returncode}): {p.stderr}")
        return json.loads(p.stdout) if p.returncode == 0 else p

    def worker_pids(self) -> dict[int, int]:
        """Worker index -> pid of the live workers (``naradctl status``)."""
        return {w["index"]: w["pid"] for w in self.status()["workers"] if w["alive"]}

    def status(self) -> dict[str, Any]:
        """``naradctl --json status``: the same request on the same control socket, sent from
        this process (a naradctl subprocess costs ~0.3 s of interpreter start per poll)."""
        import asyncio

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:  # called from a coroutine: asyncio.run would fail here
            return self.ctl("status")  # type: ignore[no-any-return]
        from narad.ipc import rpc
        from narad.ipc.control import CtlReply, CtlRequest

        async def call() -> Any:
            conn = await rpc.connect_unix(str(self.runtime_dir / "narad.sock"))
            try:
                return (await conn.call(CtlRequest("status", {}), CtlReply, timeout=15.0)).data
            finally:
                conn.close()

        return asyncio.run(call())  # type: ignore[no-any-return]

    def worker_connection(self, index: int, timeout: float = 10.0) -> http.client.HTTPConnection:
        """A keep-alive connection the kernel routed to worker `index`."""
        def find() -> http.client.HTTPConnection | None:
            c = self.conn()
            c.request("GET", "/healthz")
            r = c.getresponse()
            r.read()
            if r.getheader("X-Narad-Worker") == str(index):
                return c
            c.close()
            return None

        return wait_for(find, timeout, 0.0, f"a connection on worker {index}")  # type: ignore[no-any-return]


CLUSTER_SECRET = "test-cluster-secret-0123456789abcdef-xyz"


class Cluster:
    """Real narad nodes on 127.0.0.1 forming one cluster. Nodes n1..n<initial>
    bootstrap together; the rest join later (join-only)."""

    def __init__(self, tmp: Path, n: int, *, initial: int | None = None, workers: int = 1,
                 env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        initial = n if initial is None else initial
        self.ids = [f"n{i + 1}" for i in range(n)]
        self.ports = {nid: free_ports(3) for nid in self.ids}
        peers = ",".join(f"{nid}@127.0.0.1:{self.ports[nid][1]}" for nid in self.ids)
        members = ",".join(self.ids[:initial])
        # Several nodes share this host's cores: pinning every node's worker 0 to core 0
        # would make them compete for one core while the other idles.
        base_env = {"NARAD_CLUSTER_SECRET": CLUSTER_SECRET, "NARAD_PIN_WORKERS": "false", **(env or {})}
        self.nodes: dict[str, Node] = {
            nid: Node(tmp / nid / "data", workers=workers, node_id=nid, ports=self.ports[nid], env=dict(base_env),
                      args=["--peers", peers, "--initial-members", members])
            for nid in self.ids
        }
        self.initial = self.ids[:initial]

    def __getitem__(self, nid: str) -> Node:
        return self.nodes[nid]

    def start(self, ids: list[str] | None = None, wait: bool = True) -> Cluster:
        ids = ids or self.initial
        for nid in ids:
            self.nodes[nid].start(wait=False)
        if wait:
            for nid in ids:
                self.nodes[nid].wait_ready(60)
        return self

    def leader(self, among: list[str] | None = None) -> str:
        def find() -> str | None:
            for nid in among or self.ids:
                n = self.nodes[nid]
                if n.proc is None or n.proc.poll() is not None:
                    continue
                try:
                    st = n.status()
                except Exception:
                    continue
                if st["raft"]["role"] == "leader":
                    return nid
            return None

        return wait_for(find, 30, 0.05, "a raft leader")  # type: ignore[no-any-return]

    def close(self) -> None:
        # SIGTERM to every node at once (they stop side by side), then wait for each.
        for n in self.nodes.values():
            if n.proc is not None and n.proc.poll() is None:
                with contextlib.suppress(OSError):
                    n.proc.send_signal(signal.SIGTERM)
        for n in self.nodes.values():
            try:
                n.close()
            except Exception:
                pass
