"""The broker: what a worker does with messages. Produce into the ingress WAL,
dispatch to partition owners, owned partitions with their lease tables,
consume gathering across workers, acks, the offset committer. Imports
narad.storage and narad.meta (read side); never the API or transports."""
