"""Infrastructure every layer may use: the device mesh and sharding rules (`sharding`), orbax
checkpoints and their integrity, child processes, the workdir lock and stop signals (`safety`), the
multi-process step channel and the metric writers (JSONL, TensorBoard, W&B, progress lines)."""
