"""Rollout workers: the interface and the pool's records (`base`, numpy only), the JAX sampler
(`jax_sampler`), the worker pool (`pool`), the backend tables (`backends`), vLLM engines (`vllm/`),
weight publishers (`weights/`) and Ray actors (`ray/`).

`base` and `pool` import neither JAX nor vLLM, torch or Ray: a vLLM engine process that imports
`jaxreplay.rollout.vllm.engine` does not import JAX.
"""
