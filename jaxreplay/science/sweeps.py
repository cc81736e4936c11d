"""The named experiment sweeps of `python -m jaxreplay.experiments` (issue 11, PAPER.md's figures).

A `Sweep` is a base config file, a compute budget and a set of `Arm`s; an arm is a name plus config
overrides on top of the base (and of `COMMON`, the evaluation protocol shared by every run). Every
arm of a sweep runs to the SAME compute budget (`config.compute_budget`, device-seconds of the run's
`compute_seconds` axis); `total_steps` is only a cap. An override value may be a function of the
base config (`Derived`), so a sweep follows the base when the base changes (`configs/scratchpad.py`,
the task with headroom later): e.g. the N sweep sets N = x * R from the base's request size R.

Units (PAPER.md): N, B and R count rollouts; compute in device-seconds of the simulated hardware;
one "on-policy update" of the base costs (1 + mu) * train_seconds_per_step device-seconds.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Callable, Optional, Sequence, Union

import ml_collections

DEFAULT_CONFIG = "configs/scratchpad.py"


@dataclasses.dataclass(frozen=True)
class Derived:
  """An override computed from the base config (after `COMMON`): `fn(config) -> value`."""
  fn: Callable[[ml_collections.ConfigDict], Any]
  doc: str = ""


Value = Union[bool, int, float, str, tuple, Derived]


@dataclasses.dataclass(frozen=True)
class Arm:
  """One experimental condition of a sweep.

  Attributes:
    name: directory-safe name (runs go to DIR/runs/SWEEP/NAME/seed{k}).
    overrides: (dotted config key, value) pairs applied after `COMMON`, in order.
    baseline: the arm this one is paired with (same seed); None: the sweep's baseline.
    family: groups arms in figures (the Pareto frontier of the LR sweep: "onpolicy" / "replay").
    tags: (name, number) pairs that place the arm on an axis (N/R, W, T, mu, lr factor, ...).
  """
  name: str
  overrides: tuple[tuple[str, Value], ...] = ()
  baseline: Optional[str] = None
  family: str = ""
  tags: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A named set of arms run with K seeds each to one compute budget.

  Attributes:
    name: the sweep's name (`--sweep=NAME`).
    description: the paper figure it reproduces and what it should show.
    arms: the conditions; `baseline` names the one the others are paired with.
    min_seeds: seeds per arm when --seeds is not given (the paper's minimum).
    config: the base config file (relative to the repository root); `--config` replaces it.
    budget_updates: the compute budget in on-policy updates of the base config, used when the base
      config has no `compute_budget` of its own (`--budget` replaces both) [updates].
    grid_points: evaluation points on the compute axis besides 0 (geometric, dense early).
    grid_first: the first of them, as a fraction of the budget (`compute_grid`).
    figure: the sweep-specific figure: "" | "final_peak" | "pareto" | "grid".
    figure_x: the x axis of the "final_peak" figure: a per-run statistic of results.json
      ("buffer/replay_ratio", measured) or a tag name ("N/B").
    budget: the compute budget in device-seconds, replacing the base config's own and
      `budget_updates` (`--budget` still replaces it); None: not fixed by the sweep.
    protocol: (dotted config key, value) pairs every arm of this sweep gets after `COMMON` and
      before its own overrides (the sweep's evaluation and speed settings).
    targets: the pass@1 targets of its compute-to-target readings, fixed (another sweep's, so
      that both read the same targets); () derives them from its own runs (`stats.TARGET_RULE`).
  """
  name: str
  description: str
  arms: tuple[Arm, ...]
  baseline: str
  min_seeds: int = 3
  config: str = DEFAULT_CONFIG
  budget_updates: float = 400.0
  grid_points: int = 7
  grid_first: float = 1 / 64
  figure: str = ""
  figure_x: str = ""
  budget: Optional[float] = None
  protocol: tuple[tuple[str, Value], ...] = ()
  targets: tuple[float, ...] = ()

  def arm(self, name: str) -> Arm:
    for a in self.arms:
      if a.name == name:
        return a
    raise KeyError(f"sweep {self.name!r} has no arm {name!r}")

  def baseline_of(self, arm: Arm) -> Optional[str]:
    """The arm `arm` is paired with, or None for the sweep's baseline itself."""
    base = arm.baseline or self.baseline
    return None if base == arm.name else base


EVAL_PROBLEMS = 1024


@functools.lru_cache(maxsize=None)
def _task_holds(task_json: str, n: int) -> bool:
  """Whether the task of these task.* settings has `n` distinct held-out problems."""
  from jaxreplay.run import build  # pylint: disable=g-import-not-at-top  (jax: only when planning)
  task = build.make_task(ml_collections.ConfigDict(json.loads(task_json)))
  try:
    task.eval_set(n)
    return True
  except ValueError:
    return False
  finally:
    task.close()


def eval_problems(c: ml_collections.ConfigDict) -> int:
  """EVAL_PROBLEMS held-out problems when the base task holds that many; else the base config's
  own eval.num_problems (the tiny default's 1-2 digit additions hold ~900)."""
  task_json = json.dumps(c.task.to_dict(), sort_keys=True, default=list)
  if _task_holds(task_json, EVAL_PROBLEMS):
    return EVAL_PROBLEMS
  return int(c.eval.num_problems)


# The evaluation protocol of every run (PAPER.md "Settings reported"): 1024 held-out problems
# (`eval_problems`), pass@1 at T=0.1 and pass@k up to 32 at T=1.0, both at top_p 0.95; a constant
# learning rate after the base config's short warmup; the deterministic in-process JAX sampler.
COMMON: tuple[tuple[str, Value], ...] = (
    ("rollout.backend", "jax"),
    ("trainer.schedule", "constant"),
    ("eval.num_problems", Derived(eval_problems, "1024, or the base's own for a small task")),
    ("eval.n_samples", 32),
    ("eval.ks", (1, 2, 4, 8, 16, 32)),
    ("eval.temperature_pass1", 0.1),
    ("eval.temperature_passk", 1.0),
    ("eval.top_p", 0.95),
    ("checkpoint.every", 100),
)

# `--quick`: a few steps and a tiny evaluation, so CI runs a sweep end to end in about a minute.
QUICK: tuple[tuple[str, Value], ...] = (
    ("eval.num_problems", 32),
    ("eval.n_samples", 4),
    ("eval.ks", (1, 2, 4)),
    ("checkpoint.every", 0),
)
QUICK_BUDGET_UPDATES = 12.0
QUICK_GRID_POINTS = 2

ON_POLICY: tuple[tuple[str, Value], ...] = (("buffer.on_policy", True),
                                            ("buffer.on_policy_order", "lifo"))


def sync_rollouts_per_step(c: ml_collections.ConfigDict) -> int:
  """R of the synchronous grid: half the base batch B, rounded to whole groups, so B/R = 2 at the
  base batch size."""
  g = int(c.rollout.group_size)
  return g * max(1, round(c.buffer.batch_size / (2 * g)))


def update_seconds(c: ml_collections.ConfigDict) -> float:
  """Device-seconds of one on-policy update of `c`: (1 + mu) * train_seconds_per_step."""
  return (1.0 + float(c.scheduler.mu)) * float(c.scheduler.train_seconds_per_step)


def _fmt(x: float) -> str:
  return f"{x:.3g}"


def _n_sweep() -> Sweep:
  # In the asynchronous pipeline the rollouts generated per step, B / replay ratio, are fewer than
  # B, so N/R = 1 would leave N < B (no batch can be drawn). The sweep therefore scales N by B, and
  # tags each arm with its nominal N/R (R = B * W / (mu * T)); sync_grid holds the exact N/R knob.
  arms = tuple(
      Arm(f"n{x}b", (("buffer.size", Derived(lambda c, x=x: x * int(c.buffer.batch_size),
                                             f"{x} B")),),
          tags=(("N/B", float(x)),))
      for x in (1, 2, 4, 8))
  return Sweep("n_sweep", "Fig. 3 left: replay with buffer sizes N in {1, 2, 4, 8} x B; larger N: "
               "slower but more stable, later and higher peak.", arms, baseline="n4b",
               figure="final_peak", figure_x="N/B")


def _wt_sweep() -> Sweep:
  # Replay ratio mu * T / W at mu = 6.84: 0.98, 2.3, 4.1, 6.8 (the last one aggressive).
  arms = tuple(Arm(f"w{w}t{t}", (("rollout.num_workers", w), ("trainer.num_devices", t)),
                   tags=(("W", float(w)), ("T", float(t))))
               for w, t in ((7, 1), (6, 2), (5, 3), (4, 4)))
  return Sweep("wt_sweep", "Fig. 3 right / 14: (W, T) giving replay ratios mu*T/W from ~1 to ~7; "
               "moderate replay keeps peak accuracy, aggressive replay degrades it.",
               arms, baseline="w7t1", figure="final_peak", figure_x="buffer/replay_ratio")


def _mu_sweep() -> Sweep:
  arms = []
  for mu in (3.0, 6.84, 14.0):
    arms.append(Arm(f"onpolicy_mu{_fmt(mu)}", ON_POLICY + (("scheduler.mu", mu),),
                    family="onpolicy", tags=(("mu", mu),)))
    arms.append(Arm(f"replay_mu{_fmt(mu)}", (("scheduler.mu", mu),),
                    baseline=f"onpolicy_mu{_fmt(mu)}", family="replay", tags=(("mu", mu),)))
  return Sweep("mu_sweep", "Generation/training cost ratio mu in {3, 6.84, 14}, on-policy and "
               "replay at each (paired at equal mu): the saving should grow with mu (Thm 4.5).",
               tuple(arms), baseline="onpolicy_mu6.84")


def _lr_sweep() -> Sweep:
  arms = []
  for f in (1 / 3, 1.0, 3.0):
    lr = Derived(lambda c, f=f: float(f"{f * c.trainer.learning_rate:.4g}"),
                 f"{_fmt(f)} x the base learning rate")
    arms.append(Arm(f"onpolicy_lr{_fmt(f)}x", ON_POLICY + (("trainer.learning_rate", lr),),
                    family="onpolicy", tags=(("lr_factor", f),)))
    arms.append(Arm(f"replay_lr{_fmt(f)}x", (("trainer.learning_rate", lr),),
                    baseline=f"onpolicy_lr{_fmt(f)}x", family="replay", tags=(("lr_factor", f),)))
  return Sweep("lr_sweep", "Fig. 4: three constant learning rates for on-policy and for the "
               "default replay arm; the best replay configurations should dominate the Pareto "
               "frontier of the best on-policy ones.", tuple(arms), baseline="onpolicy_lr1x",
               figure="pareto")


def _sync_grid() -> Sweep:
  """Theorem 4.5: the synchronous schedule over N/R x B/R (B <= N, so a batch is distinct)."""
  arms = []
  for x in (1, 2, 4, 8):
    for y in (1, 2, 4):
      if y > x:
        continue
      arms.append(Arm(f"n{x}_b{y}", (
          ("scheduler.kind", "sync"),
          ("scheduler.rollouts_per_step", Derived(sync_rollouts_per_step, "R")),
          ("rollout.prompts_per_request",
           Derived(lambda c: sync_rollouts_per_step(c) // c.rollout.group_size, "R / G")),
          ("buffer.size", Derived(lambda c, x=x: x * sync_rollouts_per_step(c), f"{x} R")),
          ("buffer.batch_size", Derived(lambda c, y=y: y * sync_rollouts_per_step(c), f"{y} R")),
          # The simulated costs are per update of B rollouts (g = mu * train_seconds / B): scale the
          # step's training time with B so a rollout costs the same to train on and to generate in
          # every arm (the theory's c = B + mu R).
          ("scheduler.train_seconds_per_step", Derived(
              lambda c, y=y: (c.scheduler.train_seconds_per_step * y * sync_rollouts_per_step(c)
                              / c.buffer.batch_size), "train seconds x B / B_base")),
      ), tags=(("N/R", float(x)), ("B/R", float(y)))))
  return Sweep("sync_grid", "Theorem 4.5 / Fig. 6: the synchronous schedule over N/R and B/R; "
               "n1_b1 (N = B = R) is on-policy. The empirical optimum goes beside the predicted "
               "x*, y*.", tuple(arms), baseline="n1_b1", figure="grid")


LARGE_BATCH_CONFIG = "configs/scratchpad_large_batch.py"
# The adaptive family: the reuse controller over the positive-bias buffer (the best fixed design of
# the update-limited regime); at rho = 1 it trains on the newest unused rollouts (data.reuse).
ADAPTIVE: tuple[tuple[str, Value], ...] = (("buffer.reuse_control", "adaptive"),
                                           ("buffer.positive_fraction", 0.5))
PARETO_LR_FACTORS = (1.0, 3.0, 10.0)


def _lr_arm(family: str, factor: float, overrides: tuple = (), baseline: str = "") -> Arm:
  lr = Derived(lambda c, f=factor: float(f"{f * c.trainer.learning_rate:.4g}"),
               f"{_fmt(factor)} x the base learning rate")
  return Arm(f"{family}_lr{_fmt(factor)}x", overrides + (("trainer.learning_rate", lr),),
             baseline=baseline or f"onpolicy_lr{_fmt(factor)}x", family=family,
             tags=(("lr_factor", factor),))


def _pareto_i26() -> Sweep:
  """Issue 26's decisive sweep, kept as it ran (its runs are cited by EXPERIMENTS.md): each family
  at its own learning rates in the update-limited regime (`configs/scratchpad_large_batch.py`: B =
  512 >= the noise scale) to 100 on-policy updates, pass@1 on 256 held-out problems at the inner
  grid points; superseded by `pareto` (issue 37: longer budget, every problem at a dense grid)."""
  families = (("onpolicy", ON_POLICY), ("replay", ()),
              ("posbias", (("buffer.positive_fraction", 0.5),)),
              ("adaptive", ADAPTIVE),
              # the off-policy screen's one candidate (issue 27: +0.024 pass@1 over replay)
              ("maxuses2", (("buffer.max_uses", 2),)))
  arms = tuple(_lr_arm(name, f, overrides) for name, overrides in families
               for f in PARETO_LR_FACTORS)
  return Sweep("pareto_i26", "Issue 26: on-policy, plain replay, positive-bias replay (delta 0.5), "
               "the adaptive reuse controller (issue 26's) and max_uses 2, each over a learning-rate "
               "grid that brackets its best rate, in the update-limited regime (B = 512 at or above "
               "the gradient noise scale); equal compute (100 on-policy updates).", arms,
               baseline=f"onpolicy_lr{_fmt(PARETO_LR_FACTORS[0])}x", min_seeds=4,
               config=LARGE_BATCH_CONFIG, figure="pareto", budget=12544.0)


# Issue 37's protocol of the decisive sweeps: 200 on-policy updates (on-policy flattens: its last
# quarter gains < 0.01 pass@1, experiments/plans/pareto_budget_probe.md), pass@1 on every held-out
# problem at 22 grid points 2^(1/3) apart from 1/128 of the budget (so that compute to a target is
# read between points 26% apart, never across a doubling), and the simulated schedule's batched
# generation (`scheduler.generation_batch`, auto) with a 56-token bucket (speed only: the same
# rollouts and updates up to float rounding).
DECISIVE_UPDATES = 200.0
DECISIVE_GRID_POINTS = 22
DECISIVE_GRID_FIRST = 1 / 128
DECISIVE_PROTOCOL: tuple[tuple[str, Value], ...] = (
    ("eval.pass1_problems", 0),
    ("scheduler.generation_batch", 0),
    ("trainer.buckets", (48, 56, 64)),
)
# The families of the decisive sweep (issue 37): the baseline and the fixed replay designs.
DECISIVE_FAMILIES: tuple[tuple[str, tuple], ...] = (
    ("onpolicy", ON_POLICY), ("replay", ()),
    ("posbias", (("buffer.positive_fraction", 0.5),)),
    ("maxuses2", (("buffer.max_uses", 2),)),
)
# What a 2026 reader would try instead (issue 37 items 1, 3), each with the published defaults:
#   adaptive         the reuse controller over the positive-bias buffer (`ADAPTIVE`)
#   adaptive_nobias  the same controller over the plain buffer: its own effect, without positive bias
#   gradient_gate    Dynamic Gradient Gating (arXiv 2605.19425) over the on-policy queue: each fresh
#                    batch reused while the LM head's gradient shows no surge (K = 4, tau = 0.5, a
#                    window of 10 increments; `data.batch_reuse`)
#   fresh            FreshPER (arXiv 2604.16918) over the plain buffer: priority ((|reward| + 1e-6)
#                    exp(-age / 500)) ** 0.6, age in updates (`data.samplers`)
#   ppo_epochs       the classical baseline: k = 2 epochs of m = 2 minibatches of B / 2 = 256 over
#                    each fresh batch of the on-policy queue. m = 2 keeps a minibatch (256) at or
#                    above the gradient noise scale at the start (B / noise scale ~2.3 at B = 512:
#                    ~220 rollouts), so it doubles the updates per epoch without making them
#                    noise-dominated; m = 1 would make the epochs' two updates the whole reuse
NEWEST_FAMILIES: tuple[tuple[str, tuple], ...] = (
    ("adaptive", ADAPTIVE),
    ("adaptive_nobias", (("buffer.reuse_control", "adaptive"),)),
    ("gradient_gate", ON_POLICY + (("buffer.reuse_control", "gradient_gate"),)),
    ("fresh", (("buffer.priority", "fresh"), ("buffer.fresh_tau", 500.0),
               ("buffer.fresh_base", "reward"), ("buffer.fresh_alpha", 0.6))),
    ("ppo_epochs", ON_POLICY + (("trainer.ppo_epochs", 2), ("trainer.ppo_minibatches", 2))),
)
# The second task's decisive sweep (issue 37 item 3), `--sweep=pareto_multiplication`: its
# large-batch config (B, N, budget and rate fixed from on-policy runs only) and its families.
MULTIPLICATION_CONFIG = "configs/multiplication_large_batch.py"
# FreshPER (added after the first runs; the others keep their names) leads on the scratchpad, so the
# goal's "best replay design on both tasks" needs it here too.
MULTIPLICATION_FAMILIES = ("onpolicy", "posbias", "adaptive", "adaptive_nobias", "gradient_gate",
                           "fresh")
# Every family by name (`pareto_task` builds a task's decisive sweep from a list of these).
FAMILIES: dict[str, tuple] = dict(DECISIVE_FAMILIES + NEWEST_FAMILIES)
# The decisive protocol without what is specific to the scratchpad task (its 56-token bucket).
TASK_PROTOCOL: tuple[tuple[str, Value], ...] = tuple(
    (k, v) for k, v in DECISIVE_PROTOCOL if k != "trainer.buckets")


# Issue 37 item 4, a grid dense enough that interpolation does not decide a ratio: the on-policy and
# FreshPER arms of a decisive sweep (FreshPER: the design closest to the goal on both tasks) measured
# again with the evaluation grid refined near its targets (`eval.refine_levels`: 4 parts per grid
# step, 2^(1/12) = 6% apart, where a target is within `DENSE_BANDS` pass@1, a third of the targets'
# spacing, or the reach of the curve's pace: `EvalGrid`). Refinement changes no update
# (tests/integration/test_end_to_end.py), so seed k of an arm there reruns seed k of the decisive
# sweep's arm, read more densely near the targets. Reruns of one build are bit for bit the same
# (the tiny config's are); against a decisive run built from older code (the loss closure has moved
# module since) the rollouts are the same until float rounding flips a sampled token: on-policy 10x
# seed 0 drew the same rollouts to step ~35 of 217 (losses 1e-8 apart), past its first three
# targets, then the two drift apart. The targets are the decisive sweep's, fixed
# when these sweeps were added so that both read the same ones (results.json ->
# sweeps.<name>.summary.family_targets on 2026-12-07: pareto from on-policy 1x seeds 0-2,
# pareto_multiplication from on-policy 3x seeds 0-3).
DENSE_FAMILIES = ("onpolicy", "fresh")
DENSE_TARGETS: dict[str, tuple[float, ...]] = {
    "pareto": (0.2746, 0.3395, 0.4045, 0.4694),
    "pareto_multiplication": (0.414, 0.604, 0.7939, 0.9838),
}
DENSE_BANDS = {"pareto": 0.02, "pareto_multiplication": 0.06}
DENSE_SPLITS = 4


def dense_of(base: Sweep, families: Sequence[str] = DENSE_FAMILIES) -> Sweep:
  """`<base>_dense`: the arms of the decisive sweep `base` of `families` with the evaluation grid
  refined near `DENSE_TARGETS[base.name]` (the block comment above); its compute-to-target readings
  use those targets."""
  targets = DENSE_TARGETS[base.name]
  refine = (("eval.refine_levels", targets), ("eval.refine_band", DENSE_BANDS[base.name]),
            ("eval.refine_splits", DENSE_SPLITS))
  return dataclasses.replace(
      base, name=f"{base.name}_dense", targets=targets, protocol=base.protocol + refine,
      arms=tuple(a for a in base.arms if a.family in families),
      description=f"Issue 37 item 4: the {', '.join(families)} arms of {base.name} with the "
      f"evaluation grid refined {DENSE_SPLITS}-fold near its targets {targets}: reruns of "
      "its seeds, their compute to each target read between points 6% apart.")


def _pareto() -> Sweep:
  """The decisive sweep (issues 26, 37): each family at its own learning rates in the
  update-limited regime (`configs/scratchpad_large_batch.py`: B = 512 >= the noise scale), paired
  with on-policy at the same rate, to a budget at which on-policy has flattened; the summary reads
  each family's best rate, whether the grid brackets it, and its compute to each target. The
  newest designs (`NEWEST_FAMILIES`) are arms added after the others: those keep their names and
  arguments."""
  arms = tuple(_lr_arm(name, f, overrides) for name, overrides in
               DECISIVE_FAMILIES + NEWEST_FAMILIES for f in PARETO_LR_FACTORS)
  budget = DECISIVE_UPDATES * update_seconds(_config_base(LARGE_BATCH_CONFIG))
  return Sweep("pareto", "Issue 37: on-policy (LIFO) against the replay designs and the newest "
               "reuse methods (the adaptive controller with and without positive bias, Dynamic "
               "Gradient Gating, FreshPER, multi-epoch PPO-style reuse), each over a "
               "learning-rate grid that brackets its best rate, in the update-limited regime "
               "(B = 512 at or above the gradient noise scale); equal compute (200 on-policy "
               "updates, where on-policy has flattened), pass@1 on all held-out problems at a "
               "dense grid.", arms, baseline=f"onpolicy_lr{_fmt(PARETO_LR_FACTORS[0])}x",
               min_seeds=6, config=LARGE_BATCH_CONFIG, figure="pareto", budget=budget,
               grid_points=DECISIVE_GRID_POINTS, grid_first=DECISIVE_GRID_FIRST,
               protocol=DECISIVE_PROTOCOL)


def pareto_task(task: str, config: str, families: Sequence[str],
                protocol: Sequence[tuple[str, Value]] = TASK_PROTOCOL) -> Sweep:
  """The decisive sweep of another task, `--sweep=pareto_<task>`: the named `FAMILIES` at
  `PARETO_LR_FACTORS` x the base config's learning rate, each paired with on-policy at the same
  rate, to 200 on-policy updates of `config` (a large-batch config: its B, N, budget and rate were
  fixed from on-policy runs), pass@1 on all held-out problems at the dense grid (`protocol`: the
  decisive one without the scratchpad's bucket). Registered in `_sweeps()` with one line each:
  `pareto_multiplication` (`MULTIPLICATION_CONFIG`, `MULTIPLICATION_FAMILIES`)."""
  unknown = [f for f in families if f not in FAMILIES]
  if unknown or "onpolicy" not in families:
    raise ValueError(f"pareto_{task}: families {list(families)}: need 'onpolicy' (the baseline) "
                     f"and names of sweeps.FAMILIES ({', '.join(FAMILIES)}); unknown {unknown}")
  arms = tuple(_lr_arm(name, f, FAMILIES[name]) for name in families for f in PARETO_LR_FACTORS)
  budget = DECISIVE_UPDATES * update_seconds(_config_base(config))
  return Sweep(f"pareto_{task}", f"Issue 37 on the {task} task ({config}): "
               f"{', '.join(families)}, each over a learning-rate grid that brackets its best "
               "rate, paired with on-policy at the same rate; equal compute (200 on-policy "
               "updates), pass@1 on all held-out problems at a dense grid.", arms,
               baseline=f"onpolicy_lr{_fmt(PARETO_LR_FACTORS[0])}x", min_seeds=4, config=config,
               figure="pareto", budget=budget, grid_points=DECISIVE_GRID_POINTS,
               grid_first=DECISIVE_GRID_FIRST, protocol=tuple(protocol))


@functools.lru_cache(maxsize=None)
def _config_base(path: str) -> ml_collections.ConfigDict:
  """The config of the file `path` (relative to the repository root): its update cost sets a
  decisive sweep's budget."""
  import os  # pylint: disable=g-import-not-at-top
  import runpy  # pylint: disable=g-import-not-at-top
  repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
  full = path if os.path.isabs(path) else os.path.join(repo, path)
  if not os.path.isfile(full):
    raise FileNotFoundError(f"config file {full} not found (a sweep's base config)")
  return runpy.run_path(full)["get_config"]()


STABILITY_LR_FACTORS = (1.0, 2.0, 3.0)


def _stability() -> Sweep:
  """Issue 26 item 3 (the paper's Fig. 9 / Section 5.2): the B = 32 default at the highest constant
  rate on-policy survives (1x: lr_sweep) and above it (2x, 3x: on-policy peaks and declines within
  the standard budget), replay and the adaptive controller at the same rates. The 1x and 3x
  on-policy / replay runs are those of fig1 and lr_sweep (identical configs run once)."""
  families = (("onpolicy", ON_POLICY), ("replay", ()),
              ("adaptive", ADAPTIVE))
  arms = tuple(_lr_arm(name, f, overrides) for name, overrides in families
               for f in STABILITY_LR_FACTORS)
  return Sweep("stability", "Issue 26 item 3: on-policy at the highest rate that does not collapse "
               "(1x) and above (2x, 3x: peaks and declines), replay and the adaptive controller at "
               "the same rates: does replay survive where on-policy collapses (the paper's Fig. 9)?",
               arms, baseline="onpolicy_lr1x", min_seeds=3, figure="final_peak",
               figure_x="lr_factor")


def _offpolicy_screen() -> Sweep:
  """Issue 27's quick screen: each off-policy correction and replay sampler against plain replay,
  2 seeds, a quarter of the standard budget (100 on-policy updates = 784 device-seconds of the
  base: ~2-3 min per run at --parallel=1 on the 2-core CPU). Corrections keep their defaults
  (off_policy_cap 2, m2po_threshold 0.04; tis truncates at off_policy_cap)."""
  corrections_arms = tuple(Arm(mode, (("trainer.off_policy", mode),), family="correction")
                           for mode in ("tis", "mis_token", "mis_sequence", "m2po", "decoupled"))
  sampler_arms = (
      Arm("fresh", (("buffer.priority", "fresh"),), family="sampler"),   # fresh_tau 4 updates
      Arm("max_uses2", (("buffer.max_uses", 2),), family="sampler"),   # replay ratio ~2.3 capped
      Arm("replace_zero_variance", (("buffer.replace_zero_variance", True),), family="sampler"),
  )
  return Sweep("offpolicy_screen", "Issue 27: a quick screen of the off-policy corrections "
               "(tis, mis_token, mis_sequence, m2po, decoupled) and replay samplers (priority "
               "fresh, max_uses 2, replace_zero_variance) against plain replay, each paired with "
               "it; the options that move accuracy go to the decisive sweep.",
               (Arm("replay", family="replay"),) + corrections_arms + sampler_arms,
               baseline="replay", min_seeds=2, budget_updates=100.0, grid_points=4)


MULTITURN_CONFIG = "configs/multiturn.py"
# The multi-turn sweep's evaluation: 8 samples per held-out problem (a trajectory costs several
# sampler calls), pass@k up to 8, as configs/multiturn.py evaluates.
MULTITURN_PROTOCOL: tuple[tuple[str, Value], ...] = (("eval.n_samples", 8),
                                                     ("eval.ks", (1, 2, 4, 8)))


def _multiturn() -> Sweep:
  """Issue 38: replay vs on-policy on the multi-turn calculator task (`configs/multiturn.py`: a
  trajectory is one buffer row, the calculator's tokens masked out of every loss) at equal
  compute, 3 seeds; 80 on-policy updates of the base (the warm start's held-out pass@1 0.66 is
  near 1.0 after ~50 replay updates: a longer budget measures only the plateau), 8 evaluation
  points from 1/32 of the budget (2^(5/7) apart)."""
  return Sweep("multiturn", "Issue 38: on-policy (LIFO queue) vs the default replay arm on the "
               "multi-turn calculator task, accuracy (and env/tool_correct) vs compute; a "
               "trajectory costs several turns, so replay should save more than single-turn.",
               (Arm("onpolicy", ON_POLICY, family="onpolicy"), Arm("replay", family="replay")),
               baseline="onpolicy", min_seeds=3, config=MULTITURN_CONFIG, budget_updates=80.0,
               grid_points=8, grid_first=1 / 32, protocol=MULTITURN_PROTOCOL)


def _sweeps() -> dict[str, Sweep]:
  replay = Arm("replay", family="replay")
  onpolicy = Arm("onpolicy", ON_POLICY, family="onpolicy")
  sweeps = [
      Sweep("fig1", "Fig. 1: on-policy (LIFO queue) vs the default replay arm, accuracy vs "
            "compute; replay should reach each accuracy with less compute.",
            (onpolicy, replay), baseline="onpolicy", min_seeds=4),
      _n_sweep(),
      _wt_sweep(),
      Sweep("positive_bias", "Fig. 5: positive bias delta in {0.2, 0.5} vs plain replay; both "
            "should improve on it.",
            (replay,) + tuple(Arm(f"delta{d}", (("buffer.positive_fraction", d),),
                                  tags=(("delta", d),)) for d in (0.2, 0.5)),
            baseline="replay"),
      Sweep("asymre", "Fig. 5: AsymRE (tau = -0.1) vs GRPO, both under replay.",
            (Arm("grpo", (("trainer.loss", "grpo"),)),
             Arm("asymre", (("trainer.loss", "asymre"),))), baseline="grpo"),
      _mu_sweep(),
      _lr_sweep(),
      _sync_grid(),
      _pareto_i26(),
      _pareto(),
      pareto_task("multiplication", MULTIPLICATION_CONFIG, MULTIPLICATION_FAMILIES),
      dense_of(_pareto()),
      dense_of(pareto_task("multiplication", MULTIPLICATION_CONFIG, MULTIPLICATION_FAMILIES)),
      _stability(),
      _offpolicy_screen(),
      _multiturn(),
  ]
  return {s.name: s for s in sweeps}


SWEEPS: dict[str, Sweep] = _sweeps()


def get(names: str) -> list[Sweep]:
  """The sweeps named in `names` (comma-separated; "all" = every sweep, in definition order)."""
  if names.strip() == "all":
    return list(SWEEPS.values())
  out = []
  for n in (s.strip() for s in names.split(",")):
    if n not in SWEEPS:
      raise ValueError(f"unknown sweep {n!r}; known: {', '.join(SWEEPS)} or all")
    out.append(SWEEPS[n])
  return out


def compute_grid(budget: float, points: int, first: float = 1 / 64) -> tuple[float, ...]:
  """(0, then `points` geometric points from first * budget up to budget) [device-seconds]; the
  inner points rounded to 4 significant digits."""
  if points <= 1:
    return (0.0, float(budget))
  ratios = [first ** (1.0 - i / (points - 1)) for i in range(points - 1)]
  return (0.0,) + tuple(float(f"{budget * r:.4g}") for r in ratios) + (float(budget),)


def extended_grid(grid: Sequence[float], points: int, first: float,
                  factor: float) -> tuple[float, ...]:
  """`grid` (a `compute_grid(budget, points, first)`) continued to factor x its budget: its points
  kept as they are, then the grid's own geometric spacing (1 / first) ** (1 / (points - 1)) past
  the budget (2 for a grid without inner points), rounded like it, and the new budget last."""
  budget = float(grid[-1])
  end = float(f"{budget * factor:.6g}")
  ratio = (1.0 / first) ** (1.0 / (points - 1)) if points > 1 else 2.0
  extra, i = [], 1
  while budget * ratio ** i < end * (1 - 1e-6):
    extra.append(float(f"{budget * ratio ** i:.4g}"))
    i += 1
  return tuple(grid) + tuple(extra) + (end,)


PASSK_POINTS = 1


def passk_grid(grid: Sequence[float], last: int = PASSK_POINTS) -> tuple[float, ...]:
  """The grid points whose evaluation also draws the 32 pass@k samples at T=1 (8x the cost of
  the 4 pass@1 samples): the start and the `last` points up to the budget (pass@1 is measured at
  every point)."""
  grid = tuple(grid)
  return tuple(sorted(set(grid[:1] + grid[-last:])))


def total_steps_cap(budget: float, c: ml_collections.ConfigDict) -> int:
  """An upper bound on a run's steps within `budget`: every step costs at least its training (a
  step on a minibatch of trainer.ppo_minibatches m: 1/m of it)."""
  step = float(c.scheduler.train_seconds_per_step) / int(c.trainer.get("ppo_minibatches", 1))
  return int(math.ceil(budget / step)) + 1


def apply(c: ml_collections.ConfigDict, overrides: Sequence[tuple[str, Any]]) -> None:
  """Sets each dotted key of `overrides` on `c` (locked: a key `c` lacks is an error naming it)."""
  for key, value in overrides:
    *path, leaf = key.split(".")
    parent = c
    for part in path:
      if part not in parent:
        raise KeyError(f"config key {key!r} does not exist in the base config (part {part!r})")
      parent = parent[part]
    if leaf not in parent:
      raise KeyError(f"config key {key!r} does not exist in the base config")
    parent[leaf] = value


def resolve(overrides: Sequence[tuple[str, Value]], c: ml_collections.ConfigDict
            ) -> list[tuple[str, Any]]:
  """Applies `overrides` to `c` in order; every `Derived` value is computed on `c` as it was
  before any of them (the base), never on a sibling override. Returns the concrete (key, value)
  list."""
  base = ml_collections.ConfigDict(c.to_dict())
  out = [(k, v.fn(base) if isinstance(v, Derived) else v) for k, v in overrides]
  apply(c, out)
  return out


def format_value(value: Any) -> str:
  """The command-line form of a config value (`--config.KEY=...`)."""
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, float):
    return repr(value)
  if isinstance(value, (tuple, list)):
    inner = ",".join(format_value(v) for v in value)
    return f"({inner},)" if len(value) == 1 else f"({inner})"
  return str(value)
