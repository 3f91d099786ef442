"""The monitoring kit in config/monitoring: Prometheus alert rules (alerts.yml) checked and
unit-tested by promtool (alerts_test.yml), the Grafana dashboard's structure and PromQL, and
every metric name (and label) the rules or panels use present in a real node's /metrics after
traffic; then a real Prometheus scrapes that node with alerts.yml loaded: every panel's query
answers data, every rule evaluates without error and none fires on the healthy node.

promtool and the Prometheus server come from Debian's ``prometheus`` package (``make test``
installs it); the tests that need them skip, saying so, only when they are not installed.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ADMIN_PASSWORD, Node, free_ports, wait_for

MON = Path(__file__).resolve().parent.parent / "config" / "monitoring"
RULES = MON / "alerts.yml"
RULE_TESTS = MON / "alerts_test.yml"
DASHBOARD = MON / "grafana-dashboard.json"

# Names the dashboard or the rules use that a node does not export yet. H-METRICS (issue 12) is
# adding Narad's series (narad-api.md section 6) alongside this kit: each name here must be
# delivered by the node, then removed from this set. The test fails both ways: a used name
# missing from /metrics and not listed here, and a listed name the node now exports.
PENDING_H_METRICS: frozenset[str] = frozenset()

# Series with no samples until their first event (their label values are not known before it):
# the node must declare them (a TYPE line in /metrics) and the panels still show them.
EVENT_ONLY: dict[str, str] = {  # name -> why it has no samples yet
    "narad_decommission_blocked": "a series exists only while a draining member's removal waits (leader)",
    "narad_dead_letter_held": "a series per source topic exists once a record of it was held for a dead-letter topic",
    "narad_dead_letter_failures_total": "a series per source topic exists once a dead-letter commit of it failed",
}

# Series the rules use that Prometheus makes, not the node.
FROM_PROMETHEUS = frozenset({"up"})

NAME = re.compile(r"\b((?:narad|process)_[A-Za-z0-9_]*[A-Za-z0-9])\b")
SELECTOR = re.compile(r"\b((?:narad|process)_[A-Za-z0-9_]+)\b(\{[^}]*\})?")
GRAFANA_BUILTINS = frozenset({"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"})
PANEL_TYPES = frozenset({"row", "timeseries", "stat", "state-timeline", "gauge", "bargauge", "table", "text"})


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; `make test` installs it)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, cwd=MON)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panel_targets(d: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for p in d["panels"]:
        for t in p.get("targets", []):
            yield p, t


def as_promql(expr: str) -> str:
    """A panel's expression with Grafana's variables replaced, as Prometheus would get it."""
    expr = re.sub(r"\$(__\w+)", "5m", expr)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def used_names() -> set[str]:
    """Every narad_* / process_* name in the rules (expressions and annotations) and in the
    dashboard (targets, variable queries, descriptions)."""
    return set(NAME.findall(RULES.read_text())) | set(NAME.findall(DASHBOARD.read_text()))


# ---------------------------------------------------------------------------- rules


def test_promtool_checks_the_rules() -> None:
    r = run_promtool("check", "rules", RULES.name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout, r.stdout


def test_promtool_unit_tests_of_every_alert_pass() -> None:
    r = run_promtool("test", "rules", RULE_TESTS.name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout and "FAILED" not in r.stdout, r.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    alerts = re.findall(r"^\s*- alert: (\w+)\s*$", RULES.read_text(), re.M)
    assert len(alerts) == len(set(alerts)) and len(alerts) >= 10, alerts
    fires: set[str] = set()
    quiet: set[str] = set()
    for name, empty in re.findall(r"alertname: (\w+)\s*\n\s*exp_alerts:[ \t]*(\[\])?", RULE_TESTS.read_text()):
        (quiet if empty else fires).add(name)
    assert (fires | quiet) <= set(alerts), f"tests of alerts that do not exist: {(fires | quiet) - set(alerts)}"
    assert not set(alerts) - fires, f"alerts never tested firing: {sorted(set(alerts) - fires)}"
    assert not set(alerts) - quiet, f"alerts never tested staying quiet: {sorted(set(alerts) - quiet)}"
    for required in ("NaradConsumerLoss", "NaradDiskRunwayShort", "NaradConsumerLagGrowing", "NaradTargetDown",
                     "NaradNodeNotReady", "NaradIngressWalFailed", "NaradDispatchBacklogStuck", "NaradNoRaftLeader",
                     "NaradWorkersRestarting", "NaradOldestUnconsumedMessageOld"):
        assert required in alerts, required


# ---------------------------------------------------------------------------- dashboard


def test_dashboard_is_a_grafana_dashboard() -> None:
    d = dashboard()
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["title"] and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", d["uid"])
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance", "topic"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}", v
        assert v["definition"].startswith("label_values(") and v["query"] == v["definition"], v
        assert v["includeAll"] and v["allValue"] == ".*", v

    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), ids
    boxes: list[tuple[str, int, int, int, int]] = []
    for p in d["panels"]:
        assert p["type"] in PANEL_TYPES, p["type"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["x"] >= 0 and g["y"] >= 0, p["title"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        for (title, x, y, w, h) in boxes:
            overlap = g["x"] < x + w and x < g["x"] + g["w"] and g["y"] < y + h and y < g["y"] + g["h"]
            assert not overlap, f"panels {title!r} and {p['title']!r} overlap"
        boxes.append((p["title"], g["x"], g["y"], g["w"], g["h"]))
        if p["type"] == "row":
            continue
        assert p["title"] and p.get("description"), p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}", (p["title"], t)

    # Every variable an expression uses exists; every node series is filtered by the job and
    # instance variables.
    for p, t in panel_targets(d):
        for var in re.findall(r"\$\{?(\w+)\}?", t["expr"]):
            assert var in variables or var in GRAFANA_BUILTINS, (p["title"], var)
        for name, matchers in SELECTOR.findall(t["expr"]):
            for want in ('job=~"$job"', 'instance=~"$instance"'):
                assert want in matchers, f"{p['title']}: {name} is not filtered by {want}"

    # The panels the operator needs, by the series they show.
    exprs = " ".join(t["expr"] for _, t in panel_targets(d))
    for needed in ("narad_messages_produced_total", "narad_messages_consumed_total", "narad_consumer_lag_messages",
                   "narad_oldest_unconsumed_message_age_seconds", "narad_inflight_size",
                   "narad_http_request_duration_seconds_bucket", 'status=~"5.."',
                   "narad_storage_fsync_duration_seconds_bucket", "narad_data_dir_size_bytes",
                   "narad_data_dir_available_bytes", "deriv(narad_data_dir_available_bytes", "narad_ingress_wal_failed",
                   "narad_ingress_dispatch_backlog_records", "narad_raft_state", "narad_raft_has_leader",
                   "narad_worker_restarts_total", "narad_fanout_lag_messages"):
        assert needed in exprs, f"no panel shows {needed}"


def test_every_dashboard_expression_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel's expression (variables replaced) as a recording rule."""
    rules = [{"record": f"dashboard:panel{p['id']}:{t['refId']}", "expr": as_promql(t["expr"])}
             for p, t in panel_targets(dashboard())]
    f = tmp_path / "dashboard-rules.yml"
    f.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    r = subprocess.run([promtool(), "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout, r.stdout


# ---------------------------------------------------------------------------- a real node


class Stack:
    """The module's real node and, when the server is installed, a real Prometheus scraping it."""

    def __init__(self, node: Node, prometheus: str | None) -> None:
        self.node = node
        self.prometheus = prometheus


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("monitoring")
    n = Node(tmp / "data", workers=1)
    # Prometheus first: its scrape manager applies the targets ~5 s after start, which then
    # overlaps the node's boot.
    with start_prometheus(n.port, tmp / "prometheus") as base:
        try:
            n.start()
            traffic(n)
            yield Stack(n, base)
        finally:
            n.close()


LABEL = re.compile(r'(\w+)="(?:[^"\\]|\\.)*"')
FROM_SCRAPE = frozenset({"instance", "job"})  # labels Prometheus adds to every series


def sample_labels(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry, from the Prometheus text format."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, brace, rest = line.partition("{")
        if not brace:
            name = name.split(" ", 1)[0]
        out.setdefault(name, set()).update(LABEL.findall(rest.rsplit("}", 1)[0]) if brace else ())
    return out


def labels_of(name: str, samples: dict[str, set[str]]) -> set[str]:
    for n in (name, name + "_bucket", name + "_count"):
        if n in samples:
            return samples[n]
    return set()


def label_uses(expr: str) -> Iterator[tuple[str, str]]:
    """(metric, label) pairs an expression relies on: the labels of each selector's matchers,
    and the labels of a ``by (...)`` clause for every metric inside that aggregation."""
    for name, matchers in SELECTOR.findall(expr):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
            yield name, label
    for m in re.finditer(r"\bby\s*\(([^)]*)\)\s*\(", expr):
        depth, i = 1, m.end()
        while depth and i < len(expr):
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        for name in NAME.findall(expr[m.end():i]):
            for label in re.findall(r"\w+", m.group(1)):
                yield name, label


def rule_exprs() -> list[str]:
    """The expressions of alerts.yml (single-line or folded ``>`` blocks)."""
    out: list[str] = []
    lines = RULES.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)expr: ?(.*)$", line)
        if not m:
            continue
        if m.group(2).strip() != ">":
            out.append(m.group(2))
            continue
        body = []
        for nxt in lines[i + 1:]:
            if len(nxt) - len(nxt.lstrip()) <= len(m.group(1)):
                break
            body.append(nxt.strip())
        out.append(" ".join(body))
    return out


def exported(name: str, samples: dict[str, set[str]] | set[str]) -> bool:
    return name in samples or any(name + suffix in samples for suffix in ("_bucket", "_count", "_sum"))


def traffic(node: Node) -> None:
    """A topic with a fan-out child; produce, consume, ack, extend and nack."""
    assert node.post("/v1/topics", {"name": "mon", "partitions": 3}).status == 201
    assert node.post("/v1/topics", {"name": "mon-copy", "partitions": 3}).status == 201
    assert node.post("/v1/topics/mon/children", {"child": "mon-copy"}).status == 200
    octet = {"Content-Type": "application/octet-stream"}
    for i in range(6):
        assert node.request("POST", "/v1/topics/mon/produce", b"m%d" % i, headers=octet).status == 202
    got: list[dict[str, Any]] = []

    def consume() -> bool:
        r = node.get("/v1/topics/mon/consume?max=10&wait=1s", headers={"X-Narad-Client": "tests"})
        if r.status == 200:
            got.extend(r.json()["messages"])
        return len(got) >= 3

    wait_for(consume, 20, 0.05, "three deliveries")
    h = [m["receipt_handle"] for m in got]
    assert node.post(f"/v1/topics/mon/ack?receipt_handle={h[0]}").status == 204
    assert node.post(f"/v1/topics/mon/ack?receipt_handle={h[1]}&extend=true").status in (200, 204)
    assert node.post(f"/v1/topics/mon/ack?receipt_handle={h[2]}&extend=0").status in (200, 204)
    assert node.get("/v1/no-such-route").status == 404


def test_every_metric_the_rules_and_panels_use_is_exported(stack: Stack) -> None:
    node = stack.node
    used = used_names()
    assert len(used) >= 40, sorted(used)
    assert not PENDING_H_METRICS - used, f"pending names no rule or panel uses: {PENDING_H_METRICS - used}"
    required = used - PENDING_H_METRICS - EVENT_ONLY.keys()
    seen: dict[str, set[str]] = {}

    def scrape() -> dict[str, set[str]]:
        r = node.get("/metrics")
        assert r.status == 200, r
        seen.clear()
        seen.update(sample_labels(r.body.decode()))
        return seen

    # Partition gauges come from a poller (every 5 s): wait for what must be there...
    try:
        wait_for(lambda: all(exported(n, scrape()) for n in required), 20, 0.25, "the metrics in use")
    except AssertionError:
        pass  # reported below, with the names
    # ...and, while names are pending, a poller period more for them.
    if PENDING_H_METRICS:
        end = time.monotonic() + 7
        while time.monotonic() < end and not all(exported(n, scrape()) for n in PENDING_H_METRICS):
            time.sleep(0.25)
    text = node.get("/metrics").body.decode()
    for name, why in EVENT_ONLY.items():
        assert f"# TYPE {name} " in text, f"{name} ({why}) is not declared in /metrics"
    missing = {n for n in used if not exported(n, seen)} - EVENT_ONLY.keys()
    unexpected = sorted(missing - PENDING_H_METRICS)
    assert not unexpected, f"used by config/monitoring but not in a node's /metrics: {unexpected}"
    delivered = sorted(PENDING_H_METRICS - missing)
    assert not delivered, f"now exported by the node: remove from PENDING_H_METRICS: {delivered}"

    # The labels the rules and panels select or group by exist on those series.
    exprs = rule_exprs() + [t["expr"] for _, t in panel_targets(dashboard())]
    assert len(rule_exprs()) == len(re.findall(r"^\s*- alert: ", RULES.read_text(), re.M))
    wrong = sorted({f"{name}: {label}" for e in exprs for name, label in label_uses(e)
                    if label not in FROM_SCRAPE and exported(name, seen)
                    and label not in labels_of(name, seen)})
    assert not wrong, f"labels the series do not carry: {wrong}"

    # A legend names only labels the panel's result keeps: those of its by (...) clauses when it
    # aggregates, else those of the series it shows.
    bad = []
    for p, t in panel_targets(dashboard()):
        names = [n for n in NAME.findall(t["expr"]) if exported(n, seen)]
        if not names:
            continue
        groups = re.findall(r"\bby\s*\(([^)]*)\)", t["expr"])
        keep = ({lb for g in groups for lb in re.findall(r"\w+", g)} if groups
                else set.union(*(labels_of(n, seen) for n in names)) | FROM_SCRAPE)
        bad += [f"{p['title']}: {lb}" for lb in re.findall(r"\{\{\s*(\w+)\s*\}\}", t["legendFormat"]) if lb not in keep]
    assert not bad, f"legends name labels the result does not have: {bad}"


# ---------------------------------------------------------------------------- a real Prometheus

# Panel expressions that may rightly answer nothing on a healthy, lightly used node.
MAY_BE_EMPTY = {
    'status=~"5.."': "no 5xx answered",
    "-deriv(narad_data_dir_available_bytes": "shown only while the free space shrinks",
}


@contextlib.contextmanager
def start_prometheus(target_port: int, d: Path) -> Iterator[str | None]:
    """A real Prometheus (Debian's `prometheus` package, like promtool) scraping 127.0.0.1:
    ``target_port`` every second as job "narad", with alerts.yml loaded: its base URL, or None
    when the server is not installed."""
    exe = shutil.which("prometheus")
    if exe is None:
        yield None
        return
    d.mkdir(parents=True)
    port = free_ports(1)[0]
    cfg = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
           "rule_files": [str(RULES)],
           "scrape_configs": [{"job_name": "narad",
                               "basic_auth": {"username": "admin", "password": ADMIN_PASSWORD},
                               "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}]}
    (d / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is YAML
    with open(d / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([exe, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, (d / "prometheus.log").read_text()[-3000:]
            with urllib.request.urlopen(base + "/-/ready", timeout=5) as r:
                return r.status == 200  # type: ignore[no-any-return]

        wait_for(ready, 30, 0.1, "prometheus to be ready")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def prometheus(stack: Stack) -> str:
    if stack.prometheus is None:
        pytest.skip("the prometheus server is not installed (Debian package `prometheus`; `make test` installs it)")
    return stack.prometheus


def prom(base: str, path: str, **params: str) -> Any:
    url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def test_a_real_prometheus_scrapes_the_node_and_every_panel_shows_data(prometheus: str) -> None:
    # Enough scrapes (3) for rate() over the 5 s that stands in for $__rate_interval.
    wait_for(lambda: prom(prometheus, "/api/v1/query", query='count_over_time(up{job="narad"}[10s]) >= 3'
                          ' and on() min(up{job="narad"}) == 1')["result"], 30, 0.25, "three scrapes of the node")
    empty = []
    for p, t in panel_targets(dashboard()):
        q = re.sub(r"\$(__\w+)", "5s", t["expr"])
        q = re.sub(r"\$\{?(\w+)\}?", ".*", q)
        if not any(k in t["expr"] for k in MAY_BE_EMPTY) and not prom(prometheus, "/api/v1/query", query=q)["result"]:
            empty.append(f"{p['title']} {t['refId']}: {t['expr']}")
    assert not empty, "panels without data from a scraped node:\n" + "\n".join(empty)
    # The variables' label_values(selector, label) queries list the node, its job and its topics.
    values: dict[str, list[str]] = {}
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", v["definition"])
            assert m, v["definition"]
            selector, label = as_promql(m.group(1)), m.group(2)
            values[v["name"]] = prom(prometheus, f"/api/v1/label/{label}/values", **{"match[]": selector})
    assert values["job"] == ["narad"] and len(values["instance"]) == 1 and "mon" in values["topic"], values


def test_the_rules_load_evaluate_and_stay_quiet_on_a_healthy_node(prometheus: str) -> None:
    def evaluated() -> list[dict[str, Any]]:
        rules = [r for g in prom(prometheus, "/api/v1/rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r["health"] != "unknown" for r in rules) else []

    rules = wait_for(evaluated, 30, 0.25, "every rule evaluated once")
    alerts = re.findall(r"^\s*- alert: (\w+)\s*$", RULES.read_text(), re.M)
    assert sorted(r["name"] for r in rules) == sorted(alerts)
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    firing = [a for a in prom(prometheus, "/api/v1/alerts")["alerts"] if a["state"] == "firing"]
    assert not firing, firing
