"""The science tooling: named sweeps (`sweeps`), their runner (`runner`, `python -m
jaxreplay.experiments`), statistics, plots and the Markdown report, Theorem 4.5's optimal design
(`design`) and the gradient-noise probe (`noise_probe`, `noise_stats`)."""
