"""The run's configuration: every key with its default (`defaults`), its validation, section by
section (`validation`), the GPU split between trainer and rollout workers (`devices`) and the
per-device memory plan of `--dry_run` (`memory_plan`)."""
from jaxreplay import _imports

__getattr__, __dir__ = _imports.lazy_exports(__name__, {
    "base_config": "defaults", "gpu_math_config": "defaults",
    "validate_config": "validation", "GpuSplit": "devices", "split_gpus": "devices",
    "DoesNotFit": "memory_plan", "dry_run": "memory_plan",
})
