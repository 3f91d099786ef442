"""Node-to-node RPC: the public seam (``NodeRpcClient``, ``NodeRpcServer``, ``NodePeer``).

Node RPC runs on TLS 1.3 over TCP (the stdlib ``ssl`` module on uvloop: crypto, records and
socket I/O in C) on the cluster port. The pieces, each in its own module:

* narad.cluster.rpc_frames: the frame codec (13-byte header, msgpack bodies), the 16 MiB
  frame cap enforced from the header before anything is buffered, error encoding;
* narad.cluster.rpc_auth: the cluster secret as the TLS identity of every node (mutual
  certificate authentication with a key derived from the secret; why that proves the secret
  and binds it to the session before any handler runs);
* narad.cluster.rpc_conn: what both ends share (frame input, one write per loop pass);
* narad.cluster.rpc_server: ``NodeRpcServer`` (handshake cap, handlers, cancellation,
  backpressure, graceful close);
* narad.cluster.rpc_client: ``NodeRpcClient`` (one multiplexed connection per peer address,
  dial backoff, liveness PINGs, cancellation, notes).

Until issue 10 this was QUIC on aioquic (pure Python, ~250 us of CPU per stream on each end);
HTTP/3 for clients still is (narad.api.http3).

Importers use only this module. Logger ``narad.cluster.transport``.
"""

from __future__ import annotations

from narad.cluster.rpc_auth import ALPN
from narad.cluster.rpc_client import NodeRpcClient
from narad.cluster.rpc_frames import MAX_FRAME
from narad.cluster.rpc_frames import undecodable as _undecodable  # tests/test_fuzz_decoders.py uses it
from narad.cluster.rpc_server import NodePeer, NodeRpcServer

__all__ = ["ALPN", "MAX_FRAME", "NodePeer", "NodeRpcClient", "NodeRpcServer", "_undecodable"]
