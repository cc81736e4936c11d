"""The metric keys `ReplayBuffer.metrics()` reports, each with what it measures.

Counts are in rollouts (one completion of one prompt), staleness in policy versions (optimizer
updates); every value is a float. A new buffer metric is added here and in `ReplayBuffer.metrics`.
"""

# Keys `ReplayBuffer.metrics` always returns (floats).
METRIC_KEYS = (
    "buffer/size",                  # rollouts held (both regions)
    "buffer/capacity",              # N
    "buffer/fill",                  # size / capacity
    "buffer/recent_size",           # rollouts in the recent (FIFO) region
    "buffer/positive_size",         # rollouts in the positive-bias region
    "buffer/total_added",           # rollouts ever added
    "buffer/total_sampled",         # rollout-uses ever returned by `sample` (sum of batch sizes)
    "buffer/replay_ratio",          # total_sampled / total_added: B/R over the run
    "buffer/evicted",               # rollouts dropped from the buffer
    "buffer/promoted",              # rollouts moved from the recent to the positive region
    "buffer/consumed",              # rollouts removed by `sample` (consume=True only)
    "buffer/use_count_mean",        # mean use count over evicted and held rollouts
    "buffer/evicted_use_count_mean",  # mean uses over a whole life (evicted rollouts; 0 if none)
    "buffer/held_use_count_mean",   # mean use count of the rollouts held now (0 if empty)
    "buffer/evicted_unused",        # rollouts evicted without ever being sampled (wasted generation)
    "buffer/never_used_fraction",   # (evicted unused + held unused) / total_added: the share of the
                                    # generated rollouts not trained on (so far; exact at the end)
)
# Keys about the last sampled batch, present once a batch was sampled.
BATCH_KEYS = (
    "buffer/batch_use_count_mean",  # use counts of the batch's rollouts, this use included
    "buffer/batch_use_count_max",
)
# Keys present when the last batch was sampled with `current_version=`: its staleness
# (current_version - policy_version, in policy versions).
STALENESS_KEYS = (
    "buffer/staleness_mean",
    "buffer/staleness_max",
    "buffer/staleness_min",
)
# Keys present when `metrics(current_version=...)` is given: staleness of everything held.
HELD_STALENESS_KEYS = (
    "buffer/held_staleness_mean",
    "buffer/held_staleness_max",
)
# Keys present with max_uses > 0.
MAX_USES_KEYS = (
    "buffer/retired",               # rollouts removed after their max_uses-th use
)
# Keys present with replace_zero_variance.
ZERO_VARIANCE_KEYS = (
    "buffer/zero_variance_fraction",  # share of held rollouts whose group's rewards are all equal
    "buffer/batch_zero_variance_fraction",  # the same share in the last batch (once sampled)
)
# Every key about the last sampled batch: reported on the row of the update that sampled it.
LAST_SAMPLE_KEYS = BATCH_KEYS + STALENESS_KEYS + ("buffer/batch_zero_variance_fraction",)
