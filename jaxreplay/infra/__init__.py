"""Infrastructure every layer may use: the device mesh and sharding rules (`sharding`), orbax
checkpoints and their integrity, child processes, the workdir lock and stop signals (`safety`), the
multi-process step channel and the metric writers (JSONL, TensorBoard, W&B, progress lines)."""
from jaxreplay import _imports

__getattr__, __dir__ = _imports.lazy_exports(__name__, {
    "make_mesh": "sharding", "Checkpointer": "checkpoint", "ChildProcess": "child_process",
    "WorkdirLock": "safety", "StopSignals": "safety", "StepChannel": "step_channel",
    "MetricsWriter": "metric_writers", "ProgressLogger": "metric_writers",
    "read_metrics": "metric_writers",
})
