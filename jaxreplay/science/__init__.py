"""The science tooling: named sweeps (`sweeps`), their runner (`runner`, `python -m
jaxreplay.experiments`), statistics, plots and the Markdown report, Theorem 4.5's optimal design
(`design`) and the gradient-noise probe (`noise_probe`, `noise_stats`)."""
from jaxreplay import _imports

__getattr__, __dir__ = _imports.lazy_exports(__name__, {
    "SWEEPS": "sweeps", "Sweep": "sweeps", "Arm": "sweeps",
    "optimal_design": "design", "power_law_design": "design", "fit_power_law_noise": "design",
    "run_probe": "noise_probe",
})
