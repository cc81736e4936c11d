"""Orchestration of one run: `build` (config -> Parts), the `pipeline` (the trainer side and
`run(config, workdir)`), the `schedules`, `evaluation`, the metrics row (`metrics_row`) and the
compute accounting (`accounting`)."""
