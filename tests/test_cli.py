"""The ``narad`` CLI (narad.cli) against one real node with security on, and
naradctl's ``users passwd`` / ``users grant`` / ``--version``.

Most commands run in-process through click's CliRunner (standard input is not a
terminal there, so a password prompt reads its answer from the runner's input);
``bench`` runs as a real subprocess (the console script), and one password prompt
runs at a real pseudo-terminal. Every test asserts what the node holds afterwards,
not only what the CLI printed.
"""

from __future__ import annotations

import base64
import json
import os
import pty
import re
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from narad.cli.main import cli
from tests.harness import ADMIN_PASSWORD, Node, basic, wait_for


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("cli") / "data", workers=1).start()
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli-config")


def env_for(node: Node, cfg: Path, **over: str | None) -> dict[str, str | None]:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("NARAD_")}
    env.update({"NARAD_ADDR": f"127.0.0.1:{node.port}", "NARAD_USER": "admin", "NARAD_PASS": ADMIN_PASSWORD,
                "NARAD_CONFIG_DIR": str(cfg)})
    env.update(over)
    return env


def narad(node: Node, cfg: Path, *args: str, input: bytes | str | None = None, code: int = 0,
          **env: str | None) -> Result:
    r = CliRunner().invoke(cli, list(args), input=input, env=env_for(node, cfg, **env), catch_exceptions=False)
    assert r.exit_code == code, f"narad {' '.join(args)} exited {r.exit_code}:\n{r.stdout}\n{r.stderr}"
    return r


def lines(r: Result) -> list[Any]:
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()]


def one_error_line(r: Result) -> str:
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("narad: "), r.stderr
    return err[0]


def test_pub_then_sub_round_trip(node: Node, cfg: Path, tmp_path: Path) -> None:
    narad(node, cfg, "topic", "add", "rt", "--partitions", "3")
    r = narad(node, cfg, "pub", "rt", '{"id":1}', "-k", "k1", "--partition", "0")
    assert r.stderr.strip() == "accepted (8 bytes)"
    narad(node, cfg, "pub", "rt", "--partition", "0", input="plain text")  # the body from stdin
    f = tmp_path / "bin"
    f.write_bytes(b"\x00\x01\xff")
    narad(node, cfg, "pub", "rt", "-f", str(f), "--partition", "0")
    r = narad(node, cfg, "pub", "rt", "x", "--count", "3", "--partition", "1")
    assert re.match(r"accepted 3 messages in [\d.]+s \(\d+ msg/s\)", r.stderr.strip()), r.stderr
    # --idempotency-key (extension): repeats are accepted and not stored
    r = narad(node, cfg, "pub", "rt", "once", "--partition", "2", "--idempotency-key", "cli-1", "--count", "3")
    assert re.match(r"accepted 3 messages in [\d.]+s \(\d+ msg/s, 2 duplicate\(s\) not stored\)",
                    r.stderr.strip()), r.stderr
    r = narad(node, cfg, "pub", "rt", "once", "--partition", "2", "--idempotency-key", "cli-1", "--json")
    assert lines(r)[0]["duplicates"] == 1
    r = narad(node, cfg, "sub", "rt", "--partition", "2", "--max", "1", "--raw")
    assert r.stdout == "once\n"
    assert node.get("/v1/topics/rt/consume?partition=2").status == 204

    # --peek from offset 0 takes nothing: the queue still holds every message afterwards
    r = narad(node, cfg, "sub", "rt", "--peek", "--partition", "0", "--from", "0", "--max", "3", "--json")
    peeked = lines(r)
    assert [m["offset"] for m in peeked] == [0, 1, 2] and all("receipt_handle" not in m for m in peeked)
    assert peeked[0]["payload"] == {"id": 1} and peeked[0]["key"] == "k1"
    assert peeked[1]["payload"] == "plain text"
    assert peeked[2]["payload_encoding"] == "base64" and peeked[2]["payload"] == "AAH/"

    r = narad(node, cfg, "sub", "rt", "--partition", "0", "--max", "3", "--json")
    got = lines(r)
    assert sorted(m["offset"] for m in got) == [0, 1, 2] and all(m["receipt_handle"] for m in got)
    # they were acked: partition 0 has nothing left to deliver
    assert node.get("/v1/topics/rt/consume?partition=0").status == 204

    r = narad(node, cfg, "sub", "rt", "--partition", "1", "--max", "1")
    assert re.fullmatch(r"\[p1 @\d\] \d\d:\d\d:\d\d x", r.stdout.strip()), r.stdout
    assert "1 message(s)" in r.stderr
    r = narad(node, cfg, "sub", "rt", "--partition", "1", "--max", "1", "--raw", "--no-ack")
    assert r.stdout == "x\n"
    # --timeout ends a stream that has too little: exit 1, the count on stderr
    r = narad(node, cfg, "sub", "rt", "--partition", "2", "--max", "1", "--timeout", "300ms", code=1)
    assert "0 of 1 message(s)" in r.stderr

    r = narad(node, cfg, "replay", "rt", "--partition", "0")
    assert r.stdout.splitlines()[0].startswith("[p0 @0] key=k1 ") and r.stdout.splitlines()[0].endswith('{"id":1}')
    assert "(binary, 3 bytes)" in r.stdout and "0001ff" in r.stdout
    assert r.stderr.strip().endswith("3 message(s) replayed from p0 [0, 3)")


def test_topic_add_info_ls_rm(node: Node, cfg: Path) -> None:
    t = lines(narad(node, cfg, "topic", "add", "tl", "--retention", "2h", "--visibility", "45s", "--json"))[0]
    assert t["retention_ms"] == 7_200_000 and t["visibility_timeout_ms"] == 45_000
    info = json.loads(narad(node, cfg, "topic", "info", "tl").stdout)  # indented JSON without --json
    assert info["name"] == "tl" and len(info["partition_stats"]) == info["partitions"] == 3
    table = narad(node, cfg, "topic", "ls").stdout.splitlines()
    assert table[0].split() == ["NAME", "PARTITIONS", "RETENTION", "ROLE"]
    assert ["tl", "3", "2h0m0s", "-"] in [row.split() for row in table]
    # --json anywhere on the line
    for args in (["--json", "topic", "ls"], ["topic", "--json", "ls"], ["topic", "ls", "--json"]):
        assert "tl" in {row["name"] for row in lines(narad(node, cfg, *args))}
    narad(node, cfg, "topic", "edit", "tl", "--retention", "forever")
    assert node.get("/v1/topics/tl").json()["retention_ms"] == 0
    r = narad(node, cfg, "topic", "edit", "tl", "--visibility", "1s", code=2)
    assert "fixed when a topic is created" in r.stderr

    r = narad(node, cfg, "topic", "rm", "tl", input="n\n", code=1)  # declined
    assert 'delete topic "tl" and all its data? [y/N]' in r.stderr
    assert node.get("/v1/topics/tl").status == 200
    narad(node, cfg, "topic", "rm", "tl", input="y\n")
    assert node.get("/v1/topics/tl").status == 404
    narad(node, cfg, "topic", "add", "tl2")
    r = narad(node, cfg, "topic", "rm", "tl2", "-f")
    assert "[y/N]" not in r.stderr and node.get("/v1/topics/tl2").status == 404
    err = one_error_line(narad(node, cfg, "topic", "rm", "tl2", "-f", code=1))
    assert "not found" in err and "HTTP 404" in err


def test_attach_children_detach(node: Node, cfg: Path) -> None:
    narad(node, cfg, "topic", "add", "par")
    narad(node, cfg, "topic", "add", "kid")
    parent = lines(narad(node, cfg, "topic", "attach", "par", "kid", "--json"))[0]
    assert parent["role"] == "parent" and parent["children"] == ["kid"]
    narad(node, cfg, "topic", "add", "late", "--parent", "par", "--delay", "1m")
    narad(node, cfg, "pub", "par", "hello")
    wait_for(lambda: node.get("/v1/topics/kid/consume").status == 200, 15, what="the copy in the child")
    kids = {c["name"]: c for c in lines(narad(node, cfg, "topic", "children", "par", "--json"))}
    assert set(kids) == {"kid", "late"} and kids["late"]["delay_ms"] == 60_000
    table = narad(node, cfg, "topic", "children", "par").stdout
    assert re.search(r"^late\s+1m0s\s+>?=?\d+$", table, re.M), table
    narad(node, cfg, "topic", "detach", "par", "kid")
    assert node.get("/v1/topics/kid").json().get("role") in (None, "standalone")
    assert [c["name"] for c in lines(narad(node, cfg, "topic", "children", "par", "--json"))] == ["late"]


def test_bench_prints_figures(node: Node, cfg: Path) -> None:
    """The console script as a real process: produce and full-flow figures on stdout,
    the progress line on stderr."""
    narad(node, cfg, "topic", "add", "bench")
    exe = Path(sys.executable).with_name("narad")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "narad.cli.main"]
    env = {k: v for k, v in env_for(node, cfg).items() if v is not None}
    env.update({k: v for k, v in os.environ.items() if not k.startswith("NARAD_")})
    p = subprocess.run([*cmd, "bench", "bench", "--count", "300", "--workers", "4", "--size", "64", "--consume",
                        "--duration", "2s"], env=env, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    m = re.search(r"^produce: (\d+) ok, 0 failed in [\d.]+s; (\d+) msg/s; latency p50=[\d.]+ms p95=[\d.]+ms "
                  r"p99=[\d.]+ms$", p.stdout, re.M)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, p.stdout
    c = re.search(r"^consume: (\d+) msgs in [\d.]+s; \d+ msg/s; end-to-end p50=[\d.]+ms p95=[\d.]+ms p99=[\d.]+ms",
                  p.stdout, re.M)
    assert c and int(c.group(1)) == int(m.group(1)), p.stdout  # every message produced came back
    assert re.search(r"produced \d+/300 \(\d+ msg/s\), consumed \d+", p.stderr), p.stderr
    # all consumed and acked: nothing left
    assert node.get("/v1/topics/bench/consume").status == 204


def test_sub_stops_on_ctrl_c(node: Node, cfg: Path) -> None:
    """A real process: Ctrl-C ends a stream with exit 0 and the count on stderr."""
    narad(node, cfg, "topic", "add", "cc")
    env = {k: v for k, v in env_for(node, cfg).items() if v is not None}
    env.update({k: v for k, v in os.environ.items() if not k.startswith("NARAD_")})
    p = subprocess.Popen([sys.executable, "-m", "narad.cli.main", "sub", "cc", "--json"], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert node.post("/v1/topics/cc/produce", b"one").status == 202
        msg = json.loads(p.stdout.readline())  # blocks until it came (the test's timeout bounds it)
        assert msg["payload"] == "one"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert err.strip().splitlines()[-1] == "1 message(s)", err


def test_password_prompt_and_stdin(node: Node, cfg: Path) -> None:
    narad(node, cfg, "topic", "add", "pw")
    # no password anywhere: the prompt (on stderr) reads it from standard input
    r = narad(node, cfg, "topic", "ls", "--json", input=ADMIN_PASSWORD + "\n", NARAD_PASS=None)
    assert "Password for admin: " in r.stderr and ADMIN_PASSWORD not in r.stderr + r.stdout
    assert "pw" in {t["name"] for t in lines(r)}
    # --password-stdin: the first line is the password, the rest is pub's body
    narad(node, cfg, "pub", "pw", "--password-stdin", "--partition", "0", input=ADMIN_PASSWORD + "\nbody-1",
          NARAD_PASS=None)
    # (a produce is acknowledged from the ingress WAL; the partition log has it a moment later)
    def stored() -> Any:
        r = node.get("/v1/topics/pw/consume?partition=0&offset=0")
        return r.status == 200 and r.json()

    assert wait_for(stored, 15, what="the message")["payload"] == "body-1"
    # a flag wins over the environment
    err = one_error_line(narad(node, cfg, "topic", "ls", "-u", "nobody", "-p", "x", code=1))
    assert "HTTP 401" in err


def at_a_terminal(argv: list[str], env: dict[str, str], answers: list[tuple[bytes, bytes]]) -> tuple[str, int]:
    """Run `argv` on a real pseudo-terminal, typing each answer when its prompt shows:
    (everything the terminal showed, exit code)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec at once
        os.execve(argv[0], argv, env)
    out = b""
    todo = list(answers)
    end = time.monotonic() + 30
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
            if todo and todo[0][0] in out:
                os.write(fd, todo.pop(0)[1] + b"\n")
                out = out.replace(b"\r\n", b"\n")
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done:  # still waiting for something never typed: the deadline ends it
            time.sleep(0.5)
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    text = out.decode(errors="replace")
    assert not todo, f"prompts never shown: {todo}; terminal: {text}"
    return text, os.waitstatus_to_exitcode(status)


def test_password_prompt_at_a_terminal(node: Node, cfg: Path) -> None:
    """A real pseudo-terminal: the prompt hides what is typed (the narad CLI's login
    and naradctl users add's new password, asked twice)."""
    narad(node, cfg, "topic", "add", "tty")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NARAD_")}
    env.update({"NARAD_CONFIG_DIR": str(cfg), "NARAD_ADDR": f"127.0.0.1:{node.port}"})
    text, code = at_a_terminal([sys.executable, "-m", "narad.cli.main", "-u", "admin", "topic", "ls"], env,
                               [(b"Password for admin:", ADMIN_PASSWORD.encode())])
    assert code == 0, text
    assert ADMIN_PASSWORD not in text  # not echoed
    assert re.search(r"^tty\s+3\s", text, re.M), text
    sock = str(node.runtime_dir / "narad.sock")
    text, code = at_a_terminal([sys.executable, "-m", "narad.ctl.main", "--socket", sock, "users", "add", "ttyu"],
                               env, [(b"New password:", b"tty-secret-1"), (b"Repeat it:", b"tty-secret-1")])
    assert code == 0 and "tty-secret-1" not in text, text
    assert node.get("/v1/topics", auth=basic("ttyu", "tty-secret-1")).status == 200


def test_user_add_grant_passwd(node: Node, cfg: Path) -> None:
    u = lines(narad(node, cfg, "user", "add", "u1", "--grant", "produce:u1-*", "--grant", "consume:u1-a,u1-b",
                    "--user-password-stdin", "--json", input="u1-pass-1\n"))[0]
    assert u["grants"] == [{"action": "produce", "patterns": ["u1-*"]},
                           {"action": "consume", "patterns": ["u1-a", "u1-b"]}]
    u = lines(narad(node, cfg, "user", "grant", "u1", "--grant", "create:u1-*", "--json"))[0]
    assert u["grants"] == [{"action": "create", "patterns": ["u1-*"]}]
    assert node.get("/v1/users/u1").json()["grants"] == u["grants"]
    assert "u1" in {x["username"] for x in lines(narad(node, cfg, "user", "ls", "--json"))}
    # as u1 (a create grant): its own topic
    narad(node, cfg, "topic", "add", "u1-a", NARAD_USER="u1", NARAD_PASS="u1-pass-1")
    # admin sets u1's password (asked twice), then u1 changes its own (proving the current one)
    narad(node, cfg, "user", "passwd", "u1", input="u1-pass-2\nu1-pass-2\n")
    narad(node, cfg, "user", "passwd", "u1", "--new-password-stdin", input="u1-pass-3\n",
          NARAD_USER="u1", NARAD_PASS="u1-pass-2")
    assert node.get("/v1/topics/u1-a", auth=basic("u1", "u1-pass-3")).status == 200
    assert node.get("/v1/topics/u1-a", auth=basic("u1", "u1-pass-2")).status == 401
    r = narad(node, cfg, "user", "passwd", "u1", input="a\nb\n", code=1)
    assert "differ" in r.stderr
    narad(node, cfg, "user", "rm", "u1")
    assert node.get("/v1/users/u1").status == 404


def test_naradctl_users_passwd_and_grant(node: Node, cfg: Path) -> None:
    """The on-host recovery path: no password needed, root's own included."""
    p = subprocess.run([sys.executable, "-m", "narad.ctl.main", "--version"], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 0 and p.stdout.startswith("naradctl 0.1.0"), p.stdout + p.stderr
    narad(node, cfg, "user", "add", "u2", "--user-password-stdin", input="u2-pass-1\n")
    assert node.ctl("users", "passwd", "u2", "--password", "u2-pass-2") == {"username": "u2", "password": "changed"}
    assert node.get("/v1/topics", auth=basic("u2", "u2-pass-2")).status == 200
    assert node.get("/v1/topics", auth=basic("u2", "u2-pass-1")).status == 401
    u = node.ctl("users", "grant", "u2", "--grant", "consume:u2-*")
    assert u["grants"] == [{"action": "consume", "patterns": ["u2-*"]}]
    assert node.get("/v1/users/u2").json()["grants"] == u["grants"]
    # the root admin's lost password: reset on the host, then used over HTTP by the CLI
    try:
        node.ctl("users", "passwd", "admin", "--password", "new-root-pass-1")
        narad(node, cfg, "user", "ls", NARAD_PASS="new-root-pass-1")
        one_error_line(narad(node, cfg, "user", "ls", code=1))  # the old one is refused
    finally:
        node.ctl("users", "passwd", "admin", "--password", ADMIN_PASSWORD)
    assert node.get("/v1/users").status == 200


def test_errors_usage_and_contexts(node: Node, cfg: Path, tmp_path: Path) -> None:
    r = narad(node, cfg, "topic", "add", "x", "--retention", "5 parsecs", code=2)
    assert "not a duration" in r.stderr
    narad(node, cfg, "sub", "cx", "--from", "3", code=2)
    err = one_error_line(narad(node, cfg, "topic", "ls", "-s", "127.0.0.1:1", code=1))
    assert "could not connect to 127.0.0.1:1" in err
    members = lines(narad(node, cfg, "cluster", "members", "--json"))
    assert [(m["id"], m["leader"]) for m in members] == [("n1", True)]
    assert "_NARAD_COMPLETE" in narad(node, cfg, "completion", "bash").stdout
    assert narad(node, cfg, "version", "--json").stdout.strip() == '{"version":"0.1.0","build":"narad-py/0.1.0"}'
    assert "--max N" in narad(node, cfg, "help", "sub").stdout

    narad(node, cfg, "topic", "add", "cx")
    # contexts: saved 0600, used when nothing else is given, --ctx refused while env is set
    ctx_dir = tmp_path / "ctx"
    bare = {"NARAD_ADDR": None, "NARAD_USER": None, "NARAD_PASS": None, "NARAD_CONFIG_DIR": str(ctx_dir)}
    narad(node, cfg, "ctx", "add", "here", "--server", f"http://127.0.0.1:{node.port}", "--user", "admin",
          "--password-stdin", input=ADMIN_PASSWORD + "\n", **bare)
    narad(node, cfg, "ctx", "add", "nowhere", "--server", "http://127.0.0.1:1", **bare)
    f = ctx_dir / "contexts.json"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert json.loads(f.read_text())["current"] == "here"
    assert narad(node, cfg, "ctx", "ls", **bare).stdout.splitlines()[1].startswith("* here ")
    assert "cx" in {t["name"] for t in lines(narad(node, cfg, "topic", "ls", "--json", **bare))}
    one_error_line(narad(node, cfg, "--ctx", "nowhere", "topic", "ls", code=1, **bare))
    r = narad(node, cfg, "--ctx", "here", "topic", "ls", code=2, **{**bare, "NARAD_USER": "admin"})
    assert "--ctx is refused while NARAD_USER is set" in r.stderr
    narad(node, cfg, "ctx", "rm", "here", **bare)
    assert json.loads(f.read_text()).get("current", "") == ""


def test_every_option_has_help() -> None:
    """Walk the whole command tree: every option (global ones included) says what it does."""
    missing: list[str] = []

    def walk(cmd: click.Command, path: str) -> None:
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.help:
                missing.append(f"{path} {p.opts[0]}")
        if not (cmd.help or cmd.short_help or cmd.callback is None or cmd.callback.__doc__):
            missing.append(f"{path} (no command help)")
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, f"{path} {name}")

    walk(cli, "narad")
    assert not missing, missing


def test_pub_headers_and_topic_delivery_settings(node: Node, cfg: Path) -> None:
    narad(node, cfg, "topic", "add", "cli-dlq", "--partitions", "3")
    t = lines(narad(node, cfg, "topic", "add", "cli-src", "--partitions", "3", "--max-deliveries", "4",
                    "--dead-letter-topic", "cli-dlq", "--idempotency-window", "2m", "--json"))[0]
    assert (t["max_deliveries"], t["dead_letter_topic"], t["idempotency_window_ms"]) == (4, "cli-dlq", 120_000)
    t = lines(narad(node, cfg, "topic", "edit", "cli-src", "--max-deliveries", "0", "--dead-letter-topic", "",
                    "--json"))[0]
    assert "max_deliveries" not in t and "dead_letter_topic" not in t
    narad(node, cfg, "pub", "cli-src", '{"h":1}', "--partition", "0", "-H", "trace:abc", "--header", "url:http://x:1")
    m = lines(narad(node, cfg, "sub", "cli-src", "--partition", "0", "--max", "1", "--json"))[0]
    assert m["payload"] == {"h": 1} and m["headers"] == {"trace": "abc", "url": "http://x:1"}
    r = narad(node, cfg, "pub", "cli-src", "x", "-H", "novalue", code=2)
    assert "NAME:VALUE" in r.stderr
    # A name given twice is refused (the node refuses it too), not sent with its last value only.
    before = sum(p["high_watermark"] for p in node.get("/v1/topics/cli-src").json()["partition_stats"])
    r = narad(node, cfg, "pub", "cli-src", "x", "-H", "a:1", "-H", "a:2", code=2)
    assert "given twice" in r.stderr
    assert sum(p["high_watermark"] for p in node.get("/v1/topics/cli-src").json()["partition_stats"]) == before


def test_sub_millisecond_durations_round_up_never_to_the_default(node: Node, cfg: Path) -> None:
    """A duration under a millisecond is 1 ms, not 0: ``--idempotency-window 0.4ms`` used
    to become 0, which the node takes for "the default" (5 min), silently. Now the node
    sees 1 ms and says what the window may be; no topic is made."""
    from narad.cli.fmt import parse_duration

    assert [parse_duration(v) for v in ("0.4ms", "500us", "1ns", "0.5ns", "1.1s", "0", "0s", "0.0ms", "2.5s")] == [
        1, 1, 1, 1, 1100, 0, 0, 0, 2500]
    r = narad(node, cfg, "topic", "add", "cli-tiny", "--partitions", "3", "--idempotency-window", "0.4ms", code=1)
    assert "idempotency_window_ms" in one_error_line(r) and "got 1" in r.stderr
    assert node.get("/v1/topics/cli-tiny").status == 404


def test_topic_redrive(node: Node, cfg: Path) -> None:
    """``narad topic redrive`` moves a dead-letter topic's messages back (issue 14); the
    node then holds them in the origin topic and no longer in the dead-letter topic."""
    for body in ({"name": "cl-dlt", "partitions": 3},
                 {"name": "cl-src", "partitions": 3, "max_deliveries": 1, "dead_letter_topic": "cl-dlt"}):
        assert node.post("/v1/topics", body).status == 201
    assert node.post("/v1/topics/cl-src/produce", b"poison", headers={"Content-Type": "text/plain"}).status == 202
    m = wait_for(lambda: (lambda r: r.json() if r.status == 200 else None)(node.get("/v1/topics/cl-src/consume")),
                 10, 0.02, "the record")
    assert node.post(f"/v1/topics/cl-src/ack?receipt_handle={m['receipt_handle']}&extend=0").status == 204
    wait_for(lambda: sum(p["lag"] for p in node.get("/v1/topics/cl-dlt").json()["partition_stats"]) == 1, 10, 0.05,
             "the dead-letter copy")
    r = narad(node, cfg, "topic", "redrive", "cl-dlt", "--max", "5", "--json")
    assert lines(r) == [{"topic": "cl-dlt", "redriven": 1, "skipped": 0}]
    narad(node, cfg, "topic", "redrive", "cl-dlt", "--max", "0", code=2)
    back = wait_for(lambda: (lambda r: r.json() if r.status == 200 else None)(node.get("/v1/topics/cl-src/consume")),
                    10, 0.02, "the record back")
    assert back["payload"] == "poison" and back["delivery_count"] == 1
    assert node.get("/v1/topics/cl-dlt/consume").status == 204
    r = narad(node, cfg, "topic", "redrive", "cl-dlt")
    assert "redrove 0 message(s)" in r.stderr


def test_sub_json_shows_delivery_count_and_dead_letter(node: Node, cfg: Path) -> None:
    """``sub --json`` prints the node's message shape with the extensions a record or a
    delivery has: ``delivery_count`` and a dead-letter copy's origin (found by a review
    of issue 14: only headers were printed)."""
    for body in ({"name": "cj-dlt", "partitions": 3},
                 {"name": "cj-src", "partitions": 3, "max_deliveries": 1, "dead_letter_topic": "cj-dlt"}):
        assert node.post("/v1/topics", body).status == 201
    narad(node, cfg, "pub", "cj-src", "poison", "--partition", "1", "-k", "kk")
    back = wait_for(lambda: (lambda r: r.json() if r.status == 200 else None)(
        node.get("/v1/topics/cj-src/consume?partition=1")), 10, 0.05, "the record")
    assert node.post(f"/v1/topics/cj-src/ack?receipt_handle={back['receipt_handle']}&extend=0&reason=bad"
                     ).status == 204
    narad(node, cfg, "pub", "cj-src", "fine", "--partition", "2")
    m = lines(narad(node, cfg, "sub", "cj-src", "--partition", "2", "--max", "1", "--json"))[0]
    assert m["delivery_count"] == 1 and m["payload"] == "fine"
    wait_for(lambda: sum(p["lag"] for p in node.get("/v1/topics/cj-dlt").json()["partition_stats"]) == 1, 10, 0.05,
             "the dead-letter copy")
    d = lines(narad(node, cfg, "sub", "cj-dlt", "--max", "1", "--json"))[0]
    assert d["dead_letter"]["topic"] == "cj-src" and d["dead_letter"]["partition"] == 1
    assert d["dead_letter"]["key"] == "kk" and d["dead_letter"]["delivery_count"] == 1
    assert d["dead_letter"]["reason"] == "bad" and "delivery_count" in d


def test_pub_takes_binary_arguments_or_says_what_must_be_text(node: Node, cfg: Path) -> None:
    """Arguments that are not UTF-8 (kept by Python as surrogates): the message and the
    key are sent as their bytes; a header or an idempotency key must be text, a usage
    error (each was a traceback). Found by a review of issue 14."""
    assert node.post("/v1/topics", {"name": "cb-src", "partitions": 3}).status == 201
    bad = b"\xff\xfe".decode("utf-8", "surrogateescape")
    narad(node, cfg, "pub", "cb-src", bad, "--partition", "0", "-k", bad)
    m = wait_for(lambda: (lambda r: r.json() if r.status == 200 else None)(
        node.get("/v1/topics/cb-src/consume?partition=0")), 10, 0.05, "the binary message")
    assert (m["payload_encoding"], m["key_encoding"]) == ("base64", "base64")
    assert base64.b64decode(m["payload"]) == b"\xff\xfe" == base64.b64decode(m["key"])
    assert "not UTF-8" in narad(node, cfg, "pub", "cb-src", "x", "-H", f"a:{bad}", code=2).stderr
    assert "UTF-8" in narad(node, cfg, "pub", "cb-src", "x", "--idempotency-key", bad, code=2).stderr


def test_ack_nack_extend_by_handle_and_sub_visibility(node: Node, cfg: Path) -> None:
    """``narad ack`` / ``nack`` / ``extend`` settle leases taken by ``sub --no-ack``
    (issue 14's retry controls from the command line), and ``sub --visibility`` sets
    one consume's lease. What the node does afterwards is asserted: a nack with
    ``--delay`` is not delivered before it, an extended lease outlives the one it
    replaced, an acked message never comes back (a second ack is a 410 and exit 1), a
    1 s lease on a 60 s topic lapses within seconds, and the plain output shows a
    redelivery's count and headers, and a dead-letter copy's origin and reason."""
    narad(node, cfg, "topic", "add", "cs-dlt", "--partitions", "3")
    narad(node, cfg, "topic", "add", "cs", "--partitions", "3", "--visibility", "60s", "--max-deliveries", "3",
          "--dead-letter-topic", "cs-dlt")
    for body in ("a", "b", "c"):
        narad(node, cfg, "pub", "cs", body, "--partition", "0", "-H", "n:" + body)
    first = lines(narad(node, cfg, "sub", "cs", "--partition", "0", "--max", "3", "--no-ack", "--visibility", "8s",
                        "--json"))
    by = {m["payload"]: m for m in first}
    assert sorted(by) == ["a", "b", "c"] and all(m["delivery_count"] == 1 for m in first)
    assert by["a"]["headers"] == {"n": "a"}
    # A 60 s lease for "a", a nack of "b" for 2 s, an ack of "c" read from a `sub --json`
    # line on standard input.
    t0 = time.time()
    r = narad(node, cfg, "extend", "cs", by["a"]["receipt_handle"], "--visibility", "60s")
    assert "extended 1 of 1 message(s)" in r.stderr
    narad(node, cfg, "nack", "cs", by["b"]["receipt_handle"], "--delay", "2s", "--reason", "slow")
    r = narad(node, cfg, "ack", "cs", "-", "--json", input=json.dumps(by["c"]) + "\n")
    assert lines(r) == [{"receipt_handle": by["c"]["receipt_handle"], "status": 204}]

    def take() -> dict[str, Any] | None:
        r = node.get("/v1/topics/cs/consume?partition=0")
        return r.json() if r.status == 200 else None

    b = wait_for(take, 10, 0.05, "the nacked message back")
    assert b["payload"] == "b" and b["delivery_count"] == 2
    assert time.time() - t0 >= 2.0, "delivered before its --delay"
    r = narad(node, cfg, "ack", "cs", by["c"]["receipt_handle"], code=1)
    assert "410" in r.stderr and "1 of 1 handle(s) not settled" in r.stderr
    # The third delivery, in the plain form, under a 1 s lease: it lapses (the topic's
    # 60 s would not, within the wait below) and, at max_deliveries, the record is
    # dead-lettered with the last nack's reason. "a" stays leased past its first 8 s.
    narad(node, cfg, "nack", "cs", b["receipt_handle"], "--reason", "again")
    r = narad(node, cfg, "sub", "cs", "--partition", "0", "--max", "1", "--no-ack", "--visibility", "1s")
    assert re.fullmatch(r'\[p0 @1\] delivery=3 headers=\{"n":"b"\} \d\d:\d\d:\d\d b', r.stdout.strip()), r.stdout
    wait_for(lambda: sum(p["lag"] for p in node.get("/v1/topics/cs-dlt").json()["partition_stats"]) == 1, 15, 0.05,
             "the dead-letter copy")
    r = narad(node, cfg, "sub", "cs-dlt", "--max", "1")
    assert ' dead-letter-of=cs/p0@1 after=3 reason="again" ' in r.stdout, r.stdout
    wait_for(lambda: time.time() - t0 > 9, 15, 0.1, "the first lease's 8 s")
    assert node.get("/v1/topics/cs/consume?partition=0").status == 204  # "a": extended to 60 s
    # Bad input: a usage error (exit 2) naming what to fix, nothing sent.
    r = narad(node, cfg, "nack", "cs", "not-a-handle", code=2)
    assert "partition:offset:nonce" in r.stderr
    r = narad(node, cfg, "ack", "cs", "-", input="\n", code=2)
    assert "no receipt handle" in r.stderr
    r = narad(node, cfg, "ack", "cs", "-", input='{"a":' + "[" * 100_000 + "\n", code=2)  # (too deep for json)
    assert "without a receipt_handle" in r.stderr
