"""Locust load test for Narad's /v1 message API.

Two user classes (equal weight by default):

* ``ProducerUser``: single produce (``POST /v1/topics/{t}/produce``, 202) and
  batch produce (``POST /v1/topics/{t}/produce/batch``, 202 ``{"accepted":N}``),
  3:1 by default;
* ``ConsumerUser``: long-poll consume (``GET /v1/topics/{t}/consume?wait=..``,
  200 or 204 when nothing arrived) and ack of what it got (single ack 204, or
  a batch ack 200 ``{"results":[...]}`` when ``NARAD_CONSUME_MAX`` > 1).

Configuration (environment):

    NARAD_USER / NARAD_PASS   HTTP Basic credentials (default admin / empty)
    NARAD_TOPIC               topic, created on start if missing (default "locust")
    NARAD_PARTITIONS          partitions when it is created (default 6)
    NARAD_MSG_SIZE            bytes per message (default 1024)
    NARAD_BATCH               messages per batch produce (default 100)
    NARAD_CONSUME_WAIT        consume long-poll, a Go duration (default "1s")
    NARAD_CONSUME_MAX         1 = single consume + single ack; 2..100 = batch consume + batch ack (default 1)
    NARAD_THINK               seconds each user waits between tasks (default 0)

Run headless against a node (see loadtest/README.md):

    NARAD_USER=admin NARAD_PASS=... .venv/bin/locust -f loadtest/locustfile.py --headless \\
        -u 4 -r 4 -t 10s --host http://127.0.0.1:PORT
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import threading
from typing import Any

from locust import FastHttpUser, constant, events, task
from locust.env import Environment

USER = os.environ.get("NARAD_USER", "admin")
PASS = os.environ.get("NARAD_PASS", "")
TOPIC = os.environ.get("NARAD_TOPIC", "locust")
PARTITIONS = int(os.environ.get("NARAD_PARTITIONS", "6"))
MSG_SIZE = int(os.environ.get("NARAD_MSG_SIZE", "1024"))
BATCH = int(os.environ.get("NARAD_BATCH", "100"))
CONSUME_WAIT = os.environ.get("NARAD_CONSUME_WAIT", "1s")
CONSUME_MAX = int(os.environ.get("NARAD_CONSUME_MAX", "1"))
THINK = float(os.environ.get("NARAD_THINK", "0"))

AUTH = "Basic " + base64.b64encode(f"{USER}:{PASS}".encode()).decode()
HEADERS = {"Authorization": AUTH, "X-Narad-Client": "locust"}
JSON_HEADERS = {**HEADERS, "Content-Type": "application/json"}
BASE = f"/v1/topics/{TOPIC}"

_seq = itertools.count()
_topic_lock = threading.Lock()
_topic_ready = False


def message() -> bytes:
    """One JSON message of exactly MSG_SIZE bytes (at least the fixed part)."""
    head = b'{"seq":%d,"pad":"' % next(_seq)
    return head + b"x" * max(0, MSG_SIZE - len(head) - 2) + b'"}'


def ensure_topic(user: FastHttpUser) -> None:
    """Create the topic once per process if it does not exist (409 from a racing creator is fine)."""
    global _topic_ready
    with _topic_lock:
        if _topic_ready:
            return
        with user.client.get(BASE, headers=HEADERS, name="setup: describe topic", catch_response=True) as r:
            if r.status_code == 200:
                _topic_ready = True
                return
            if r.status_code != 404:
                r.failure(f"GET {BASE} -> {r.status_code} {r.text[:200]}")
                raise RuntimeError(f"cannot check topic {TOPIC}: {r.status_code} {r.text[:200]}")
            r.success()
        body = json.dumps({"name": TOPIC, "partitions": PARTITIONS})
        with user.client.post("/v1/topics", data=body, headers=JSON_HEADERS, name="setup: create topic",
                              catch_response=True) as r:
            if r.status_code not in (201, 409):
                r.failure(f"POST /v1/topics -> {r.status_code} {r.text[:200]}")
                raise RuntimeError(f"cannot create topic {TOPIC}: {r.status_code} {r.text[:200]}")
            r.success()
        _topic_ready = True


@events.init.add_listener
def _on_init(environment: Environment, **_: Any) -> None:
    if not PASS:
        logging.getLogger("narad.locust").warning("NARAD_PASS is empty; requests will get 401")


class ProducerUser(FastHttpUser):
    """Produces 1 KiB JSON messages: single produce 3 times as often as a batch produce."""

    wait_time = constant(THINK)

    def on_start(self) -> None:
        ensure_topic(self)

    @task(3)
    def produce(self) -> None:
        with self.client.post(f"{BASE}/produce", data=message(), headers=JSON_HEADERS, name="produce",
                              catch_response=True) as r:
            if r.status_code != 202:
                r.failure(f"{r.status_code} {r.text[:200]}")

    @task(1)
    def produce_batch(self) -> None:
        body = b'{"messages":[' + b",".join(b'{"payload":' + message() + b"}" for _ in range(BATCH)) + b"]}"
        with self.client.post(f"{BASE}/produce/batch", data=body, headers=JSON_HEADERS,
                              name=f"produce/batch ({BATCH})", catch_response=True) as r:
            if r.status_code != 202:
                r.failure(f"{r.status_code} {r.text[:200]}")
            elif r.json().get("accepted") != BATCH:
                r.failure(f"accepted {r.text[:200]}, sent {BATCH}")


class ConsumerUser(FastHttpUser):
    """Long-poll consume, then ack every message it received."""

    wait_time = constant(THINK)

    def on_start(self) -> None:
        ensure_topic(self)

    @task
    def consume_and_ack(self) -> None:
        batch = CONSUME_MAX > 1
        url = f"{BASE}/consume?wait={CONSUME_WAIT}" + (f"&max={CONSUME_MAX}" if batch else "")
        with self.client.get(url, headers=HEADERS, name="consume" + (f" (max {CONSUME_MAX})" if batch else ""),
                             catch_response=True) as r:
            if r.status_code == 204:  # nothing arrived within the wait: not an error
                r.success()
                return
            if r.status_code != 200:
                r.failure(f"{r.status_code} {r.text[:200]}")
                return
            body = r.json()
        if not batch:
            with self.client.post(f"{BASE}/ack?receipt_handle={body['receipt_handle']}", headers=HEADERS,
                                  name="ack", catch_response=True) as a:
                if a.status_code != 204:
                    a.failure(f"{a.status_code} {a.text[:200]}")
            return
        handles = [m["receipt_handle"] for m in body["messages"]]
        with self.client.post(f"{BASE}/ack", data=json.dumps({"receipt_handles": handles}),
                              headers=JSON_HEADERS, name="ack/batch", catch_response=True) as a:
            if a.status_code != 200:
                a.failure(f"{a.status_code} {a.text[:200]}")
                return
            bad = [x for x in a.json()["results"] if x.get("status") != 204]
            if bad:
                a.failure(f"{len(bad)} of {len(handles)} handles not acked, e.g. {bad[0]}")
