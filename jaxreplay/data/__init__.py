"""The data plane between rollout workers and the trainer: the replay buffer (`buffer`) and its
samplers (`samplers`), the request intake that scores groups into rollouts (`experience`), and
`collate` (rollouts -> Batch)."""
