"""The metastore: Raft seam, FSM (LMDB), read API, metadata service, shared version counters."""
