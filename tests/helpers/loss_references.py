"""Float64 loop references of the losses, advantages and the peers' conventions (TRL's and verl's
formulas written one token at a time), for tests/learner/test_losses.py."""
import math

import numpy as np

EPS_LOW, EPS_HIGH = 0.1, 0.3  # the clip range the references default to (and test_losses uses)


def np_grpo_advantages(rewards, eps=1e-6):
  out = np.zeros(rewards.shape)
  for p in range(rewards.shape[0]):
    row = [float(r) for r in rewards[p]]
    mean = sum(row) / len(row)
    std = math.sqrt(sum((r - mean) ** 2 for r in row) / len(row))
    for i, r in enumerate(row):
      out[p, i] = 0.0 if max(row) == min(row) else (r - mean) / (std + eps)
  return out


def np_asymre_advantages(rewards, tau):
  out = np.zeros(rewards.shape)
  for p in range(rewards.shape[0]):
    row = [float(r) for r in rewards[p]]
    baseline = tau if len(row) == 1 else sum(row) / len(row) + tau
    for i, r in enumerate(row):
      out[p, i] = r - baseline
  return out


def np_aggregate(x, mask, aggregation, normalizer=None):
  num_rows, num_tokens = x.shape
  if aggregation == "sequence_mean":
    row_means = []
    for b in range(num_rows):
      s = n = 0.0
      for t in range(num_tokens):
        if mask[b, t] > 0:
          s += x[b, t]
          n += 1
      if n > 0:
        row_means.append(s / n)
    return sum(row_means) / len(row_means) if row_means else 0.0
  s = n = 0.0
  for b in range(num_rows):
    for t in range(num_tokens):
      if mask[b, t] > 0:
        s += x[b, t]
        n += 1
  if aggregation == "token_mean":
    return s / n if n else 0.0
  return s / (normalizer if normalizer is not None else num_rows * num_tokens)


def np_token_loss(lp, adv, mask, kind, blp=None, ref=None, kl_coef=0.0, tis=None, cap=None,
                  eps_low=EPS_LOW, eps_high=EPS_HIGH):
  """Per-token loss [B, T] and the token-level statistics, one token at a time."""
  num_rows, num_tokens = lp.shape
  per_token = np.zeros(lp.shape)
  pg = np.zeros(lp.shape)
  stats = {"ratio": [], "clipped": [], "kl": [], "w": [], "truncated": [], "neg_lp": []}
  for b in range(num_rows):
    for t in range(num_tokens):
      if mask[b, t] == 0:
        continue
      stats["neg_lp"].append(-float(lp[b, t]))
      if kind == "asymre":
        obj = float(adv[b]) * float(lp[b, t])
      else:
        old = float(tis[b, t]) if tis is not None else float(blp[b, t])
        rho = math.exp(float(lp[b, t]) - old)
        w = 1.0
        if tis is not None:
          w = math.exp(float(tis[b, t]) - float(blp[b, t]))
          stats["truncated"].append(cap is not None and w >= cap)
          if cap is not None:
            w = min(w, cap)
          stats["w"].append(w)
        unclipped = rho * float(adv[b])
        clipped = min(max(rho, 1.0 - eps_low), 1.0 + eps_high) * float(adv[b])
        obj = w * min(unclipped, clipped)
        stats["ratio"].append(rho)
        stats["clipped"].append(clipped < unclipped)
      pg[b, t] = -obj
      per_token[b, t] = -obj
      if ref is not None:
        d = float(ref[b, t]) - float(lp[b, t])
        k3 = math.exp(d) - d - 1.0
        stats["kl"].append(k3)
        per_token[b, t] += kl_coef * k3
  return per_token, pg, stats


def np_loss(lp, adv, mask, kind, aggregation, normalizer=None, **kw):
  per_token, pg, st = np_token_loss(lp, adv, mask, kind, **kw)
  mean = lambda v: float(np.mean(v)) if len(v) else 0.0
  valid_rows = [b for b in range(mask.shape[0]) if mask[b].sum() > 0]
  aux = {"num_tokens": float(mask.sum()), "entropy_proxy": mean(st["neg_lp"]),
         "advantage_mean": mean([adv[b] for b in valid_rows]),
         "pg_loss": np_aggregate(pg, mask, aggregation, normalizer)}
  if kind == "grpo":
    aux.update(ratio_mean=mean(st["ratio"]), ratio_max=max(st["ratio"], default=0.0),
               clip_fraction=mean(st["clipped"]))
  if kw.get("ref") is not None:
    aux["kl"] = mean(st["kl"])
  return np_aggregate(per_token, mask, aggregation, normalizer), aux


def np_grpo_ddof_advantages(rewards, eps, ddof):
  """TRL / verl: (r - mean) / (std + eps) with torch.std's ddof = 1; jaxreplay's default ddof 0."""
  out = np.zeros(rewards.shape)
  for p in range(rewards.shape[0]):
    row = [float(r) for r in rewards[p]]
    mean = sum(row) / len(row)
    std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - ddof))
    for i, r in enumerate(row):
      out[p, i] = 0.0 if max(row) == min(row) else (r - mean) / (std + eps)
  return out


def np_dual_clip_and_kl(lp, blp, adv, ref, mask, eps_low, eps_high, dual_clip, kl_coef, kl_clamp):
  """verl's `compute_policy_loss` (dual clip, clip_ratio_c) and `kl_penalty` ("low_var_kl": the
  log-ratio clipped to [-20, 20], k3 clipped to [-K, K]) one token at a time, in float64: (per-token
  loss, its derivative wrt lp, whether the dual bound binds), each [B, T] (0 on padding)."""
  loss, grad, binds = np.zeros(lp.shape), np.zeros(lp.shape), np.zeros(lp.shape, bool)
  for b in range(lp.shape[0]):
    for t in range(lp.shape[1]):
      if mask[b, t] == 0:
        continue
      a = float(adv[b])
      rho = math.exp(float(lp[b, t]) - float(blp[b, t]))
      l1, l2 = -a * rho, -a * min(max(rho, 1.0 - eps_low), 1.0 + eps_high)
      l_clip, d_clip = (l1, -a * rho) if l1 >= l2 else (l2, 0.0)
      if dual_clip and a < 0 and -a * dual_clip < l_clip:
        l_clip, d_clip, binds[b, t] = -a * dual_clip, 0.0, True
      d = float(ref[b, t]) - float(lp[b, t])
      if kl_clamp:
        dc = min(max(d, -20.0), 20.0)
        k3 = math.exp(dc) - dc - 1.0
        d_k3 = 0.0 if (abs(d) > 20.0 or k3 > kl_clamp) else 1.0 - math.exp(d)
        k3 = min(k3, kl_clamp)
      else:
        k3, d_k3 = math.exp(d) - d - 1.0, 1.0 - math.exp(d)
      loss[b, t] = l_clip + kl_coef * k3
      grad[b, t] = d_clip + kl_coef * d_k3
  return loss, grad, binds
