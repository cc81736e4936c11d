"""The data plane between rollout workers and the trainer: the replay buffer (`buffer`), the
request intake that scores groups into rollouts (`experience`), and `collate` (rollouts -> Batch)."""
from jaxreplay import _imports

__getattr__, __dir__ = _imports.lazy_exports(__name__, {
    "ReplayBuffer": "buffer", "BufferClosedError": "buffer",
    "pack_rows": "collate",
    "Intake": "experience", "PromptSource": "experience", "make_advantage_fn": "experience",
})
