"""Every key a jaxreplay run reads, with its default and unit. Config files start from `base_config()`.

Counts of rollouts (N, B, R) follow the paper: one rollout = one completion of one prompt.
Configs are locked by the launcher: a misspelled key on the command line is an error naming it.
"""
from __future__ import annotations

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0                       # seed of the run's random streams (prompts, sampling, init,
                                   # buffer draws)
  c.total_steps = 100              # gradient steps (= policy versions produced); a cap when
                                   # compute_budget is set
  c.compute_budget = 0.0           # device-seconds of `compute_seconds` (the run's compute axis);
                                   # > 0: stop at the first step that reaches it; 0 = off

  c.model = ml_collections.ConfigDict()  # the policy: its starting weights, tokenizer, dtypes,
                                   # context and LoRA
  c.model.preset = "tiny"          # jaxreplay.models.presets name, used when `path` is empty
  c.model.path = ""                # HF model dir (config.json + *.safetensors) to start from
  c.model.tokenizer = ""           # tokenizer dir; empty: the model dir
  c.model.chat_template = "auto"   # prompts as a user turn of the tokenizer's chat template:
                                   # auto (when the tokenizer ships one) | on | off
  c.model.chat_template_kwargs = ""  # JSON object of template variables, e.g.
                                   # '{"enable_thinking": false}' (Qwen3), '{"date_string":
                                   # "26 Jul 2024"}' (Llama-3.x, else today's date)
  c.model.dtype = "float32"        # compute dtype: float32 | bfloat16
  c.model.param_dtype = "float32"  # master weights and Adam state dtype: float32 | bfloat16
  c.model.remat = False            # recompute each layer's activations in the backward (less
                                   # memory, ~1/3 more FLOPs)
  c.model.scan_unroll = 0          # layers per iteration of the layer scan: 0 = auto (all of them up
                                   # to 4 layers without remat, else 1) | 1 (a rolled loop: before
                                   # issue 13) | k
  c.model.attention = "auto"       # attention kernel: auto (cuDNN flash attention on GPU with
                                   # bfloat16, else XLA) | xla | cudnn | einsum (the reference)
  c.model.max_len = 256            # prompt + completion tokens, the context of rollouts
  c.model.lora_rank = 0            # LoRA: train adapters of rank r on lora_targets, the base frozen
                                   # (stored in param_dtype, e.g. bfloat16); engines get adapter-only
                                   # refreshes; 0 = off (full fine-tuning). vLLM: r <= 512
  c.model.lora_alpha = 16.0        # the adapters' scale alpha / r (alpha / sqrt(r) with lora_rslora)
  c.model.lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj")  # the linear kernels that get an adapter (HF module names)
  c.model.lora_rslora = False      # rank-stabilised scale alpha / sqrt(r) (PEFT's use_rslora)
  c.model.lora_dtype = "float32"   # the adapters' (and their Adam state's) dtype: float32 | bfloat16

  c.task = ml_collections.ConfigDict()  # the problems, their prompts and their rewards
  c.task.name = "arithmetic"       # arithmetic | scratchpad (addition, worked solution) |
                                   # multiplication (by one digit, worked solution) | math
                                   # | calculator (scratchpad with a calculator tool: multi-turn)
  c.task.path = ""                 # math: a local .jsonl / .json / .parquet file (or a dir)
  c.task.eval_path = ""            # math: held-out file (e.g. MATH-500); its problems are
                                   # removed from training; empty: a hashed 5% of task.path
  c.task.problem_key = "problem"   # math: the field of a dataset row that holds the problem text
  c.task.answer_key = "answer"     # math: the field of a dataset row that holds the reference
                                   # answer
  c.task.template = "qwen_math"    # math prompt template (jaxreplay.tasks.math_data.PROMPT_TEMPLATES)
  c.task.num_digits = (1, 2)       # arithmetic / scratchpad operand digits (min, max), or n: (n, n);
                                   # multiplication: the multiplicand's
  c.task.digit_decay = 1.0         # arithmetic / scratchpad: P(d digits) ~ digit_decay^(d - min),
                                   # per operand; 1 = uniform, < 1 a geometric tail of long
                                   # problems (scratchpad: long-tailed completion lengths)
  c.task.ops = "+"                 # arithmetic: the operators drawn, e.g. "+" or "+-*"
  c.task.reward_timeout_s = 5.0    # time limit of one reward call [s] (a call past it scores as
                                   # a failure, counted in reward/timeouts)
  c.task.reward_memory_gib = 2.0   # math: address space one reward call may add to its child [GiB]
  c.task.reward_fn = ""            # math: "module:function", fn(completion: str, answer: str) ->
                                   # float, run in the reward processes (time- and memory-limited
                                   # as math-verify); empty: math-verify
  c.task.num_reward_workers = 4    # math: reward processes; concurrent deliveries score in parallel
  c.task.max_skip_fraction = 0.01  # share of dataset rows (train; held-out separately) that may be
                                   # dropped at load for not fitting model.max_len (else an error)
  # Multi-turn (`jaxreplay.tasks.environments`, `jaxreplay.rollout.multiturn`): a task with its own
  # environment (calculator), or any task's problems in a plug-in environment (env_fn).
  c.task.env_fn = ""               # "module:factory": factory() -> an environment (reset / step);
                                   # empty: the task's own (calculator) or none (single-turn)
  c.task.env_max_turns = 8         # the policy's turns per trajectory at most
  c.task.env_max_tokens = 0        # trajectory budget: prompt + turns + observations [tokens];
                                   # 0 = model.max_len (never more)
  c.task.env_step_timeout_s = 5.0  # time limit of one environment call [s] (over: reward 0,
                                   # counted in env/timeouts)

  c.rollout = ml_collections.ConfigDict()  # the rollout workers: backend, request shape, sampling,
                                   # vLLM engines, placement
  c.rollout.backend = "jax"        # jax (in-process sampler) | vllm (one engine process per worker)
                                   # | auto (vllm when installed, else jax)
  c.rollout.num_workers = 1        # W, rollout workers (a vLLM engine or a JAX sampler each)
  c.rollout.group_size = 16        # G completions per prompt
  c.rollout.prompts_per_request = 4  # prompts per request a worker generates (each x group_size
                                   # completions)
  c.rollout.temperature = 1.0      # sampling temperature of the rollouts
  c.rollout.top_p = 1.0            # nucleus sampling of the rollouts: keep the smallest set of
                                   # tokens of this mass; 1 = off
  c.rollout.top_k = 0              # sample among the k most likely tokens; 0 = off
  c.rollout.max_tokens = 64        # completion length cap [tokens] (< model.max_len: the prompt
                                   # needs room)
  c.rollout.refresh_every = 1      # trainer steps between worker weight refreshes
  c.rollout.prompts_in_flight = 0  # prompts a worker takes into one generate call (whole
                                   # requests of prompts_per_request); 0 = auto: vllm fills its
                                   # engine (vllm_max_num_seqs // group_size prompts), jax one request
  c.rollout.partial = "off"        # partial rollouts (async): off (a refresh reaches a worker
                                   # between whole requests) | continue (requests advance
                                   # partial_chunk_tokens per call; at a refresh those in flight
                                   # continue under the new weights, their prefix as prompt, each
                                   # token tagged with its version; finished rows are refilled)
  c.rollout.partial_chunk_tokens = 16  # partial=continue: tokens per call between weight checks
  c.rollout.vllm_kv_cache_gib = 1  # CPU engines: KV cache [GiB] (GPU: vllm_gpu_memory_utilization)
  c.rollout.vllm_gpu_memory_utilization = 0.9  # share of its GPU(s) an engine takes (weights + KV
                                   # cache); lower it when the trainer shares the GPU
  c.rollout.vllm_max_num_seqs = 256  # sequences an engine batches at once
  c.rollout.vllm_tensor_parallel_size = 1  # GPUs per engine (JAXREPLAY_WORKER_GPUS is split in
                                   # groups of this size: workers.worker_gpu_groups)
  c.rollout.vllm_max_model_len = 0  # engine context [tokens]; 0 = model.max_len
  c.rollout.vllm_enforce_eager = "auto"  # auto (eager on CPU, CUDA graphs on GPU) | true | false
  c.rollout.vllm_engine_process = "auto"  # auto (in-process engine core on CPU, vLLM's own
                                   # engine-core process on GPU) | true | false
  c.rollout.vllm_startup_timeout_s = 0.0  # an engine's start-up (the worker process, vLLM's
                                   # engine core, torch.compile, CUDA-graph capture) before it is
                                   # declared dead [s]; 0 = auto: 300 on CPU, on GPU 600 + 300 per
                                   # engine starting at once (cold compiles of W engines share the
                                   # node's CPUs)
  c.rollout.vllm_dtype = "auto"     # engine weights and compute: auto (float32 on CPU, bfloat16 on
                                   # GPU) | float32 | bfloat16 | float16; weights are published in it
  c.rollout.weight_transport = "shm"  # how new weights reach vLLM engines: shm (HF tensors in one
                                   # /dev/shm segment, written off the trainer's thread, loaded through
                                   # vLLM's weight-transfer API) | file (an HF safetensors dir per
                                   # refresh); JAX samplers always get device arrays
  c.rollout.keep_versions = 3      # weight versions a publisher keeps for the workers (>= 2;
                                   # shm: each a /dev/shm slot of the model in vllm_dtype, never
                                   # reused while among the newest; fewer: less shared memory, more
                                   # superseded loads)
  c.rollout.sampler_batch_size = 64  # sequences per JAX-sampler call (its KV cache rows)
  c.rollout.placement = "local"    # where workers run: local (this process / child processes of
                                   # this machine) | ray (Ray actors; weights through Ray's object
                                   # store; needs the `ray` extra)
  c.rollout.ray_address = ""       # placement ray: "" starts a local Ray instance in this process;
                                   # "auto" (the cluster `ray start` made on this node) or
                                   # "host:port" of a running cluster's head connects to it
  c.rollout.ray_num_cpus_per_worker = 1.0  # placement ray: CPUs reserved per worker actor (> 0)
  c.rollout.ray_num_gpus_per_worker = -1.0  # placement ray: GPUs per worker actor (fractions ok);
                                   # -1 = auto (vllm_tensor_parallel_size for vllm on a GPU machine,
                                   # else 0)
  c.rollout.ray_placement_strategy = "PACK"  # placement ray: the one placement group (a bundle per
                                   # worker): PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
  c.rollout.ray_max_restarts = 5   # placement ray: Ray restarts of each worker actor (-1 = no
                                   # limit); then the worker is dead for good and the run fails

  c.buffer = ml_collections.ConfigDict()  # the replay buffer: capacity N, batch B, how batches are
                                   # drawn and reused
  c.buffer.size = 84               # N, in rollouts
  c.buffer.batch_size = 60         # B, rollouts per gradient step
  c.buffer.positive_fraction = 0.0  # delta of the positive-bias rule
  c.buffer.on_policy = False       # True: a queue, each rollout used once (the paper's baseline)
  c.buffer.on_policy_order = "lifo"  # the queue pops the newest B (lifo, the paper's) or oldest
  c.buffer.reuse_control = "off"   # data.reuse: off (the replay ratio the hardware split gives) |
                                   # fixed (generation paced to reuse_target uses per rollout) |
                                   # adaptive (reuse set online from the regime diagnostics) |
                                   # gradient_gate (Dynamic Gradient Gating, arXiv 2605.19425,
                                   # data.batch_reuse: each fresh batch of the on-policy queue is
                                   # reused while the LM head's gradient shows no surge)
  c.buffer.gate_max_reuse = 4      # gradient_gate: updates per fresh batch at most (the paper's K)
  c.buffer.gate_threshold = 0.5    # gradient_gate: the Z-score of the LM head's gradient-energy
                                   # increment above which an update is intercepted and the batch
                                   # ends (the paper's tau, 0.1-0.5)
  c.buffer.gate_window = 10        # gradient_gate: increments in the Z-score's sliding window
  c.buffer.reuse_target = 2.0      # uses per rollout (fixed; adaptive: the starting value)
  c.buffer.reuse_min = 1.0         # adaptive: the range of the uses per rollout
  c.buffer.reuse_max = 4.0         # adaptive: the largest uses per rollout
  c.buffer.reuse_kl_max = 0.02     # adaptive: behaviour KL (k3, nats/token) the batches may reach
                                   # (eps^2 / 2 for the clip eps 0.2): bounds rho, cuts it above
  c.buffer.reuse_ess_min = 0.0     # adaptive: IS effective sample size below which reuse drops
                                   # (0: off; the ESS enters rho* = sqrt(mu ESS B / noise scale))
  c.buffer.reuse_update_kl_max = 0.0  # adaptive: update KL (nats/token) above which reuse drops
                                   # (0: off; the update KL enters the staleness bound)
  c.buffer.priority = "uniform"    # how a batch is drawn from what is held: uniform | fresh
                                   # (priority exp(-age / fresh_tau), age in updates; successive
                                   # sampling without replacement, jaxreplay.data.buffer)
  c.buffer.fresh_tau = 4.0         # priority "fresh": the age decay tau [updates]
  c.buffer.fresh_base = "uniform"  # priority "fresh": base priority p_base, uniform (1) | reward
                                   # (|reward| + fresh_eps) | advantage (|advantage| + fresh_eps);
                                   # priority (p_base exp(-age / fresh_tau)) ** fresh_alpha.
                                   # FreshPER (arXiv 2604.16918): reward, alpha 0.6, tau 500
  c.buffer.fresh_alpha = 1.0       # priority "fresh": the exponent alpha (PER's; FreshPER 0.6)
  c.buffer.fresh_eps = 1e-6        # priority "fresh": added to |reward| / |advantage| (> 0)
  c.buffer.max_uses = 0            # a rollout leaves the buffer after this many uses; 0 = no cap
  c.buffer.max_staleness = 0       # > 0: enforced per token: completion tokens more than this
                                   # many policy versions old are masked out of a batch, and a
                                   # rollout whose newest token is that old leaves the buffer;
                                   # 0 = no limit
  c.buffer.replace_zero_variance = False  # True: rollouts of groups whose rewards are all equal
                                   # are drawn only when the other groups hold fewer than B
                                   # (DAPO's dynamic sampling without extra generation)

  c.trainer = ml_collections.ConfigDict()  # the learner: devices, loss and its options, optimizer,
                                   # train step
  c.trainer.num_devices = 1        # T, trainer devices (num_trainer_devices in the code): the
                                   # compute accounting and the simulated schedule
  c.trainer.mesh_shape = (1, -1, 1)  # (data, fsdp, tensor)
  c.trainer.loss = "grpo"          # grpo | asymre
  c.trainer.eps_low = 0.2          # GRPO: lower clip of the ratio (1 - eps_low)
  c.trainer.eps_high = 0.2         # GRPO: upper clip of the ratio (1 + eps_high; DAPO's
                                   # clip-higher > eps_low)
  c.trainer.tau = -0.1             # AsymRE baseline shift
  c.trainer.adv_eps = 1e-6         # GRPO: added to the group's reward std before dividing the
                                   # advantages
  c.trainer.adv_std_ddof = 0       # GRPO advantages' std: 0 = population std (default); 1 = sample
                                   # std, as TRL and verl (advantages x sqrt(G/(G-1)): x1.069 at G=8)
  c.trainer.dual_clip = 0.0        # GRPO dual clip c > 1 [ratio]: for A < 0 the clipped objective is
                                   # bounded below by c * A (verl's dual-clip PPO, c = 3); 0 = off
  c.trainer.aggregation = "token_mean"  # token_mean | sequence_mean | constant
  c.trainer.kl_coef = 0.0          # coefficient of the k3 KL penalty to the initial policy; 0 =
                                   # off (no reference copy)
  c.trainer.kl_clamp = 0.0         # K > 0 [nats/token]: clamp the k3 KL per token at K (and its
                                   # log-ratio at +-20), as verl does with K = 10; 0 = off
  c.trainer.tis_cap = 0.0          # truncated IS, token weight min(pi_theta/pi_sampler, C): with
                                   # off_policy "none" it turns "tis" on; 0 = off, 2.0 is common
                                   # (corrections.truncated_is_weights, loss_fn.make_loss_fn)
  c.trainer.off_policy = "none"    # off-policy correction (jaxreplay.learner.corrections): none |
                                   # tis | mis_token (verl's token rejection sampling) |
                                   # mis_sequence | m2po | decoupled
  c.trainer.off_policy_cap = 2.0   # c > 1 [ratio]: mis_* mask ratios outside [1/c, c], decoupled
                                   # filters behaviour weights > c, tis truncates at c (tis_cap 0)
  c.trainer.m2po_threshold = 0.04  # m2po: bound on the mean squared log-ratio of the kept tokens
                                   # [nats^2] (the M2PO paper: 0.04)
  c.trainer.sampling_logprobs = "processed"  # the trainer's log-probs in the ratio: processed (of
                                   # the rollouts' sampling distribution: rollout.temperature,
                                   # top_k, top_p on its own logits, as the samplers store them) |
                                   # raw (softmax of the raw logits; before issue 27). Identical
                                   # at temperature 1 without top-k / top-p
  c.trainer.learning_rate = 1e-6   # AdamW peak learning rate
  c.trainer.warmup_steps = 0       # linear warm-up of the learning rate [steps]
  c.trainer.schedule = "constant"  # constant | cosine
  c.trainer.weight_decay = 0.0     # AdamW decoupled weight decay
  c.trainer.b1 = 0.9               # Adam first-moment decay
  c.trainer.b2 = 0.999             # Adam second-moment decay
  c.trainer.max_grad_norm = 1.0    # clip the gradient's global norm to this; 0 = no clipping
  c.trainer.num_microbatches = 1   # gradient accumulation: micro-batches per step (B divides by
                                   # data*fsdp*this)
  c.trainer.ppo_epochs = 1         # epochs over each fresh batch of the on-policy queue (k;
                                   # data.batch_reuse: the classical multi-epoch baseline); 1 = one
                                   # update per batch
  c.trainer.ppo_minibatches = 1    # minibatches per epoch (m): k * m updates of B / m rollouts each
  c.trainer.max_nonfinite_skips = 5  # an update with a NaN/inf loss or gradient is skipped (metric
                                     # nonfinite_skipped); this many in a row stop the run
  c.trainer.nonfinite_check = "grads"  # what decides a skip: grads (loss and gradient norm, before
                                   # the update) | updated (also the updated params' norm: one more
                                   # pass over params and Adam state; the behaviour before issue 13)
  c.trainer.logprob_chunk = 512    # sequence chunk of the log-prob computation
  c.trainer.logprob_remat = "auto"  # recompute each chunk's logits in the backward: auto (only with
                                   # >= 2 chunks, i.e. T > logprob_chunk) | always (the behaviour
                                   # before issue 13) | never (keeps [B, T, V] logits); same values
  c.trainer.log_entropy = True     # the train step's "entropy" metric (mean next-token entropy over
                                   # completion tokens; one more pass over each logits chunk)
  c.trainer.compilation_cache = "auto"  # JAX's persistent compilation cache (a restart reuses
                                   # compiled steps): auto (WORKDIR/xla_cache on GPU, off on CPU) |
                                   # off | a directory (shared by runs; any platform)
  c.trainer.buckets = (64, 128, 256, 512, 1024, 2048, 4096, 8192)  # padded sequence lengths of a
                                   # batch [tokens]: each batch is padded to the smallest that fits
  c.trainer.pack = False           # several rollouts per row (first-fit into the bucket that needs
                                   # the fewest token slots); same loss and gradients, less padding
                                   # (tiny default: padding 44% -> 25%, 25% fewer token slots)

  c.devices = ml_collections.ConfigDict()  # GPUs of one node (jaxreplay.config.devices); CPU: unused
  c.devices.trainer = ""           # "0,1,2": the trainer's GPUs; "" = the first trainer.num_devices
  c.devices.workers = ""           # "3,4,5,6,7": the rollout workers' GPUs; "" = the GPUs left
  c.devices.memory_gib = 0.0       # one trainer device's memory for the --dry_run fit check [GiB];
                                   # 0 = the GPU's own (or no check on CPU)
  c.devices.memory_fraction = 0.9  # the share of it JAX may allocate (XLA_PYTHON_CLIENT_MEM_FRACTION)

  c.scheduler = ml_collections.ConfigDict()  # how generation and training share time: simulated,
                                   # sync or async
  c.scheduler.kind = "simulated"   # simulated: W workers / T trainer devices in virtual time |
                                   # sync: the theory's synchronous loop (R new rollouts per step)
                                   # | async: real concurrency
  # Virtual costs (simulated, sync), in device-seconds. A rollout of the reference length costs
  # g = mu * train_seconds_per_step / B; a request costs prefill_fraction * g per rollout plus
  # (1 - prefill_fraction) * g / reference_tokens per generated token.
  c.scheduler.mu = 6.84            # generation / training cost per update (paper: Qwen3-0.6B)
  c.scheduler.train_seconds_per_step = 1.0  # virtual device-seconds of one train step (the unit of
                                   # the simulated costs)
  c.scheduler.prefill_fraction = 0.1  # share of a reference rollout's cost that does not scale
                                   # with its generated tokens
  c.scheduler.reference_tokens = 0.0  # completion tokens of a reference rollout; 0 = the mean of
                                   # the run's first request
  c.scheduler.rollouts_per_step = 64  # sync: R, rollouts generated per gradient step
  c.scheduler.generation_batch = 1  # simulated + jax sampler: K requests generated in one sampler
                                   # call (the next K - 1 ahead, at the same weights; results kept
                                   # while the weights version holds, each request's noise its own,
                                   # so K changes speed only); 0 = auto (the fewest requests
                                   # that fill whole rollout.sampler_batch_size batches); 1 = one
                                   # request per call

  c.eval = ml_collections.ConfigDict()  # held-out evaluation: when, how many problems, samples and
                                   # temperatures
  c.eval.every = 20                # steps; 0 = only at the end (ignored with compute_grid)
  c.eval.compute_grid = ()         # compute_seconds values: evaluate at the first step reaching
                                   # each (and at step 0 and the end); () = every eval.every steps
  c.eval.passk_grid = ()           # compute_grid points whose evaluation also draws the n_samples
                                   # pass@k / entropy samples (pass@1 only at the others; the final
                                   # evaluation always draws them); () = every evaluation
  c.eval.refine_levels = ()        # pass@1 values (e.g. compute-to-target targets) whose crossing
                                   # is read on a finer grid: when one lies above the last pass@1
                                   # within refine_band (or the pace's reach: refine_lookahead),
                                   # the compute_grid interval ahead is split in refine_splits
                                   # (pass@1 only there)
  c.eval.refine_band = 0.05        # pass@1 below a refine level at which refinement starts
  c.eval.refine_splits = 4         # geometric parts of a refined compute_grid interval (>= 2)
  c.eval.refine_lookahead = 4.0    # refinement also starts when this many times the last pace
                                   # (pass@1 rise per device-s) over the compute left to the next
                                   # grid point reaches a level (a curve that accelerates); 0 = off
  c.eval.num_problems = 64         # held-out problems per evaluation; 0 = no evaluation
  c.eval.pass1_problems = 0        # problems of the evaluations that draw pass@1 only (the compute
                                   # grid's points outside eval.passk_grid): the first n of the
                                   # held-out set; 0 = all of them
  c.eval.batch_size = 0            # sequences per JAX-sampler call of evaluation (its KV cache is
                                   # on a trainer device); 0 = rollout.sampler_batch_size
  c.eval.n_samples = 16            # completions per problem for pass@k and entropy
  c.eval.ks = (1, 2, 4, 8, 16)     # the k of the pass@k metrics (each <= n_samples)
  c.eval.temperature_pass1 = 0.1   # sampling temperature of eval/pass@1 (near greedy)
  c.eval.temperature_passk = 1.0   # sampling temperature of the n_samples pass@k / entropy samples
  c.eval.top_p = 1.0               # the paper evaluates at top_p 0.95
  c.eval.backend = "auto"          # where evaluation samples: engines (the rollout workers, between
                                   # requests: no KV cache on the trainer devices) | trainer (a JAX
                                   # sampler beside the train state) | auto (engines when
                                   # rollout.backend is vllm, else trainer); run_config.json records
                                   # the resolved value
  c.eval.per_problem = True        # append each evaluation's per-problem correct counts (pass@1
                                   # and pass@k samples; the prompts once) to
                                   # WORKDIR/eval_problems.jsonl (format: run/eval_problems.py)

  c.checkpoint = ml_collections.ConfigDict()  # orbax checkpoints in WORKDIR/checkpoints (train
                                   # state, buffer, data cursor)
  c.checkpoint.every = 20          # steps between checkpoints (and the last step); 0 = only the last
  c.checkpoint.keep = 2            # newest checkpoints kept on disk
  c.export_hf_every = 0            # steps between DIR/hf exports (and the last step); 0 = with
                                   # every checkpoint

  c.sft = ml_collections.ConfigDict()  # supervised warm-start (`python -m jaxreplay.sft`)
  c.sft.steps = 400                # gradient steps
  c.sft.batch = 128                # examples per step
  c.sft.learning_rate = 3e-3       # Adam peak (20 warmup steps, cosine to 10%)
  c.sft.seed = 0                   # seed of the warm-start's data and init
  c.sft.carry_drop = 0.0           # arithmetic: share of carry demonstrations that drop the carry;
                                   # scratchpad: probability that a demonstration forgets a carry
  c.sft.slip = 0.0                 # scratchpad: share of the 200 column facts (x, y, carry_in) the
                                   # demonstrations misremember (written as sum +- 1);
                                   # multiplication: share of the 64 times-table facts x * y
                                   # (x, y in 2..9), written as (x +- 1) * y
  c.sft.slip_range = (0.4, 0.95)   # scratchpad / multiplication: probability range of writing a
                                   # misremembered fact
  c.sft.tool_rate = 0.0            # calculator: probability a demonstration calls the tool on a column
  c.sft.ignore_rate = 0.0          # calculator: probability it then ignores the tool's result

  c.log = ml_collections.ConfigDict()  # the progress line, diagnostics and Weights & Biases
  c.log.every_s = 10.0             # seconds between progress lines on the console
  c.log.mismatch_every = 5         # steps between trainer/sampler log-prob comparisons
  c.log.diagnostics_every = 10     # steps between regime diagnostics (run.regime: gradient noise
                                   # scale, update KL, behaviour KL, ratio quantiles, IS ESS); one
                                   # extra forward + backward each (+ the probe); 0 = off
  c.log.charge_diagnostics = "auto"  # their passes in compute_seconds: auto (charged when the
                                   # design reads them: buffer.reuse_control adaptive; measurement
                                   # only otherwise) | on | off (run.regime)
  c.log.diagnostics_splits = 4     # micro-batches of the noise-scale estimate (>= 2; fewer if the
                                   # batch does not divide)
  c.log.diagnostics_probe = 8      # rollouts of the fixed probe of diag/update_kl (0 = none);
                                   # memory: probe x max_len x vocab floats
  c.log.noise_scale_decay = 0.9    # moving-average decay of the smoothed noise scale
  c.log.wandb_project = ""         # Weights & Biases project; "" = off (wandb is not imported)
  c.log.wandb_entity = ""          # W&B team / user; "" = your default entity
  c.log.wandb_mode = "online"      # online | offline (DIR/wandb; upload later with `wandb sync`)
  c.log.wandb_run_name = ""        # "" = the workdir's name
  return c


def gpu_math_config(preset: str, learning_rate: float, mu: float,
                    num_microbatches: int = 5) -> ml_collections.ConfigDict:
  """The paper's GPU math setting for one model: vLLM workers (W, T) = (5, 3), N=84, B=60, G=16,
  async schedule, bf16 compute with f32 master weights. Set model.path and task.path to run.

  num_microbatches 5 divides B/T for each of the paper's splits (W, T) = (5, 3), (6, 2), (4, 4):
  4, 6 and 3 rows of model.max_len tokens per device per micro-batch."""
  c = base_config()
  c.total_steps = 1000
  c.model.preset = preset
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.model.remat = True
  c.model.max_len = 4608
  c.task.name = "math"
  c.eval.num_problems = 500        # MATH-500 sized held-out set
  c.eval.batch_size = 16           # the eval KV cache at 4608 tokens: 16 rows (~10 GiB for 8B)
  c.rollout.backend = "vllm"
  c.rollout.num_workers = 5            # W
  c.rollout.group_size = 16            # G
  c.rollout.prompts_per_request = 4
  c.rollout.max_tokens = 4096
  c.buffer.size = 84                   # N
  c.buffer.batch_size = 60             # B
  c.trainer.num_devices = 3            # T
  c.trainer.learning_rate = learning_rate
  c.trainer.num_microbatches = num_microbatches
  c.trainer.pack = True                # long-tailed math lengths: most of a 4.6k row is padding
  c.scheduler.kind = "async"
  c.scheduler.mu = mu
  c.eval.every = 50
  c.checkpoint.every = 50
  return c
