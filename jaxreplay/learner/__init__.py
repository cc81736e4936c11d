"""The learner: losses (pure functions), the algorithm table, the trainer's batch, the optimizer
and the jitted, sharded train step over a parameter pytree."""
