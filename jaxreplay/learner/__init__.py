"""The learner: losses (pure functions), the algorithm table, the trainer's batch, the optimizer
and the jitted, sharded train step over a parameter pytree."""
from jaxreplay import _imports

__getattr__, __dir__ = _imports.lazy_exports(__name__, {
    "ALGORITHMS": "algorithms", "Algorithm": "algorithms",
    "Batch": "batch", "Rollout": "batch",
    "grpo_loss": "losses", "asymre_loss": "losses", "grpo_advantages": "losses",
    "asymre_advantages": "losses",
    "make_optimizer": "optim", "make_schedule": "optim",
    "TrainState": "trainer", "LossFn": "trainer", "make_loss_fn": "trainer",
    "init_train_state": "trainer", "make_train_step": "trainer", "make_logprob_fn": "trainer",
})
