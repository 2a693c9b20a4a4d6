"""The wire: transports (gloo / NCCL group, same-host shared memory) and what travels on them
(bucket headers, checksums, bound addresses). Imports nothing of the core but `errors`."""
