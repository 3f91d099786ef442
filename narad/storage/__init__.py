"""Storage: partition logs (segmented, checksummed frames), the ingress WAL
with group commit, consumer offset files. Knows nothing of topics' metadata,
leases or HTTP; imports only narad.errors and narad.metrics."""
