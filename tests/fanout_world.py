"""The in-process fan-out world shared by tests/test_fanout_engine.py and
tests/test_fanout_review.py: a real FSM and LMDB metastore (entries applied
directly), a version array, and a real Broker (partition logs, cursor files,
the fan-out engine) on the test's event loop. The leader's answers are the
local replica's: caught up, and an epoch confirmed by re-reading the child.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, TypeVar

from narad.broker.broker import Broker
from narad.broker.fanout import FanoutSettings
from narad.broker.peers import PeerLinks
from narad.meta import commands as C
from narad.meta import requests as Q
from narad.meta import versions as V
from narad.meta.fsm import FSM
from narad.meta.records import TopicRecord
from narad.meta.store import MetaStore

B = TypeVar("B", bound=Broker)


class World:
    def __init__(self, tmp: Path) -> None:
        self.versions = V.VersionTable.create(f"/narad-fo-{os.getpid()}-{time.monotonic_ns()}")
        self.fsm = FSM(tmp / "fsm", on_commit=lambda touched, _i: self.versions.bump(touched))
        self.store = MetaStore(tmp / "fsm", self.versions, fsm=self.fsm)
        self.index = 0
        self.tmp = tmp

    def apply(self, payload: Any) -> None:
        self.index += 1
        res = self.fsm.apply(self.index, C.encode(payload, request_id="", stamp_ms=1000 + self.index))
        self.fsm.commit()
        assert res.ok, res

    def topic(self, name: str) -> TopicRecord:
        t = self.store.topic(name)
        assert t is not None
        return t

    async def broker(self, cls: type[B], **settings: Any) -> B:
        """A started broker of class `cls` (a Broker with test seams), worker 0 of 1."""
        async def caught_up() -> bool:
            return True

        async def confirm(req: Q.ConfirmEpochReq) -> Q.ConfirmEpochResp:  # the leader's re-read
            c = self.store.topic(req.child)
            return Q.ConfirmEpochResp(c is not None and c.id == req.child_id and c.attach_epoch == req.epoch
                                      and c.parent == req.parent and c.parent_id == req.parent_id)

        async def gone(_t: str, _i: str) -> bool:
            return False

        b = cls(data_dir=self.tmp / "data", store=self.store, versions=self.versions, index=0, workers=1,
                links=PeerLinks(self.tmp, 0, 1), confirm_gone=gone, node_id="n1", caught_up=caught_up,
                confirm_epoch=confirm, fanout=FanoutSettings(**settings))
        self.versions.store(V.READY, 1)
        await b.start()
        return b

    def close(self) -> None:
        self.fsm.close()
        self.versions.close(unlink=True)
