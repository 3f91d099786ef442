"""Other nodes as the broker sees them (implements narad.broker.peers.Remote).

Who owns a partition comes from the local metastore replica (assignments,
cached per topic name slot); where a node listens and whether it is alive come
from its member record. Calls go over node RPC (TLS on TCP, narad.cluster.transport).
Imports narad.meta (read side) and narad.cluster.transport.
"""

from __future__ import annotations

from typing import Any, TypeVar

from narad.cluster.transport import NodeRpcClient
from narad.errors import Unavailable
from narad.meta import versions as V
from narad.meta.records import MemberRecord, TopicRecord
from narad.meta.store import MetaStore

T = TypeVar("T")


class ClusterRemote:
    def __init__(self, node_id: str, store: MetaStore, client: NodeRpcClient) -> None:
        self.node_id = node_id
        self.store = store
        self.client = client
        self._members: dict[str, MemberRecord] = {}
        self._members_ver = -1

    def _member(self, node_id: str) -> MemberRecord | None:
        ver = self.store.versions.load(V.MEMBERS)
        if ver != self._members_ver:
            with self.store.read() as r:
                self._members = {m.id: m for m in r.members()}
            self._members_ver = ver
        return self._members.get(node_id)

    def owner_node(self, topic: TopicRecord, partition: int) -> str | None:
        a = self.store.assignments(topic.name).get(partition)
        if a is None or a.topic_id != topic.id:
            return None
        return a.owner

    def moving(self, topic: TopicRecord, partition: int) -> bool:
        a = self.store.assignments(topic.name).get(partition)
        return a is not None and a.topic_id == topic.id and a.target is not None and a.target != a.owner

    def node_alive(self, node_id: str) -> bool:
        if node_id == self.node_id:
            return True
        m = self._member(node_id)
        return m is not None and m.status == "alive"

    def _addr(self, node_id: str) -> tuple[str, int]:
        m = self._member(node_id)
        if m is None or not m.cluster_addr:
            raise Unavailable(f"node {node_id} has no known address")
        host, _, port = m.cluster_addr.rpartition(":")
        return host, int(port)

    async def call(self, node_id: str, msg: Any, resp_type: type[T], timeout: float) -> T:
        return await self.client.call(self._addr(node_id), msg, resp_type, timeout=timeout)

    def notify(self, node_id: str, msg: Any) -> None:
        try:
            addr = self._addr(node_id)
        except Unavailable:
            return
        self.client.notify(addr, msg)
