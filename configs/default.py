"""Quick start: FDG with K=4 stages on the embedded digits data.

    python train.py --config configs/default.py
    python train.py --config configs/default.py --config.algorithm=bp --config.num_stages=1

An MLP of four hidden blocks and a head (5 blocks, split uniformly into 4 stages) on
scikit-learn's 8x8 digits. It runs in about 13 s on 2 CPU cores, 6 s of it training (3 seeds:
96.9% test accuracy, BP 96.9%), all four stages in one program on one CPU device (`engine`).

Why these settings: FDG's stage 0 applies gradients 6 ticks stale at K=4. With plain SGD and
momentum 0.9 the effective step is ~10x the learning rate and the stale gradients push the
first stages in directions the later stages have already moved away from; on this small MLP
that oscillates or diverges. Momentum 0.5 with lr 0.05 and a short warm-up keeps BP's
accuracy while letting every schedule train (see the README's Results section).
"""

import ml_collections
from ml_collections.config_dict import placeholder


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  c = ml_collections.ConfigDict()
  # The method.
  c.algorithm = "fdg"          # bp | ddg | fdg | pipedream | gpipe | 1f1b (synchronous)
  c.microbatches = 4           # gpipe, 1f1b: micro-batches per tick (must divide batch_size)
  c.num_stages = 4             # K: stages, each on its own device where there are K
  c.beta = 1.0                 # FDG gradient shrinking, in (0, 1]
  c.plan_module = ""           # a module imported before the config is checked: one that
                               # registers schedules (fdg_jax.plans.register) for
                               # --config.algorithm
  c.shrink_at = "gradient"     # gradient (the paper's: stage k's gradient times
                               # beta^(K-1-k)) | update (its update instead: a per-stage
                               # learning-rate scale, the form that acts under Adam-like
                               # optimisers, which ignore a constant gradient scale)
  c.backward = "stash"         # stash | recompute
  c.split = "uniform"          # uniform | balanced | paper | "3,6,9" (explicit boundaries)
  c.split_cost = "flops"       # what split=balanced balances: flops | bytes (XLA's counts) |
                               # time (each block timed on this machine: the fastest
                               # pipeline here, but it can differ between machines; for a
                               # run that must repeat, give its boundaries)
  # The model and data.
  c.model = "mlp"              # mlp | cnn | resnet20..resnet1202 | resnet18..resnet101 |
                               # wrn28_10 | vit | gpt (`fdg_jax.models.names()`)
  c.model_kwargs = ml_collections.ConfigDict({"widths": (128, 128, 128, 128)})  # the model's
                               # arguments, replaced whole: '{"widths": (64, 64)}'
  c.dataset = "digits"         # digits (embedded) | mnist | fashion_mnist | cifar10 | cifar100
                               # | svhn_cropped | stl10 | imagenet2012 (TFDS) | stdlib_text;
                               # fashion_mnist also from its IDX files (Debian's package
                               # dataset-fashion-mnist, or in data_dir)
  c.data_dir = ""              # TFDS data_dir ("" = TFDS default), or a folder holding
                               # fashion_mnist's original IDX .gz files
  c.data_workers = 0           # processes decoding/augmenting training batches (ImageNet);
                               # 0: in this process. Batches are the same for any value.
  # Optimisation.
  c.dtype = "float32"          # float32 | bfloat16 (bf16 compute, activations and stash;
                               # float32 master weights, optimizer state and loss)
  c.batch_size = 32            # examples per tick (the global batch over replicas)
  c.num_epochs = 30            # passes over the training split
  c.optimizer = "sgd"          # sgd | adam | basis_rotation | nadam_warmup | any optax or
                               # optax.contrib optimizer by name (adamw, nadam, lion, muon, ...)
  c.learning_rate = 0.05       # the peak rate of lr_schedule
  c.momentum = 0.5             # sgd's (and any optimizer's with a `momentum` parameter)
  c.nesterov = False           # sgd: Nesterov momentum (others with a `nesterov` parameter)
  c.weight_decay = 1e-4        # sgd: L2 added to the gradient; adam: AdamW; others: their own
  c.b1 = placeholder(float)    # Adam family's b1 (None: the optimizer's default)
  c.b2 = placeholder(float)    # Adam family's b2
  c.eps = placeholder(float)   # Adam family's eps
  c.optimizer_kwargs = ml_collections.ConfigDict()  # any other parameter of the optimizer,
                               # e.g. '{"beta": 0.9}' for muon, '{"frequency": 20}'
  c.lr_schedule = "cosine"     # constant | multistep | cosine
  c.lr_milestones = (150, 225, 275)  # epochs, for multistep
  c.lr_gamma = 0.1             # multistep: the rate's factor at each milestone
  c.warmup_epochs = 1.0        # linear warm-up from 0, in epochs (then lr_schedule)
  # Staleness remedies (fdg_jax.staleness), each applied per stage with its delay d_k.
  c.staleness = "none"         # auto (the study's choice for the optimizer and schedule) |
                               # none | lr_by_delay | weight_prediction | spike_compensation |
                               # dc | nesterov_delay | error_feedback | discrepancy_correction
                               # (several joined by "+")
  c.staleness_ramp_epochs = 7.0  # lr_by_delay: epochs until every stage runs at the base lr
                               # (-1: never; stage k keeps lr / d_k for the whole run)
  c.staleness_lr_power = 1.0   # lr_by_delay: lr * d_k^-power at the start (PipeMare: 1)
  c.staleness_horizon = -1.0   # weight_prediction: steps to extrapolate (-1: the delay d_k)
  c.dc_lambda = 0.04           # dc: the compensation strength lambda
  c.dc_adaptive = False        # dc: lambda_t = dc_lambda0 / sqrt(M + eps) (DC-ASGD-a)
  c.dc_lambda0 = 2.0           # dc adaptive: lambda_t = dc_lambda0 / sqrt(M + eps)
  c.dc_decay = 0.95            # dc adaptive: the decay of M, the mean square gradient
  c.nesterov_gamma = 0.99      # nesterov_delay: the look-ahead momentum gamma
  c.staleness_strength = 1.0   # error_feedback: u + strength * d_k * (u - u_prev)
  c.discrepancy_decay = 0.9    # discrepancy_correction (recompute): decay of the average
                               # weight increment delta; the backward runs at theta - d_k delta
  c.telemetry_every_steps = 0  # >0: every N steps, per-stage weight discrepancy and stale-vs-
                               # fresh gradient cosine in metrics.jsonl (0: off)
  # Run.
  c.seed = 0                   # parameters, data order and dropout
  c.checkpoint_every_steps = 500  # ticks between checkpoints (also at the end and on SIGTERM)
  c.eval_every_epochs = 1      # epochs between evaluations on the test split
  c.eval_every_steps = 0       # >0: also every N steps (a finer test curve; 0: off)
  c.log_every_steps = 50       # ticks between training-loss rows of metrics.jsonl
  c.num_cpu_devices = 4        # on CPU: devices to create so stages can be placed apart
  c.engine = "auto"            # auto | fused (all stages in one program on one device) |
                               # per_stage (a device per stage) | spmd (FDG: one program
                               # over a device per stage, or the replicas x stages mesh);
                               # auto: fused on CPU, per_stage on K accelerators
  c.gate = "auto"              # auto | mask | cond: how the fused engine gates DDG's and
                               # FDG's stages during the pipeline fill (Schedule.gate; auto:
                               # cond for FDG on CPU with small ticks, as here, else mask)
  c.ticks_per_call = 32        # ticks run by one schedule.run call (fewer at log, eval and
                               # checkpoint boundaries)
  c.num_replicas = 1           # data-parallel replicas of the pipeline (DP x FDG)
  c.peer_timeout_s = 30        # several processes: a process silent (no heartbeat) this long
                               # is reported lost by the others (one line, exit code 3); a
                               # lost coordinator (process 0) is noticed at once
  c.stall_timeout_s = 600.0    # no tick, evaluation or checkpoint completing this long: one
                               # line saying where the run waits, the Python stacks in
                               # <workdir>/stall_stacks.txt, exit code 4 (0: never)
  c.stall_first_tick_s = 1800.0  # the same for the first tick and the first evaluation, which
                               # compile
  c.eval_batch_size = 512      # examples per evaluation batch
  c.max_steps = -1             # stop after this many ticks (-1: num_epochs)
  c.compilation_cache = "auto"  # JAX's persistent compilation cache: auto (a user-level
                               # directory shared by runs, ~/.cache/fdg_jax/xla or
                               # $FDG_JAX_CACHE_DIR), a directory, or "off"
  c.progress_bar = True        # a tqdm bar per epoch on stderr
  return c
