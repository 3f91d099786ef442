"""Local RPC between narad processes (Unix sockets, msgpack frames)."""
