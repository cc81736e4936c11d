"""The run's configuration: every key with its default (`defaults`), its validation, section by
section (`validation`), the GPU split between trainer and rollout workers (`devices`) and the
per-device memory plan of `--dry_run` (`memory_plan`)."""
