"""Client helpers for narad's HTTP API (the seed of the Python SDK).

``narad.client.h3.H3Client`` is an async HTTP/3 client (aioquic) used by the
tests and the load tests. Nothing in the server imports this package.
"""
