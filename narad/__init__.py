"""Narad: a queue-first event streaming node."""

__version__ = "0.1.0"
# The build string members report in heartbeats and the fail-stop log line.
BUILD = f"narad-py/{__version__}"
