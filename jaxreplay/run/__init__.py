"""Orchestration of one run: `build` (config -> Parts), the `pipeline` (the trainer side and
`run(config, workdir)`), the `schedules`, `evaluation`, the metrics row (`metrics_row`) and the
compute accounting (`accounting`)."""
from jaxreplay import _imports

__getattr__, __dir__ = _imports.lazy_exports(__name__, {
    "run": "pipeline", "Pipeline": "pipeline", "Parts": "build",
    "ComputeAccountant": "accounting", "gamma": "accounting",
    "RunMetrics": "metrics_row", "evaluate": "evaluation",
})
