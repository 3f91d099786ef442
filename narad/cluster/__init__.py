"""The cluster: node-to-node RPC over TLS on TCP (transport, and the rpc_* modules behind it),
and how the broker reaches partitions owned by other nodes (remote). Sits above the broker and
the metastore; imported by workers and the supervisor."""
