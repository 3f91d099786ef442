"""A worker process: serves the client API (HTTP/1.1 and HTTP/3) on its own
core, reading the metastore replica memory-mapped and read-only."""
