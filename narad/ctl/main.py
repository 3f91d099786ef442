"""``naradctl``: on-host administration over the supervisor's Unix socket.

No password: the control socket is mode 0600 in the node's runtime
directory, so only the node's own user (or root) can reach it. The socket is
found from ``--socket``, or from ``--data-dir``, or from the configuration
the supervisor would load (``$NARAD_CONFIG`` or /etc/narad/narad.toml, then
``NARAD_*`` env). Human-readable output by default, ``--json`` for scripts.
Exit codes: 0 ok, 1 the node refused (message on stderr), 2 usage or
connection problem. ``users passwd`` and ``users grant`` are the recovery path
for a lost root password or an admin locked out of its grants (over HTTP,
``narad user ...`` needs an admin's password).

Imports narad.config, narad.ipc and narad.supervisor.services (the request
struct only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from narad import BUILD, __version__
from narad.config import load_config
from narad.errors import ConfigError, NaradError
from narad.ipc import rpc
from narad.ipc.control import CtlReply, CtlRequest


def _socket_path(ns: argparse.Namespace) -> Path:
    if ns.socket:
        return Path(ns.socket)
    overrides: dict[str, object] = {}
    if ns.data_dir:
        overrides["node.data_dir"] = ns.data_dir
    cfg = load_config(ns.config, overrides=overrides)
    return cfg.control_socket


async def _call(path: Path, cmd: str, args: dict[str, Any], timeout: float) -> Any:
    conn = await rpc.connect_unix(str(path))
    try:
        reply = await conn.call(CtlRequest(cmd, args), CtlReply, timeout=timeout)
        return reply.data
    finally:
        conn.close()


def _parse_grants(items: list[str]) -> list[dict[str, Any]]:
    out = []
    for item in items:
        action, _, pats = item.partition(":")
        patterns = [p for p in pats.split(",") if p] if pats else []
        out.append({"action": action, "patterns": patterns})
    return out


def _fmt_status(d: dict[str, Any]) -> str:
    r = d["raft"]
    lines = [
        f"node      {d['node_id']} ({d['build']})",
        f"ready     {'yes' if d['ready'] else 'no: ' + d['reason']}",
        f"raft      {r['role']}  term {r['term']}  leader {r['leader_id'] or r['leader'] or '-'}",
        f"index     commit {r['commit_index']}  applied {r['applied_index']}  log {r['first_log_index']}.."
        f"{r['last_log_index']}",
        f"ports     client {d['client_port']}  raft {d['raft_port']}  cluster {d['cluster_port']}",
        f"data      {d['data_dir']}",
        "workers",
        f"  {'IDX':>3}  {'PID':>7}  {'CORE':>4}  {'UPTIME':>9}  {'RESTARTS':>8}  {'HEARTBEAT':>9}  STATE",
    ]
    for w in d["workers"]:
        core = "-" if w["core"] is None else str(w["core"])
        beat = "-" if w.get("heartbeat_age_seconds") is None else f"{w['heartbeat_age_seconds']:.1f}s ago"
        lines.append(f"  {w['index']:>3}  {w['pid']:>7}  {core:>4}  {w['uptime_seconds']:>8.1f}s  "
                     f"{w['restarts']:>8}  {beat:>9}  {'up' if w['alive'] else 'down'}")
    beats = d.get("heartbeats") or {}
    if beats:
        lines.insert(6, "heartbeat " + "  ".join(f"{k} {v:.1f}s ago" for k, v in beats.items()))
    return "\n".join(lines)


def _fmt_topics(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'NAME':<40} {'PARTITIONS':>10} {'RETENTION':>12}  {'ROLE':<10}  ID"]
    for t in rows:
        ret = "forever" if t["retention_ms"] == 0 else f"{t['retention_ms'] // 1000}s"
        lines.append(f"{t['name']:<40} {t['partitions']:>10} {ret:>12}  {t.get('role', 'standalone'):<10}  {t['id']}")
    return "\n".join(lines)


def _fmt_children(d: dict[str, Any]) -> str:
    lines = [f"parent    {d['parent']} ({d['parent_id']})", f"{'CHILD':<40} {'DELAY_MS':>12}  LAG"]
    for c in d["children"]:
        lag = str(c["lag_messages"]) if c["lag_complete"] else "unknown"
        lines.append(f"{c['name']:<40} {c['delay_ms']:>12}  {lag}")
    return "\n".join(lines)


def _fmt_members(d: dict[str, Any]) -> str:
    lines = [f"{'ID':<20} {'ADDR':<22} {'STATUS':<8} {'VOTER':<5} {'LEADER':<6} {'HEARTBEAT':>9}  PARTITIONS"]
    for m in d["members"]:
        status = "draining" if m.get("draining") else m["status"]
        moving = f" ({m['outbound_moves']} moving off)" if m.get("outbound_moves") else ""
        lines.append(f"{m['id']:<20} {m['addr']:<22} {status:<8} {'yes' if m['voter'] else 'no':<5} "
                     f"{'yes' if m['leader'] else '':<6} {m['heartbeat_age_seconds']:>8.1f}s  "
                     f"{m['owned_partitions']}{moving}")
        for r in m.get("decommission_blocked") or []:
            lines.append(f"{'':<20} waits: {r['code']}: {r['message']}")
    return "\n".join(lines)


def _fmt_moves(d: dict[str, Any]) -> str:
    if not d["moves"]:
        return "no partition moves in flight"
    lines = [f"{'TOPIC':<32} {'PART':>5}  {'FROM':<14} {'TO':<14} {'BLOCKED':<18} PHASE"]
    for m in d["moves"]:
        w = m.get("worker")
        phase = (f"{w['phase']} ({w['copied_bytes']} bytes copied)" if w else m.get("worker_error", "-"))
        lines.append(f"{m['topic']:<32} {m['partition']:>5}  {m['from'] + ' ' + m['from_status']:<14} "
                     f"{m['to'] + ' ' + m['to_status']:<14} {m.get('blocked') or '-':<18} {phase}")
    return "\n".join(lines)


def _fmt_abort(d: dict[str, Any]) -> str:
    return str(d["note"])


def _fmt_decommission(d: dict[str, Any]) -> str:
    if "would_decommission" not in d:
        if d["draining"]:
            return f"{d['member']} is draining: its partitions move off, then it leaves the cluster"
        return f"decommission of {d['member']} cancelled (partitions already moved stay where they are)"
    head = (f"{d['member']} would be decommissioned" if d["would_decommission"]
            else f"{d['member']} would NOT be decommissioned")
    lines = [f"{head} (voter: {'yes' if d['voter'] else 'no'}, owns {d['owned_partitions']} partitions, "
             f"{d['inbound_moves']} moves to it)"]
    lines += [f"  {r['code']}: {r['message']}" for r in d["reasons"]]
    return "\n".join(lines)


def _fmt_users(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'USERNAME':<30} GRANTS"]
    for u in rows:
        if u.get("root"):
            grants = "root admin"
        else:
            grants = "; ".join(f"{g['action']}:{','.join(g.get('patterns', []))}".rstrip(":")
                               for g in u.get("grants", [])) or "-"
        lines.append(f"{u['username']:<30} {grants}")
    return "\n".join(lines)


def _fmt_user(u: dict[str, Any]) -> str:
    return _fmt_users([u])


def _fmt_passwd(d: dict[str, Any]) -> str:
    return f'password of "{d["username"]}" changed'


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="naradctl", description="Administer the narad node on this host.")
    p.add_argument("--socket", help="control socket path")
    p.add_argument("--data-dir", help="the node's data directory (finds <data-dir>/run/narad.sock)")
    p.add_argument("--config", help="the node's config file")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the node")
    p.add_argument("--version", action="version", version=f"naradctl {__version__} ({BUILD})",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="Raft role, indexes, workers")
    members = sub.add_parser("members", help="cluster members; 'members forget <id>' removes a Raft server")
    m_sub = members.add_subparsers(dest="action")
    mf = m_sub.add_parser("forget", help="remove a Raft server that has no member record")
    mf.add_argument("id", help="the server's Raft address (host:port)")
    md = m_sub.add_parser("decommission", help="drain a member: its partitions move off, then it leaves Raft")
    md.add_argument("id", help="the member's node id")
    md_how = md.add_mutually_exclusive_group()
    md_how.add_argument("--dry-run", action="store_true", help="only say whether it would be accepted, and why not")
    md_how.add_argument("--cancel", action="store_true", help="stop a decommission (moved partitions stay moved)")
    mv = sub.add_parser("moves", help="partition moves in flight; 'moves abort <topic> <partition>' cancels one")
    mv.add_argument("--detail", action="store_true", help="also ask each destination for its move runner")
    mv_sub = mv.add_subparsers(dest="action")
    ma = mv_sub.add_parser("abort", help="clear a partition's move target: it stays with its owner")
    ma.add_argument("topic")
    ma.add_argument("partition")
    ma.add_argument("--target", help="abort only if the move still goes to this node (compare-and-set)")
    topics = sub.add_parser("topics", help="topics").add_subparsers(dest="action", required=True)
    topics.add_parser("ls")
    c = topics.add_parser("create")
    c.add_argument("name")
    c.add_argument("--partitions", type=int)
    c.add_argument("--retention-ms", type=int)
    c.add_argument("--visibility-timeout-ms", type=int)
    c.add_argument("--max-in-flight", type=int)
    c.add_argument("--max-acked-ahead", type=int)
    c.add_argument("--schema", help="JSON Schema document (inline)")
    d = topics.add_parser("describe")
    d.add_argument("name")
    a = topics.add_parser("alter")
    a.add_argument("name")
    a.add_argument("--partitions", type=int)
    a.add_argument("--retention-ms", type=int)
    a.add_argument("--max-in-flight", type=int)
    a.add_argument("--max-acked-ahead", type=int)
    r = topics.add_parser("rm")
    r.add_argument("name")
    at = topics.add_parser("attach", help="attach an existing topic as a fan-out (or delay) child of parent")
    at.add_argument("parent")
    at.add_argument("child")
    at.add_argument("--delay-ms", type=int, default=0, help="make it a delay child (0 to one year)")
    de = topics.add_parser("detach", help="detach a child: it becomes a standalone topic, keeping its data")
    de.add_argument("parent")
    de.add_argument("child")
    ch = topics.add_parser("children", help="a parent's children and their delay")
    ch.add_argument("parent")
    ms = sub.add_parser("metastore", help="export / import the metastore (disaster recovery)")
    ms_sub = ms.add_subparsers(dest="action", required=True)
    ex = ms_sub.add_parser("export", help="write a consistent JSON export of the metastore to FILE")
    ex.add_argument("file")
    im = ms_sub.add_parser("import", help="apply an export as one Raft entry (the cluster must be empty)")
    im.add_argument("file")
    im.add_argument("--overwrite", action="store_true", help="replace the topics, schemas and users it holds")
    users = sub.add_parser("users", help="users").add_subparsers(dest="action", required=True)
    users.add_parser("ls")
    ua = users.add_parser("add")
    ua.add_argument("username")
    ua.add_argument("--password", help="the password (default: read one line from stdin)")
    ua.add_argument("--grant", action="append", default=[], help="action:pattern1,pattern2 (repeatable)")
    ur = users.add_parser("rm")
    ur.add_argument("username")
    up = users.add_parser("passwd", help="set a user's password, root's included (the lost-password recovery)")
    up.add_argument("username")
    up.add_argument("--password", help="the new password (default: asked twice at a terminal, else one line "
                                       "of stdin)")
    ug = users.add_parser("grant", help="replace a user's grants (root's cannot change)")
    ug.add_argument("username")
    ug.add_argument("--grant", action="append", default=[], help="action:pattern1,pattern2 (repeatable)")
    ug.add_argument("--none", action="store_true", help="remove all of the user's grants")
    return p


def _new_password(given: str | None) -> str | None:
    """The new password: --password, else asked twice at a terminal, else one line of
    stdin. None when the two answers differ."""
    if given is not None:
        return given
    if sys.stdin.isatty():
        import getpass

        pw = getpass.getpass("New password: ")
        return pw if getpass.getpass("Repeat it: ") == pw else None
    return sys.stdin.readline().rstrip("\r\n")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        path = _socket_path(ns)
    except ConfigError as e:
        print(f"naradctl: {e}", file=sys.stderr)
        return 2
    cmd, args, fmt = ns.command, {}, None
    if ns.command == "status":
        fmt = _fmt_status
    elif ns.command == "members":
        if ns.action == "forget":
            cmd, args = "members.forget", {"id": ns.id}
        elif ns.action == "decommission":
            cmd, args = "members.decommission", {"id": ns.id, "dry_run": ns.dry_run, "cancel": ns.cancel}
            fmt = _fmt_decommission
        else:
            fmt = _fmt_members
    elif ns.command == "moves":
        if ns.action == "abort":
            cmd, fmt = "moves.abort", _fmt_abort
            args = {"topic": ns.topic, "partition": ns.partition, "target": ns.target}
        else:
            cmd, args, fmt = "moves", {"detail": ns.detail}, _fmt_moves
    elif ns.command == "topics":
        cmd = f"topics.{ns.action}"
        if ns.action == "ls":
            fmt = _fmt_topics
        elif ns.action in ("create", "alter"):
            args = {"name": ns.name, "partitions": ns.partitions, "retention_ms": ns.retention_ms,
                    "max_in_flight_per_partition": ns.max_in_flight,
                    "max_acked_ahead_per_partition": ns.max_acked_ahead}
            if ns.action == "create":
                args["visibility_timeout_ms"] = ns.visibility_timeout_ms
                args["schema"] = ns.schema
        elif ns.action == "attach":
            args = {"parent": ns.parent, "child": ns.child, "delay_ms": ns.delay_ms}
        elif ns.action in ("detach", "children"):
            args = {"parent": ns.parent}
            if ns.action == "detach":
                args["child"] = ns.child
            else:
                fmt = _fmt_children
        else:
            args = {"name": ns.name}
    elif ns.command == "metastore":
        cmd = f"metastore.{ns.action}"
        if ns.action == "import":
            try:
                with open(ns.file, encoding="utf-8") as fh:
                    args = {"document": fh.read(), "overwrite": ns.overwrite}
            except (OSError, UnicodeDecodeError) as e:
                print(f"naradctl: cannot read {ns.file}: {e}", file=sys.stderr)
                return 2
    elif ns.command == "users":
        cmd = f"users.{ns.action}"
        if ns.action == "ls":
            fmt = _fmt_users
        elif ns.action == "add":
            pw = _new_password(ns.password)  # at a terminal: asked twice, not echoed (as passwd)
            if pw is None:
                print("naradctl: the two passwords differ", file=sys.stderr)
                return 2
            args = {"username": ns.username, "password": pw, "grants": _parse_grants(ns.grant)}
        elif ns.action == "passwd":
            new_pw = _new_password(ns.password)
            if new_pw is None:
                print("naradctl: the two passwords differ", file=sys.stderr)
                return 2
            args = {"username": ns.username, "password": new_pw}
            fmt = _fmt_passwd
        elif ns.action == "grant":
            if bool(ns.grant) == ns.none:
                print("naradctl: users grant needs --grant ... (the new grants) or --none", file=sys.stderr)
                return 2
            args = {"username": ns.username, "grants": _parse_grants(ns.grant)}
            fmt = _fmt_user
        else:
            args = {"username": ns.username}
    try:
        data = asyncio.run(_call(path, cmd, args, ns.timeout))
    except (FileNotFoundError, ConnectionRefusedError) as e:
        print(f"naradctl: cannot reach the node at {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    except PermissionError:
        print(f"naradctl: permission denied on {path} (run as the node's user)", file=sys.stderr)
        return 2
    except NaradError as e:
        print(f"naradctl: {e.message} (HTTP {e.status})", file=sys.stderr)
        return 1
    if ns.command == "topics" and ns.action == "describe" and data.get("role") in ("parent", "child"):
        # the fan-out lag: of each child (a parent), of this child behind its parent (a child)
        parent = data["name"] if data["role"] == "parent" else data.get("parent", "")
        with contextlib.suppress(NaradError, OSError):
            kids = asyncio.run(_call(path, "topics.children", {"parent": parent}, ns.timeout))["children"]
            if data["role"] == "parent":
                data["children_lag"] = kids
            else:
                for row in kids:
                    if row["name"] == data["name"]:
                        data["lag_messages"], data["lag_complete"] = row["lag_messages"], row["lag_complete"]
    if ns.command == "metastore" and ns.action == "export":
        tmp = f"{ns.file}.tmp"
        try:
            # It holds every user's bcrypt hash: readable by the owner only (0600,
            # whatever the umask), a fresh file (O_EXCL: no planted symlink followed).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, ns.file)
        except OSError as e:
            print(f"naradctl: cannot write {ns.file}: {e}", file=sys.stderr)
            return 2
        data = {"file": ns.file, "applied_index": data["applied_index"], "counts": data["counts"]}
    if ns.json or fmt is None:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(fmt(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
