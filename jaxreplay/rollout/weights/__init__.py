"""Weight publishers: how the trainer's params reach rollout workers. `publisher` (the contract:
one record type, history, root directories), `shm_format` (the shared-memory segment, numpy only),
`shm_publisher` (segments in /dev/shm) and `file_publisher` (HF directories)."""
