"""The supervisor process: boot order, fork server, workers, control socket,
controller duties and readiness. Top of the import graph."""
