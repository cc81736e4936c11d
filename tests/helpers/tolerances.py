"""Tolerances for comparing two float computations of the same quantity, from the dtype and the size
of the reductions involved (not hand-picked constants).

Two computations that sum the same n terms in different orders (a rolled vs unrolled scan,
remat, micro-batches, sharding, chunking) differ by rounding: each partial sum is off by up to one
ulp, so the difference grows like eps * sqrt(n) * (the magnitude of the terms) for random-order
rounding, eps * n in the worst case. `close(dtype, n, scale)` returns `atol` / `rtol` for
`chex.assert_trees_all_close` / `np.testing.assert_allclose` at `SAFETY` times the random-order
bound: far below any real error (a wrong mask, a missing term: O(scale)), above reassociation noise.
"""
import math

import numpy as np

SAFETY = 16.0


def eps(dtype) -> float:
  """Machine epsilon of `dtype` (bfloat16 included)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return float(jnp.finfo(jnp.dtype(dtype)).eps)


def close(dtype=np.float32, n: int = 1, scale: float = 1.0) -> dict:
  """{"atol", "rtol"} for results of `dtype` built from reductions of `n` terms of magnitude `scale`
  (for a tree, the largest |value| of the reference is a good scale)."""
  tol = SAFETY * eps(dtype) * math.sqrt(max(int(n), 1))
  return {"atol": tol * float(scale), "rtol": tol}


def tree_scale(tree) -> float:
  """The largest |x| over the leaves of `tree` (at least 1e-30)."""
  import jax  # pylint: disable=g-import-not-at-top
  leaves = [np.max(np.abs(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)
            if np.size(x)]
  return max(max(leaves, default=0.0), 1e-30)
