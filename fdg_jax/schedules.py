"""The BP, DDG and FDG schedules: one tick of each, exactly as ALGORITHMS.md fixes it.

Design. The network is K stages (`fdg_jax.Stage`). Each stage k has its own state::

    params, model_state, opt_state, rng,
    stash:        the ring buffer of delayed-backward entries, D_k slots (D_k = 1 for BP,
                  K-k for DDG, 2(K-1-k) for FDG; the last stage has none),
    stash_batch:  int32[D_k], which batch each slot belongs to,
    pushes, pops: int32 counters; the next slot written is pushes % D_k, read pops % D_k.

A stash entry is, under `backward="stash"`, the residuals of `jax.vjp` of the stage's forward
(so the delayed backward is exactly the gradient at the weights that forward used; constants
the vjp closes over are rebuilt rather than stored, `stages.Residuals`), and under
`backward="recompute"` only the stage input and its RNG key (the backward re-runs the vjp with
the current weights).

One definition of a tick. A stage's work at a tick is one pure function of (stage state,
arriving activation, arriving cotangent, whether it forwards, whether it backwards) ->
(stage state, activation to send, cotangent to send, batch updated); the last stage's is
(state, activation, active) -> (state, cotangent, metrics). `_tick` composes them in the
order of ALGORITHMS.md. Three engines run those same functions:

- fused (every stage on one device): `_tick` inside one jitted program over all K stages;
  `run` scans it over T ticks (or, where the platform runs nested backward convolutions
  slowly, calls a one-tick program T times), `step` is the one-tick program.
- per stage (a device per stage, or a (data, stage) mesh): each stage's work is its own
  jitted call on its devices, and messages move between them with the `Placement`
  (`jax.device_put`; shard by shard in a multi-process run). `step` runs one tick, `run`
  runs T ticks from the host.
- SPMD (FDG, a device per stage or an (R, K) mesh, in one process or several, `engine="spmd"`;
  `fdg_jax.spmd`): T ticks as one program over the devices, each switching to its own
  stage's work, messages moving by `ppermute`, replicas averaging by `pmean`; the state is
  kept as padded flat vectors per stage (and replica).

Whether a stage forwards or backwards at tick t (warm-up) is known from t: on the host the
flags are Python booleans and select a compiled variant; inside a program whose ticks may
lie in the pipeline fill they are traced, so one program serves every tick and steady ticks
never retrace. The fused engine gates a stage's work on traced flags in one of two ways
(`gate`): "mask" computes the work and masks the state updates and messages (a masked
stage's state and messages stay as they were, bit for bit); "cond" runs, under one
conditional per stage and tick, the stage's work compiled for each flag combination it can
meet, flags as Python booleans, and chains a tick's conditionals so that XLA runs them one
after another (see `engines.GatedOps`).

Each stage's parameters, optimizer state, model state and counters are kept packed into a
few flat buffers per dtype (`fdg_jax.packing`): a call's host cost grows with its leaves.
`params`, `model_states` and `stage_state` unpack them. The stash ring is packed alike, slot
after slot (it stays one buffer per leaf under a (data, stage) mesh, where each leaf is split
along its own batch axis, with telemetry, and for one-slot rings); off CPU the state keeps
next to it its head, the entry the next tick reads, so that no engine reads the ring before
writing it within a tick (see `ring.with_ring`). Messages sent at tick t are read at tick
t+1 (DDG cotangents, FDG activations and cotangents); they are carried in the state's
`inbox`, preallocated with zeros so the state has one fixed structure from the first tick on
(and can be checkpointed at any tick).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fdg_jax import plans as plans_lib
from fdg_jax.delays import ring_heads_default
from fdg_jax import engines
from fdg_jax import ring as ring_lib
from fdg_jax.engines import NO_UPDATE
from fdg_jax.packing import Layout
from fdg_jax.ring import select as _select
from fdg_jax.placement import Placement
from fdg_jax.shrink import shrink
from fdg_jax import spmd as spmd_lib
from fdg_jax import staleness as staleness_lib
from fdg_jax.stages import Residuals, Stage, stage_key as _stage_key, training_vjp
from fdg_jax.telemetry import Telemetry

PyTree = Any
ALGORITHMS = plans_lib.names(microbatched=False)  # the built-in tick plans (bp, ddg, fdg)
BACKWARD_POLICIES = ("stash", "recompute")
SHRINK_AT = ("gradient", "update")  # where FDG's beta scales stage k: its gradient or update
ENGINES = ("auto", "fused", "per_stage", "spmd")
GATES = ("mask", "cond")
# The largest training forward (FLOPs, one stage, one tick) for which FDG's fused programs
# on CPU gate their stages with chained conditionals by default (`Schedule.gate`): the
# quick-start MLP's stages do 0.5-1.1 MFLOP and gain; larger ticks gain less or lose
# (benchmarks/gates.py, docs/notes.md 3.11).
COND_GATE_MAX_FLOPS = 3e6


def classification_metrics(outputs, labels) -> dict:
  """Accuracy of logits `outputs` [B, C] against int labels [B] or one-hot labels [B, C]."""
  pred = jnp.argmax(outputs, axis=-1)
  if labels.ndim == outputs.ndim:
    labels = jnp.argmax(labels, axis=-1)
  return {"accuracy": jnp.mean((pred == labels).astype(jnp.float32))}


def compiler_options_for(platform: str) -> dict:
  """XLA options for the programs that run ticks on `platform` (per program, not global).

  XLA:CPU: copy insertion with region analysis. By default XLA:CPU copies every
  loop-carried value whose old and new versions are both live within a loop iteration,
  which a tick's state always is (a stage reads last tick's message while the stage below
  writes this tick's; the update reads the parameters the forward then uses). Region
  analysis proves those copies unneeded: the quick-start MLP's FDG K=4 loop body went
  from 40 copies to none, and its time per sample from 1.8-1.9x BP K=1's to 1.4-1.5x; it
  also updates the stash rings in place without their heads (`ring_heads`; docs/notes.md
  3.9). GPUs and TPUs keep XLA's defaults (not measured there).
  """
  if platform == "cpu":
    return {"xla_cpu_copy_insertion_use_region_analysis": True}
  return {}


def _check_message(k: int, spec) -> None:
  """Refuses, in one line, a message between stages with a non-floating leaf: its cotangent
  would be float0, which the stage after it cannot send back."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(spec)[0]:
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise ValueError(
          f"stage {k} sends a {leaf.dtype} leaf ({jax.tree_util.keystr(path) or 'its output'})"
          f" to stage {k + 1}; messages between stages must be floating-point arrays: "
          "recompute integer data (positions, masks) inside each stage, or send it as floats")


def _count(flag):
  """1 if `flag` else 0, as int32 (static for a Python bool)."""
  return 1 if flag is True else flag.astype(jnp.int32)


def has_convolution(fn, *args) -> bool:
  """Whether `fn(*args)`, traced abstractly, contains a convolution (nested ones included)."""
  return "conv_general_dilated" in str(jax.make_jaxpr(fn)(*args))


class Schedule(Telemetry):
  """A decoupled-training schedule over K stages. Build with `bp`, `ddg` or `fdg`.

  Public methods: `init`, `step` (one tick), `run` (T ticks in one call), `params`,
  `model_states`, `stage_state`, `stash`, `evaluate`, `stash_bytes`. `engine`: "auto"
  (fused on one device, else per-stage), "fused", "per_stage" or "spmd" (see the module
  docstring). `compiler_options`: XLA options of the programs that run ticks (None: the
  platform's measured default, `compiler_options_for(platform)`; {}: XLA's own defaults).
  `ring_heads`: whether each stash ring of two slots or more keeps its head (see
  `_stage_with_ring`; None: where XLA is not known to update the rings in place without
  one, that is, except on CPU with the default compiler options). `gate`: how the fused
  engine's programs gate a stage's work during the pipeline fill, "mask" or "cond" (None:
  the measured default of the platform and model, see the `gate` property).
  The state is a pytree of device
  arrays plus a host integer `tick`; `step` and `run` consume (donate) the state they are
  given, so always continue from the state they return.
  """

  def __init__(self, algorithm, stages: Sequence[Stage], loss_fn: Callable,
               optimizer, *, beta: float = 1.0, shrink_at: str = "gradient",
               backward: str = "stash",
               devices=None, mesh=None, metrics_fn: Callable | None = None,
               engine: str = "auto", scan: bool | None = None, telemetry: bool = False,
               compiler_options: dict | None = None, ring_heads: bool | None = None,
               gate: str | None = None, microbatches: int | None = None):
    if isinstance(algorithm, str) and algorithm not in plans_lib.names():
      raise ValueError(f"unknown algorithm {algorithm!r}; choose one of "
                       f"{plans_lib.names()} (or register one: fdg_jax.plans.register)")
    if backward not in BACKWARD_POLICIES:
      raise ValueError(f"unknown backward policy {backward!r}; choose one of {BACKWARD_POLICIES}")
    if engine not in ENGINES:
      raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    if gate is not None and gate not in GATES:
      raise ValueError(f"unknown gate {gate!r}; choose one of {GATES} (or None: the "
                       "platform's default)")
    stages = list(stages)
    if not stages:
      raise ValueError("a schedule needs at least one stage")
    if not all(isinstance(s, Stage) for s in stages):
      raise TypeError("stages must be fdg_jax.Stage objects (see Stage.from_fn / from_linen)")
    if not 0.0 < beta <= 1.0:
      raise ValueError(f"beta must lie in (0, 1], got {beta}")
    if shrink_at not in SHRINK_AT:
      raise ValueError(f"unknown shrink_at {shrink_at!r}; choose one of {SHRINK_AT}")
    # The plan: the calls of a tick (`fdg_jax.plans`), by name or given.
    if isinstance(algorithm, str):
      sp = plans_lib.spec(algorithm)
      if microbatches is not None and not sp.microbatched:
        raise ValueError(f"microbatches is an option of "
                         f"{' and '.join(plans_lib.names(microbatched=True))}; {algorithm} "
                         "splits no batch")
      if sp.microbatched and microbatches is None:
        raise ValueError(f"{algorithm} needs microbatches=M (the parts of each batch)")
      if sp.microbatched and int(microbatches) < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
      options = {"microbatches": int(microbatches)} if sp.microbatched else {}
      self.plan = plans_lib.plan(algorithm, len(stages), **options)
    else:
      self.plan = algorithm
    if not isinstance(self.plan, plans_lib.Plan):
      raise TypeError(f"algorithm must be a registered schedule's name or a plans.Plan, got "
                      f"{type(algorithm).__name__}")
    if self.plan.num_stages != len(stages):
      raise ValueError(f"the plan {self.plan.name!r} is for {self.plan.num_stages} stages, "
                       f"got {len(stages)}")
    self.algorithm = self.plan.name
    self.microbatches = self.plan.microbatches
    if self.plan.accumulates:  # a synchronous pipeline: nothing delayed to configure
      bad = [name for name, value, off in (("beta", beta, 1.0), ("backward", backward, "stash"),
                                           ("telemetry", telemetry, False),
                                           ("shrink_at", shrink_at, "gradient"))
             if value != off]
      if bad:
        raise ValueError(f"{self.algorithm} takes no {', '.join(bad)} (it has no delay: no "
                         "stash policy, shrinking or telemetry)")
      if mesh is not None:
        raise ValueError(f"{self.algorithm} runs on one device or a device per stage; "
                         "data-parallel meshes are for plans that apply each gradient as "
                         "it comes (bp, ddg, fdg)")
      if engine not in ("auto", "fused", "per_stage"):
        raise ValueError(f"{self.algorithm} runs on the fused or per-stage engine, not "
                         f"{engine!r}")
    self.stages = stages
    self.num_stages = len(stages)
    self.loss_fn = loss_fn
    self.beta = float(beta)
    self.shrink_at = shrink_at
    self.backward = backward
    self.metrics_fn = metrics_fn or classification_metrics
    self.telemetry_enabled = bool(telemetry)
    self.placement = Placement.create(self.num_stages, devices=devices, mesh=mesh)
    self.optimizers = self._stage_optimizers(optimizer)
    one_device = self.placement.single_device is not None
    if engine == "fused" and not one_device:
      raise ValueError("engine='fused' runs every stage in one program on one device; "
                       "pass devices=None (or K copies of one device), or engine='per_stage'")
    self.engine = ("fused" if one_device else "per_stage") if engine == "auto" else engine
    self._spmd = None
    if self.engine == "spmd":
      spmd_lib.Engine.check(self)
      if self.telemetry_enabled:
        raise ValueError("staleness telemetry reads per-stage rings; use engine='per_stage' "
                         "or 'fused' with telemetry=True")
      self._spmd = spmd_lib.Engine(self)
    self._scan = scan
    self._gate = gate
    self.compiler_options = (compiler_options_for(self.platform) if compiler_options is None
                             else dict(compiler_options))
    if ring_heads is None:  # the default options of this platform, or a head
      ring_heads = (ring_heads_default(self.platform)
                    or self.compiler_options != compiler_options_for(self.platform))
    self.ring_heads = bool(ring_heads)
    self._core_layouts: list = [None] * self.num_stages
    self._stash_axes: list = [None] * self.num_stages
    self._stash_residuals: list = [None] * self.num_stages  # `stages.Residuals`
    self._batch_spec = None
    self._has_conv = None
    self._flops = None  # `_forward_flops`
    self._metrics_shapes = None
    self._step_fns: dict = {}
    self._eval_fns: dict = {}
    self._unpack_fns: dict = {}
    self._constants: dict = {}
    self._telemetry_fns: dict = {}
    self._core_entry_sizes: list = [None] * self.num_stages
    self._input_treedefs: list = [None] * self.num_stages
    self._ring_layouts: list = [None] * self.num_stages  # flat rings' slot layouts
    self._per_stage_ops = engines.PerStageOps(self)
    self._fused_ops = engines.FusedOps(self)
    self._gated_ops = engines.GatedOps(self)
    self._data_axis = None  # set while the SPMD engine traces a program over replicas

  # ------------------------------------------------------------------ properties
  @property
  def delays(self) -> tuple[int, ...]:
    """d_k for every stage: the staleness of the gradient stage k applies (from the plan)."""
    return self.plan.delays

  @property
  def ring_sizes(self) -> tuple[int, ...]:
    """D_k for every stage: the number of stash slots it carries (from the plan)."""
    return self.plan.ring_sizes

  @property
  def fill_ticks(self) -> int:
    """The first tick from which every stage forwards and backwards (the pipeline is full)."""
    return self.plan.fill_ticks

  @property
  def peak_stash(self) -> tuple[int, ...]:
    """Stash entries each stage holds at its peak (`plans.Plan.ring_sizes`: for a
    synchronous pipeline, micro-batches of vjp residuals within the tick)."""
    return self.ring_sizes

  @property
  def scan(self) -> bool:
    """Whether the fused `run` scans its ticks (else it calls a one-tick program T times).

    Default: scan, except on CPU for models with convolutions, whose backward XLA:CPU runs
    10-40x slower inside a loop body than at the top level of a program.
    """
    if self._scan is not None:
      return bool(self._scan)
    return not (self.platform == "cpu" and self._has_conv)

  @property
  def gate(self) -> str:
    """How the fused engine gates a stage's work on traced flags: "mask" or "cond".

    Default: "cond" for FDG with `backward="stash"` on CPU where the ticks are small (no
    convolution, and no stage's training forward above `COND_GATE_MAX_FLOPS`), "mask"
    elsewhere. On a small tick the chained conditionals keep XLA:CPU from spreading the
    stages' independent kernels over its thread pool, which costs more than the overlap
    gains: the quick-start MLP's FDG K=4 loop takes 1.22-1.25x BP K=1's time per sample
    with them, 1.35-1.47x with masks, on the 2-core reference machine (K=2: 1.13x against
    1.30x; K=5: 1.36x against 1.71x; docs/notes.md 3.11). On larger ticks the overlap
    pays: a GPT of width 128 at batch 16 x 128 tokens ran 1.25x slower with them. Measured
    mixed, so left on masks: `recompute` (K=4 5% slower, K=5 12% faster) and DDG (slower
    with `stash`, faster with `recompute`). A conditional's branches are nested
    computations, in which XLA:CPU runs backward convolutions slowly (see `scan`). GPUs
    and TPUs keep masks (not measured there; a GPU conditional reads its predicate back to
    the host).
    """
    if self._gate is not None:
      return self._gate
    small = (self.platform == "cpu" and self.plan.decoupled and self.backward == "stash"
             and not self._has_conv and max(self._forward_flops()) <= COND_GATE_MAX_FLOPS)
    return "cond" if small else "mask"

  def _forward_flops(self) -> list[float]:
    """Each stage's training forward's FLOPs at the prepared batch shapes, as XLA counts
    them in the lowered (unoptimised) program; inf where it cannot tell."""
    if self._flops is None:
      if self._batch_spec is None:
        raise ValueError("the schedule's batch shapes are not known yet: call "
                         "schedule.init(..., example_batch=...) or run a tick first")
      flops = []
      for k, stage in enumerate(self.stages):
        s = self._core_spec(k)
        x = self._batch_spec[0] if k == 0 else self._act_specs[k - 1][0]
        fwd = lambda p, ms, a, st=stage: st.apply(p, ms, a, train=True,
                                                  rng=jax.random.PRNGKey(0))[0]
        try:
          cost = jax.jit(fwd).lower(s["params"], s["model_state"], x).cost_analysis()
          cost = cost[0] if isinstance(cost, (list, tuple)) else cost
          flops.append(float(cost["flops"]))
        except Exception:  # no cost model on this backend or version
          flops.append(float("inf"))
      self._flops = flops
    return self._flops

  def _reachable_flags(self, k: int) -> list[tuple[bool, bool]]:
    """The (forwards, backwards) combinations stage k meets over all ticks (the flags are
    constant from the end of the pipeline fill on)."""
    return sorted({self._flags(k, t) for t in range(self.fill_ticks + 1)})

  @property
  def platform(self) -> str:
    """The platform of the stages' devices ("cpu", "gpu", "tpu")."""
    return next(iter(self.placement.state_shardings[0].device_set)).platform

  def _stage_optimizers(self, optimizer):
    """Stage k's optimizer: `optimizer` itself, its k-th entry, or `optimizer(k, d_k)`.

    Every one becomes a `staleness.DelayedTransformation` (a plain optax transform gets the
    identity forward hook); FDG's shrinking is chained first (`shrink_at="gradient"`, the
    paper's), or last (`"update"`: a learning-rate scale, for optimisers such as Adam whose
    update ignores a constant gradient scale).
    """
    K = self.num_stages
    if hasattr(optimizer, "init") and hasattr(optimizer, "update"):
      opts = [optimizer] * K
    elif callable(optimizer):  # a factory of the stage and its delay
      opts = [optimizer(k, d) for k, d in enumerate(self.delays)]
    else:
      opts = list(optimizer)
      if len(opts) != K:
        raise ValueError(f"got {len(opts)} optimizers for {K} stages")
    if self.beta != 1.0 and self.shrink_at == "gradient":
      opts = [staleness_lib.chain(shrink(self.beta, k, K), o) for k, o in enumerate(opts)]
    elif self.beta != 1.0:
      opts = [staleness_lib.chain(o, shrink(self.beta, k, K)) for k, o in enumerate(opts)]
    return [staleness_lib.with_forward(o) for o in opts]

  def _forward_params(self, k, params, opt_state, flag):
    """The weights stage k's forward runs at (its optimizer's forward hook, e.g. weight
    prediction), and the optimizer state after the hook; masked by `flag`."""
    new_params, new_state = self.optimizers[k].forward(params, opt_state)
    same = lambda a, b: all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    if not same(new_state, opt_state):  # a hook that records (DC's ring of forward weights)
      new_state = _select(flag, new_state, opt_state)
    return new_params, new_state

  def _flags(self, k: int, t):
    """(forwards, backwards) of stage k at tick t (for the last stage: active, active).

    `t` is a host int (Python booleans come back), a traced int (traced booleans), or None
    for a tick past the pipeline fill (always True).
    """
    return self.plan.flags(k, t)

  # ------------------------------------------------------------------ pure pieces
  def _vjp(self, k, params, model_state, x, rng):
    """vjp of stage k's training forward (see `fdg_jax.stages.training_vjp`)."""
    return training_vjp(self.stages[k], params, model_state, x, rng)

  def _forward(self, k, params, model_state, x, rng):
    """Stage k's training forward. Returns (y, new model state, stash entry)."""
    if self.backward == "stash":
      y, vjp_fn, new_state = self._vjp(k, params, model_state, x, rng)
      # The vjp's residuals but its constants (`Residuals`), known once the schedule is
      # prepared.
      residuals = self._stash_residuals[k]
      entry = tuple(jax.tree.leaves(vjp_fn))
      entry = residuals.stored(entry) if residuals is not None else entry
    else:
      y, new_state = self.stages[k].apply(params, model_state, x, train=True, rng=rng)
      # The input's leaves (a message may be any pytree); the key is rebuilt from the
      # batch index (see `_stage_key`).
      entry = tuple(jax.tree.leaves(x))
    return y, new_state, entry

  def _backward(self, k, params, model_state, opt_state, entry, cotangent, rng):
    """Gradient w.r.t. stage k's params and input, given the stash entry and a cotangent.

    `rng` is the key the forward used, and `opt_state` the stage's optimizer state (needed
    only to recompute the forward: at the weights its optimizer's backward hook gives,
    e.g. PipeMare's reconstruction, by default the current ones)."""
    entry = entry[:self._core_entry_sizes[k]]  # without the telemetry's extras
    if self.backward == "stash":
      vjp_fn = self._stash_residuals[k].vjp_fn(entry)
    else:
      x = jax.tree.unflatten(self._input_treedefs[k], entry)
      params = self.optimizers[k].backward(params, opt_state)
      _, vjp_fn, _ = self._vjp(k, params, model_state, x, rng)
    grad_params, grad_x, _ = vjp_fn(cotangent)
    return grad_params, grad_x

  def _key(self, stage_rng, batch):
    """`_stage_key`, and within an SPMD program over replicas, each replica's own key (its
    own dropout masks for its part of the batch)."""
    key = _stage_key(stage_rng, batch)
    if self._data_axis is not None:
      key = jax.random.fold_in(key, jax.lax.axis_index(self._data_axis))
    return key

  def _replica_mean(self, tree):
    """Within an SPMD program over replicas, the mean over the replicas of `tree`'s float
    leaves (gradients, BatchNorm statistics, loss and metrics); else `tree`. The other
    engines need none: their programs see the global batch, and jit inserts the
    all-reduce."""
    if self._data_axis is None:
      return tree
    mean = lambda a: (jax.lax.pmean(a, self._data_axis)
                      if jnp.issubdtype(a.dtype, jnp.inexact) else a)
    return jax.tree.map(mean, tree)

  def _update(self, k, params, opt_state, grads):
    grads = self._replica_mean(grads)
    updates, opt_state = self.optimizers[k].update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def _stage_work(self, k, s, act, cot, do_fwd, do_bwd):
    """Stage k < K-1 at one tick: optional delayed backward and update, then optional forward.

    `s` is the stage state with its core unpacked and its stash a `ring.RingView`. Returns
    (s, activation message (h, y, batch) or None, cotangent for stage k-1 or None, index of
    the batch whose gradient was applied or None). Under FDG the forward uses the
    parameters just updated; BP and DDG call the forward and the backward separately
    (forward first, with the parameters at the start of the tick). Traced flags mask the
    updates (a masked `updated` is NO_UPDATE).
    """
    D = self.ring_sizes[k]
    s = dict(s)
    params_fwd = s["params"]
    act_out = cot_out = updated = None
    if do_bwd is not False:
      slot = s["pops"] % D
      entry = s["stash"].read(slot)
      key = self._key(s["rng"], s["stash_batch"][slot])
      grads, grad_x = self._backward(k, s["params"], s["model_state"], s["opt_state"], entry,
                                     cot, key)
      params, opt_state = self._update(k, s["params"], s["opt_state"], grads)
      params, opt_state = _select(do_bwd, (params, opt_state), (s["params"], s["opt_state"]))
      updated = _select(do_bwd, s["stash_batch"][slot], NO_UPDATE)
      s.update(params=params, opt_state=opt_state, pops=s["pops"] + _count(do_bwd))
      if k > 0:
        cot_out = grad_x
      params_fwd = params  # a forward after the update in one call runs at the new weights
    if do_fwd is not False:
      if k == 0:
        (x, y), batch = act, s["pushes"]
      else:
        x, y, batch = act
      params_fwd, s["opt_state"] = self._forward_params(k, params_fwd, s["opt_state"], do_fwd)
      h, model_state, entry = self._forward(k, params_fwd, s["model_state"], x,
                                            self._key(s["rng"], batch))
      entry = entry + self._telemetry_extras(k, params_fwd, x, y)
      slot = s["pushes"] % D
      s["stash"] = s["stash"].write(slot, entry, do_fwd)
      s["stash_batch"] = s["stash_batch"].at[slot].set(
          _select(do_fwd, batch, s["stash_batch"][slot]))
      model_state = _select(do_fwd, self._replica_mean(model_state), s["model_state"])
      s.update(model_state=model_state, pushes=s["pushes"] + _count(do_fwd))
      act_out = (h, y, batch)
    return s, act_out, cot_out, updated

  def _stage_with_ring(self, k, s, act, cot, do_fwd, do_bwd, work=None):
    """`_stage_work` (or `work`, of the same signature) of stage k around its stash ring
    (`ring.with_ring`): the fused and per-stage engines' stage work."""
    work = self._stage_work if work is None else work
    return ring_lib.with_ring(functools.partial(work, k), s, act, cot, do_fwd, do_bwd,
                              size=self.ring_sizes[k], layout=self._ring_layouts[k],
                              head=self._has_head(k), read=functools.partial(self._ring_load, k),
                              write=functools.partial(self._ring_store, k))

  def _has_head(self, k: int) -> bool:
    """Whether stage k's ring keeps its head (`ring_heads`, rings of two slots or more)."""
    return self.ring_heads and self.ring_sizes[k] > 1

  def _ring_load(self, k, ring, slot):
    """The entry at `slot` of stage k's ring (`ring.load`)."""
    return ring_lib.load(self._ring_layouts[k], ring, slot)

  def _ring_store(self, k, ring, slot, entry, flag):
    """Stage k's `ring` with `entry` written at `slot` where `flag` (`ring.store`)."""
    return ring_lib.store(self._ring_layouts[k], ring, slot, entry, flag)

  def _last_work(self, s, act, active):
    """The last stage at one tick: forward, loss, gradient, update.

    Returns (s, cotangent for stage K-2 or None, metrics: loss, batch and `metrics_fn`'s).
    """
    K = self.num_stages
    stage = self.stages[K - 1]
    s = dict(s)
    if K == 1:
      (x, y), batch = act, s["pushes"]
    else:
      x, y, batch = act
    sub = self._key(s["rng"], batch)
    params_fwd, s["opt_state"] = self._forward_params(K - 1, s["params"], s["opt_state"], active)

    def loss(p, a):
      out, ms = stage.apply(p, s["model_state"], a, train=True, rng=sub)
      return self.loss_fn(out, y), (out, ms)

    argnums = (0, 1) if K > 1 else 0
    (value, (out, ms)), grads = jax.value_and_grad(loss, argnums, has_aux=True)(
        params_fwd, x)
    grads, grad_x = grads if K > 1 else (grads, None)
    params, opt_state = self._update(K - 1, s["params"], s["opt_state"], grads)
    new = _select(active, (params, opt_state, self._replica_mean(ms)),
                  (s["params"], s["opt_state"], s["model_state"]))
    s.update(zip(("params", "opt_state", "model_state"), new))
    s["pushes"] = s["pushes"] + _count(active)
    metrics = self._replica_mean({"loss": value, "batch": batch, **self.metrics_fn(out, y)})
    return s, grad_x, metrics

  # ------------------------------------------------------------------ a plan's micro-batches
  def _micro(self, tree, m):
    """Micro-batch m of a batch-major pytree (the plan's M equal parts)."""
    M = self.microbatches

    def cut(a):
      n = a.shape[0] // M
      return jax.lax.dynamic_slice_in_dim(a, m * n, n, axis=0)
    return jax.tree.map(cut, tree)

  def _micro_key(self, s, t, m):
    return jax.random.fold_in(jax.random.fold_in(s["rng"], t), m)

  def _micro_forward(self, k, s, x, t, m):
    """Stage k's training forward of micro-batch m, its gradient to be summed: (new model
    state, output, vjp function: the tick's stash entry)."""
    params, _ = self.optimizers[k].forward(s["params"], s["opt_state"])
    y, vjp_fn, ms = training_vjp(self.stages[k], params, s["model_state"], x,
                                 self._micro_key(s, t, m))
    return ms, y, vjp_fn

  def _micro_backward(self, vjp_fn, cot, acc):
    """A micro-batch's backward: (the stage's gradient sum with this one added, the
    cotangent of its input)."""
    g, gx, _ = vjp_fn(cot)
    return (g if acc is None else jax.tree.map(jnp.add, acc, g)), gx

  def _micro_last(self, s, x, y, t, m):
    """The last stage on micro-batch m: (new model state, its gradient, cotangent of x,
    loss, outputs). The loss is the micro-batch mean over M: the M of them sum to the
    batch's."""
    K, M = self.num_stages, self.microbatches
    stage = self.stages[K - 1]
    params, _ = self.optimizers[K - 1].forward(s["params"], s["opt_state"])

    def loss(p, a):
      out, ms = stage.apply(p, s["model_state"], a, train=True, rng=self._micro_key(s, t, m))
      return self.loss_fn(out, y) / M, (out, ms)

    (value, (out, ms)), grads = jax.value_and_grad(loss, (0, 1) if K > 1 else 0,
                                                   has_aux=True)(params, x)
    grads, gx = grads if K > 1 else (grads, None)
    return ms, grads, gx, value, out

  def _apply_sum(self, k, s, grads):
    """The update call: stage k applies the gradients it summed over the tick."""
    updates, opt_state = self.optimizers[k].update(grads, s["opt_state"], s["params"])
    return {**s, "params": optax.apply_updates(s["params"], updates), "opt_state": opt_state}

  def _tick(self, stages, inbox, batch, t, ops):
    """One tick: the plan's calls (`fdg_jax.plans`), in its order, run by the engine `ops`.

    Args:
      stages: the K stage states as `ops` takes them (packed per stage, or unpacked).
      inbox: the messages sent at tick t-1.
      batch: b_t = (x_t, y_t) on stage 0.
      t: the tick (host int, traced int, or None past the fill); see `_flags`.
      ops: `engines.PerStageOps`, `engines.FusedOps` or `engines.GatedOps`: how a stage's work is called, how messages move.
    Returns:
      (stages, inbox for tick t+1, updated (K entries: batch index, masked, or None),
       metrics of the batch that reached the loss ({} if none), whether one did).

    A message the plan reads in the same tick moves to its receiver at once (a call of
    the per-stage engine then leaves as soon as its input is there); the messages read at
    tick t+1 move together at the end of the tick, in one batched copy.
    """
    K, plan = self.num_stages, self.plan
    stages = list(stages)
    # unsent messages keep their placeholders (a plan that accumulates has no inbox)
    new_inbox = None if inbox is None else [dict(box) for box in inbox]
    updated: list = [None] * K
    metrics: dict = {}
    active = self._flags(K - 1, t)[0]
    ops.begin_tick()
    now = {"act": {}, "cot": {}}  # messages sent earlier in this tick, by (receiver, micro)
    outgoing = []  # (receiving stage, "act" | "cot", flag, message), read at tick t+1
    # A plan that accumulates: each stage's stash entries and gradient sum of this tick, the
    # last stage's losses and outputs, the labels where the last stage reads them.
    held, sums, losses, outs = {}, [None] * K, [], {}
    if plan.accumulates:
      tick = np.int32(t) if isinstance(t, int) else t
      firsts = {m: self._micro(batch[0], m) for m in range(self.microbatches)}
      labels = ops.move(K - 1, batch[1])

    def send(k, kind, flag, message, m=0):
      if plan.reads_now(k, kind):
        now[kind][(k, m)] = ops.move(k, message)
      else:
        outgoing.append((k, kind, flag, message))

    def source(k, kind, where, m=0):
      if where == "batch":
        return batch if not plan.accumulates else firsts.pop(m)
      return now[kind].pop((k, m)) if where == "now" else inbox[k][kind]

    # The engine may issue the calls that read only messages of tick t-1 in any order among
    # themselves; `engines.GatedOps` reverses them, so that each message of tick t-1 is read before
    # the one replacing it is made.
    for call, do_fwd, do_bwd in plan.issued(t, ops.old_messages_first):
      k, m = call.stage, call.micro
      if call.applies_sum:  # the update call: the stage applies the tick's gradient sum
        stages[k] = ops.apply_sum(k)(stages[k], sums[k])
        updated[k] = t
        continue
      if not call.update:  # micro-batch m's forward or backward, its gradient summed
        if k == K - 1:
          ms, g, gx, loss, out = ops.last_micro()(
              stages[k], source(k, "act", call.act, m), self._micro(labels, m), tick, m)
          stages[k] = {**stages[k], "model_state": ms}
          sums[k] = g if sums[k] is None else jax.tree.map(jnp.add, sums[k], g)
          losses.append(loss)
          outs[m] = out
          if k > 0:
            send(k - 1, "cot", True, gx, m)
        elif call.forward:
          ms, h, held[(k, m)] = ops.forward_micro(k)(
              stages[k], source(k, "act", call.act, m), tick, m)
          stages[k] = {**stages[k], "model_state": ms}
          send(k + 1, "act", True, h, m)
        else:
          sums[k], gx = ops.backward_micro(k)(held.pop((k, m)),
                                               source(k, "cot", call.cot, m), sums[k])
          if k > 0:
            send(k - 1, "cot", True, gx, m)
        continue
      if k == K - 1:
        stages[k], cot, metrics = ops.last(active)(stages[k], source(k, "act", call.act))
        updated[k] = _select(active, metrics["batch"], NO_UPDATE)
        if cot is not None:
          send(k - 1, "cot", active, cot)
        continue
      stages[k], act_out, cot_out, upd = ops.stage(k, do_fwd, do_bwd)(
          stages[k], source(k, "act", call.act) if do_fwd is not False else None,
          source(k, "cot", call.cot) if do_bwd is not False else None)
      if do_bwd is not False:
        updated[k] = upd
      if act_out is not None:
        send(k + 1, "act", do_fwd, act_out)
      if cot_out is not None:
        send(k - 1, "cot", do_bwd, cot_out)
    if outgoing:
      moved = ops.move_all([(k, m) for k, _, _, m in outgoing])
      for (k, kind, flag, _), m in zip(outgoing, moved):
        new_inbox[k][kind] = _select(flag, m, inbox[k][kind])
    if losses:  # the batch's loss: the sum of the micro-batch means; metrics on all of it
      out = jnp.concatenate([outs[m] for m in range(self.microbatches)])
      metrics = {"loss": sum(losses), **self.metrics_fn(out, labels)}
    return stages, new_inbox, updated, metrics, active

  # ------------------------------------------------------------------ packing
  def _unpack_stage(self, k, packed):
    if self.plan.accumulates:  # kept unpacked
      return dict(packed)
    s = dict(self._core_layouts[k].unpack(packed["core"]))
    if "stash" in packed:
      s["stash"] = packed["stash"]
    return s

  def _pack_stage(self, k, s):
    if self.plan.accumulates:
      return s
    s = dict(s)
    stash = s.pop("stash", None)
    out = {"core": self._core_layouts[k].pack(s)}
    if stash is not None:
      out["stash"] = stash
    return out

  def _core_spec(self, k):
    """ShapeDtypeStructs of stage k's unpacked core state."""
    lay = self._core_layouts[k]
    return lay.treedef.unflatten([jax.ShapeDtypeStruct(s, d)
                                  for s, d in zip(lay.shapes, lay.dtypes)])

  # ------------------------------------------------------------------ per-stage engine
  def _stage_fn(self, k: int, do_forward: bool, do_backward: bool):
    """Jitted `_stage_work` of stage k on its devices, over its packed state (donated).

    Signature: (packed state, activation message, cotangent) ->
               (packed state, activation message out, cotangent out, batch updated).
    """
    key = (k, do_forward, do_backward)
    if key in self._step_fns:
      return self._step_fns[key]

    def step(packed, heads, act, cot):
      s = self._unpack_stage(k, ring_lib.with_heads([packed], heads)[0])
      s, act_out, cot_out, updated = self._stage_with_ring(k, s, act, cot, do_forward,
                                                           do_backward)
      return self._pack_stage(k, s), act_out, cot_out, updated

    # Fixed output shardings: the state comes back exactly as it went in (so the next tick
    # hits the same compiled variant, also under a mesh, where propagation would otherwise
    # pick the stash's sharding), and messages leave sharded like the batch.
    P = self.placement
    out_shardings = (self._state_shardings(k),
                     self._act_shardings[k] if do_forward else None,
                     self._cot_shardings[k] if do_backward and k > 0 else None,
                     P.scalar_shardings[k] if do_backward else None)
    fn = engines.HeadsApart(self._jit(step, donate_argnums=0, out_shardings=out_shardings),
                     one_stage=True)
    self._step_fns[key] = fn
    return fn

  def _last_fn(self):
    """Jitted `_last_work` (always active) on the last stage's devices.

    Signature: (packed state, activation message) -> (packed state, cotangent out, metrics).
    """
    key = ("last",)
    if key in self._step_fns:
      return self._step_fns[key]
    K = self.num_stages

    def step(packed, act):
      s, cot, metrics = self._last_work(self._unpack_stage(K - 1, packed), act, True)
      return self._pack_stage(K - 1, s), cot, metrics

    P = self.placement
    out_shardings = (self._state_shardings(K - 1),
                     self._cot_shardings[K - 1] if K > 1 else None,
                     P.scalar_shardings[K - 1])
    fn = self._jit(step, donate_argnums=0, out_shardings=out_shardings)
    self._step_fns[key] = fn
    return fn

  def _jit(self, fn, **kwargs):
    """`jax.jit` for a program that runs ticks, with `self.compiler_options`."""
    if self.compiler_options:
      kwargs["compiler_options"] = self.compiler_options
    return jax.jit(fn, **kwargs)

  # ------------------------------------------------------------------ fused engine
  def _fused_fn(self, num_ticks: int | None):
    """Every stage in one jitted program on one device: one tick, or a loop of ticks.

    The warm-up flags are traced from the tick and mask the pipeline fill, so one program
    serves every tick (masking measured at 3-10% of a steady tick of the quick-start MLP on
    CPU, traded for not compiling a second, unmasked variant).
    One tick: (packed stages, inbox, (x, y), t) -> (packed stages, inbox, updated, metrics).
    Loop: (packed stages, inbox, xs, ys, t0, n) -> (packed stages, inbox, stacked metrics).
    """
    key = ("fused", num_ticks)
    if key in self._step_fns:
      return self._step_fns[key]
    K = self.num_stages
    ops = self._gated_ops if self.gate == "cond" else self._fused_ops

    def tick(stages, inbox, batch, t):
      return self._tick(stages, inbox, batch, t, ops)

    def unpack_all(packed):
      return [self._unpack_stage(k, p) for k, p in enumerate(packed)]

    def pack_all(stages):
      return [self._pack_stage(k, s) for k, s in enumerate(stages)]

    if num_ticks is None:
      def one(packed, heads, inbox, batch, t):
        stages = unpack_all(ring_lib.with_heads(packed, heads))
        stages, inbox, updated, metrics, _ = tick(stages, inbox, batch, t)
        return pack_all(stages), inbox, updated, metrics
      jitted = self._jit(one, donate_argnums=(0, 2))
    else:
      def many(packed, heads, inbox, xs, ys, t0, n):
        # A loop of n <= num_ticks iterations over the first n batches (n traced), so one
        # program serves every call with up to num_ticks ticks; metrics past n stay unset.
        spec = self._metrics_spec()
        outs = {name: jnp.zeros((num_ticks,) + a.shape, a.dtype) for name, a in spec.items()}
        outs["valid"] = jnp.zeros((num_ticks,), bool)
        outs["updated"] = jnp.full((num_ticks, K), NO_UPDATE, jnp.int32)

        def body(i, carry):
          stages, inbox, outs = carry
          batch = jax.tree.map(lambda a: a[i], (xs, ys))
          stages, inbox, updated, metrics, active = tick(stages, inbox, batch, t0 + i)
          row = {**metrics, "valid": jnp.asarray(active),
                 "updated": jnp.stack([jnp.int32(NO_UPDATE) if u is None else u
                                       for u in updated])}
          outs = {name: outs[name].at[i].set(row[name]) for name in outs}
          return stages, inbox, outs

        stages = unpack_all(ring_lib.with_heads(packed, heads))
        stages, inbox, outs = jax.lax.fori_loop(0, n, body, (stages, inbox, outs))
        return pack_all(stages), inbox, outs
      jitted = self._jit(many, donate_argnums=(0, 2))

    fn = engines.HeadsApart(jitted, one_stage=False)
    self._step_fns[key] = fn
    return fn

  # ------------------------------------------------------------------ init / allocation
  def init(self, params: Sequence[PyTree], model_state: Sequence[PyTree] | None = None, *,
           rng: jax.Array | None = None, example_batch=None) -> dict:
    """The schedule state at tick 0.

    Args:
      params: K per-stage parameter pytrees (copied onto each stage's devices).
      model_state: K per-stage model states (e.g. BatchNorm statistics), or None (all `{}`).
      rng: PRNG key for stochastic layers (default `PRNGKey(0)`).
      example_batch: an `(x, y)` batch of the training shape; allocates the stash and the
        message buffers now. Without it they are allocated at the first `step` or `run`.
    """
    K = self.num_stages
    params = list(params)
    if len(params) != K:
      raise ValueError(f"got {len(params)} parameter pytrees for {K} stages")
    model_state = [{}] * K if model_state is None else list(model_state)
    if len(model_state) != K:
      raise ValueError(f"got {len(model_state)} model states for {K} stages")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    if self.plan.accumulates:
      # Nothing is carried between ticks but each stage's parameters, model and optimizer
      # states and key, kept as they are (no counters, stash or inbox).
      del example_batch
      stages = [self.placement.put_state(k, {
          "params": params[k], "model_state": model_state[k],
          "opt_state": self.optimizers[k].init(params[k]), "rng": jax.random.fold_in(rng, k)})
          for k in range(K)]
      return {"tick": np.asarray(0, np.int64), "stages": stages}
    stages = []
    for k in range(K):
      s = {
          "params": params[k],
          "model_state": model_state[k],
          "opt_state": self.optimizers[k].init(params[k]),
          "rng": jax.random.fold_in(rng, k),
          "pushes": jnp.zeros((), jnp.int32),
          "pops": jnp.zeros((), jnp.int32),
      }
      if k < K - 1:
        s["stash_batch"] = jnp.zeros((self.ring_sizes[k],), jnp.int32)
      self._core_layouts[k] = layout = Layout.of(s)
      rep = self.placement.state_shardings[k]
      pack = jax.jit(layout.pack, out_shardings={name: rep for name in layout.names})
      stages.append({"core": pack(self.placement.put_state(k, s))})
    state = {"tick": np.asarray(0, np.int64), "stages": stages, "inbox": None}
    if example_batch is not None:
      state = self._allocate(state, self.placement.put_batch(0, tuple(example_batch)))
    return state

  def _prepare(self, batch):
    """Shapes, layouts and shardings of the stash entries and messages, for `batch`'s shapes.

    `batch` is the global batch (arrays or ShapeDtypeStructs). Under a mesh, a stash leaf is
    batch-major along the axis whose size follows the batch size (found by tracing the stage
    at the batch size and at twice it); such leaves are sharded along that axis.
    """
    if any(lay is None for lay in self._core_layouts):
      raise ValueError("this schedule has no state layout yet: call schedule.init(...) first "
                       "(also before restoring a checkpointed state into it)")
    K, P = self.num_stages, self.placement
    spec = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), t)
    doubled = lambda t: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((2 * a.shape[0],) + a.shape[1:], a.dtype)
        if a.shape else a, t)
    x_spec, y_spec = spec(batch[0]), spec(batch[1])
    if x_spec.shape[0] % P.num_replicas:
      raise ValueError(f"a batch of {x_spec.shape[0]} does not split evenly over the "
                       f"{P.num_replicas} data-parallel replicas; use a multiple of "
                       f"{P.num_replicas}")
    self._batch_spec = (x_spec, y_spec)
    self._entry_specs = [None] * K
    self._core_entry_sizes = [None] * K
    self._input_treedefs = [None] * K  # each stage's input message structure (`recompute`)
    self._act_specs, self._act_shardings, self._cot_shardings = ([None] * K for _ in range(3))
    has_conv = False

    a_spec, a_spec2 = x_spec, doubled(x_spec)
    for k in range(K):
      self._cot_shardings[k] = P.message_shardings(k, a_spec)
      s = self._core_spec(k)
      has_conv = has_conv or has_convolution(
          lambda p, ms, a, st=self.stages[k]: st.apply(p, ms, a, train=True,
                                                       rng=jax.random.PRNGKey(0)),
          s["params"], s["model_state"], a_spec)
      if k == K - 1:
        break
      self._input_treedefs[k] = jax.tree.structure(a_spec)
      entry, self._stash_residuals[k], h_spec = self._entry_and_output(k, a_spec)
      _check_message(k, h_spec)
      entry2, _, h_spec2 = self._entry_and_output(k, a_spec2)
      self._core_entry_sizes[k] = len(entry)
      entry = entry + self._telemetry_extras(k, s["params"], a_spec, y_spec)
      entry2 = entry2 + self._telemetry_extras(k, s["params"], a_spec2, y_spec)

      def batch_axis(e, e2):
        axis = next((i for i, (m, n) in enumerate(zip(e.shape, e2.shape)) if m != n), None)
        if axis is not None and e.shape[axis] % P.num_replicas:
          axis = None  # cannot be split evenly over the replicas: keep it replicated
        return axis

      self._stash_axes[k] = [batch_axis(e, e2) for e, e2 in zip(jax.tree.leaves(entry),
                                                                jax.tree.leaves(entry2))]
      self._entry_specs[k] = entry
      self._act_specs[k] = (h_spec, y_spec, jax.ShapeDtypeStruct((), jnp.int32))
      self._act_shardings[k] = P.message_shardings(k, self._act_specs[k])
      a_spec, a_spec2 = h_spec, h_spec2
    self._has_conv = has_conv
    self._flops = None
    self._ring_layouts = [None] * K
    if self._flat_rings_apply():
      # A one-slot ring (BP) stays per leaf: written whole, XLA forwards its entry to the
      # backward of the same program, where a packed one would be a copy of every residual.
      self._ring_layouts = [Layout.of(tuple(jax.tree.leaves(e)))
                            if e is not None and self.ring_sizes[k] > 1 else None
                            for k, e in enumerate(self._entry_specs)]
      if any(lay is not None and any(n.startswith("leaf") for n in lay.names)
             for lay in self._ring_layouts):
        self._ring_layouts = [None] * K  # typed PRNG keys in an entry: rings per leaf

  def _entry_and_output(self, k, a_spec):
    """Shapes of stage k's stash entry (without telemetry's extras), how the entry holds the
    vjp's residuals under `stash` (a `stages.Residuals`, else None) and the stage's output,
    for an input of shape `a_spec`."""
    s = self._core_spec(k)
    args = (s["params"], s["model_state"], a_spec, s["rng"])
    if self.backward == "stash":
      return Residuals.trace(self.stages[k], *args)
    h, _, _ = jax.eval_shape(lambda *z: self._vjp(k, *z), *args)
    return tuple(jax.tree.leaves(a_spec)), None, h

  def _flat_rings_apply(self) -> bool:
    """Whether the stash rings are kept as one flat buffer per dtype (slot after slot), so
    that a call carries a few buffers whatever the model: the fused and per-stage engines
    with one device per stage, without telemetry (which reads the rings per leaf), for
    rings of two slots or more (see `_prepare`). Under a (data, stage) mesh each leaf's ring
    is split along its own batch axis, so rings stay per leaf; the SPMD engine keeps its own
    padded vectors."""
    return (self.engine in ("fused", "per_stage") and self.placement.num_replicas == 1
            and not self.telemetry_enabled)

  def _stash_shardings(self, k: int):
    """Shardings of stage k's rings: activations split along their batch axis."""
    P = self.placement
    if self._ring_layouts[k] is not None:
      names = self._ring_layouts[k].names
      out = {part: {n: P.state_shardings[k] for n in names} for part in ("ring", "head")}
    else:
      axes = self._stash_axes[k]
      out = {"ring": tuple(P.buffer_sharding(k, None if ax is None else ax + 1)  # ring axis
                           for ax in axes),
             "head": tuple(P.buffer_sharding(k, ax) for ax in axes)}
    if not self._has_head(k):
      del out["head"]  # see `_stage_with_ring`
    return out

  def _state_shardings(self, k: int) -> dict:
    """The sharding of every buffer of stage k's packed state."""
    rep = self.placement.state_shardings[k]
    out = {"core": {name: rep for name in self._core_layouts[k].names}}
    if k < self.num_stages - 1:
      out["stash"] = self._stash_shardings(k)
    return out

  def _allocate(self, state, batch):
    """Adds zero-filled stash and message buffers sized for `batch` (global, on stage 0)."""
    K, P = self.num_stages, self.placement
    self._prepare(batch)
    stages, inbox = list(state["stages"]), [dict() for _ in range(K)]
    for k in range(K - 1):
      D = self.ring_sizes[k]
      lay = self._ring_layouts[k]
      if lay is not None:  # flat: D slots one after another per dtype, and the head
        specs = {"ring": {n: jax.ShapeDtypeStruct((D * m,), n) for n, m in lay.sizes.items()},
                 "head": {n: jax.ShapeDtypeStruct((m,), n) for n, m in lay.sizes.items()}}
      else:  # one [D, ...] buffer per leaf, and the head
        entry = jax.tree.leaves(self._entry_specs[k])
        specs = {"ring": tuple(jax.ShapeDtypeStruct((D,) + e.shape, e.dtype) for e in entry),
                 "head": tuple(entry)}
      if not self._has_head(k):
        del specs["head"]
      stages[k] = {**stages[k], "stash": _zeros(specs, self._stash_shardings(k))}
      # Placeholders for stage k's incoming cotangent and stage k+1's incoming activation,
      # where (and shaped as) the real messages will arrive.
      act_spec = self._act_specs[k]
      if self.plan.reads_inbox(k, "cot"):
        inbox[k]["cot"] = _zeros(act_spec[0], P.message_shardings(k, act_spec[0]))
      if self.plan.reads_inbox(k + 1, "act"):
        inbox[k + 1]["act"] = _zeros(act_spec, P.message_shardings(k + 1, act_spec))
    state = {**state, "stages": stages, "inbox": inbox}
    return self._spmd.flatten(state) if self.engine == "spmd" else state

  def _ready(self, state, batch_spec):
    """`state` with its buffers allocated, and this schedule prepared for its layout."""
    if self.plan.accumulates:  # nothing to allocate: no stash or inbox between ticks
      return state
    if state["inbox"] is None:
      return self._allocate(state, batch_spec)
    if self._batch_spec is None:  # a state restored into a fresh schedule
      self._prepare(batch_spec)
    return state

  # ------------------------------------------------------------------ ticks
  def step(self, state: dict, batch) -> tuple[dict, dict]:
    """Runs one tick: batch b_t = (x_t, y_t) enters the pipeline.

    Returns:
      (state, metrics). metrics has `tick`, `updated` (per stage: the index of the batch
      whose gradient the stage applied this tick, as a device scalar, or None if it did not
      update), and, once a batch reaches the loss, `loss`, `batch` (its index) and the
      `metrics_fn` values (default `accuracy`) of that batch.
    """
    K = self.num_stages
    if self.engine == "spmd":
      t = int(state["tick"])
      first = self._spmd.put_first(tuple(batch), leading=False)  # global: [1, B, ...]
      state = self._ready(state, jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), first))
      state, metrics = self._spmd.step(state, first)
      return {**state, "tick": np.asarray(t + 1, np.int64)}, {**metrics, "tick": t}
    if self.plan.accumulates:
      B = int(np.shape(jax.tree.leaves(batch[0])[0])[0])
      if B % self.microbatches:
        raise ValueError(f"a batch of {B} does not split into microbatches="
                         f"{self.microbatches} equal parts; use a batch size that "
                         f"{self.microbatches} divides")
    # In a multi-process run `batch` is this process's slice; batch_msg is the global batch.
    batch_msg = self.placement.put_batch(0, tuple(batch))
    state = self._ready(state, batch_msg)
    t = int(state["tick"])
    if self.engine == "fused":
      fn = self._fused_fn(None)
      stages, inbox, updated, metrics = fn(state["stages"], state.get("inbox"), batch_msg,
                                           np.int32(t))
      # A masked program computes every stage's work; keep what the tick really did.
      flags = [self._flags(k, t) for k in range(K)]
      updated = [u if f[1] else None for u, f in zip(updated, flags)]
      if not flags[K - 1][0]:
        metrics = {}
    else:
      stages, inbox, updated, metrics, _ = self._tick(
          state["stages"], state.get("inbox"), batch_msg, t, self._per_stage_ops)
    if self.plan.accumulates:  # every stage applies the tick's batch at the tick's end
      metrics = {**metrics, "batch": t, "tick": t, "updated": (t,) * K}
      return {"tick": np.asarray(t + 1, np.int64), "stages": stages}, metrics
    metrics = {**metrics, "tick": t, "updated": tuple(updated)}
    return {"tick": np.asarray(t + 1, np.int64), "stages": stages, "inbox": inbox}, metrics

  def run(self, state: dict, batches, num_ticks: int | None = None) -> tuple[dict, dict]:
    """Runs T ticks: `batches = (xs, ys)` with a leading ticks axis.

    Equals T calls of `step` (same state, same `updated` trace). The fused engine runs the
    ticks as one program (a device loop) where `scan` holds, else one program per tick; the
    per-stage engine dispatches them from the host.

    Args:
      state: the schedule state (donated).
      batches: (xs, ys), each with a leading axis of length L >= T.
      num_ticks: T, the ticks to run, over the first T batches (default L). The fused
        program is compiled per L, not per T: a caller whose calls vary in length (ending
        at evaluation or checkpoint steps) passes buffers of one length L and varies T.
    Returns:
      (state, metrics): per-tick metrics stacked along L. `tick` [L] (host ints; -1 past
      T); `updated` int32 [L, K], the batch whose gradient stage k applied at that tick or
      NO_UPDATE (-1); `valid` bool [L], whether a batch reached the loss at that tick
      (False past T); and `loss`, `batch` and the `metrics_fn` values [L], meaningful
      where `valid`.
    """
    xs, ys = batches
    length = int(np.shape(jax.tree.leaves(xs)[0])[0])
    T = length if num_ticks is None else int(num_ticks)
    if not 1 <= T <= length:
      raise ValueError(f"run needs 1 <= num_ticks <= {length} (the batches given), got {T}")
    t0 = int(state["tick"])
    first = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), (xs, ys))
    if self.plan.accumulates:  # one program per tick (what the synchronous pipelines ran)
      return self._run_by_steps(state, xs, ys, T, length)
    if self.engine == "fused":
      state = self._ready(state, first)
      if self.scan:
        device = self.placement.single_device
        xs, ys = jax.device_put((xs, ys), device)
        fn = self._fused_fn(length)
        stages, inbox, out = fn(state["stages"], state["inbox"], xs, ys, np.int32(t0),
                                np.int32(T))
        out["tick"] = _ticks(t0, T, length)
        return {"tick": np.asarray(t0 + T, np.int64), "stages": stages, "inbox": inbox}, out
    if self.engine == "spmd":
      placed = self._spmd.put_first((xs, ys))  # global: in several processes, each its rows
      state = self._ready(state, jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), placed))
      state, out = self._spmd.run(state, placed, T, length)
      out["tick"] = _ticks(t0, T, length)
      return {**state, "tick": np.asarray(t0 + T, np.int64)}, out
    return self._run_by_steps(state, xs, ys, T, length)

  def _run_by_steps(self, state, xs, ys, T, length):
    """`run` as T calls of `step`, the metrics stacked on the last stage's devices."""
    K, P = self.num_stages, self.placement
    t0 = int(state["tick"])
    per_tick = []
    for batch in _unstack((xs, ys), T):
      state, m = self.step(state, batch)
      per_tick.append(m)
    per_tick += [{"updated": (None,) * K}] * (length - T)  # unset entries past T
    spec = self._metrics_spec(per_tick[0])
    fills = {name: self._constant(K - 1, 0, leaf.dtype) for name, leaf in spec.items()}
    out = _stack_jit({name: [m.get(name, fill) for m in per_tick]
                      for name, fill in fills.items()})
    columns = []
    for k in range(K):
      none = self._constant(k, NO_UPDATE, jnp.int32)
      columns.append(_stack_jit([none if m["updated"][k] is None else m["updated"][k]
                                 for m in per_tick]))
    columns = P.put_replicated(K - 1, columns)
    out["updated"] = _stack_jit(columns, axis=1)
    out["valid"] = np.asarray(["loss" in m for m in per_tick])
    out["tick"] = _ticks(t0, T, length)
    return state, out

  def _metrics_spec(self, first: dict | None = None) -> dict:
    """Shapes of the last stage's metrics (loss, batch, metrics_fn's); for a plan that
    accumulates, those of `first`, a tick's metrics (every tick has them)."""
    if self.plan.accumulates:
      return {n: jax.ShapeDtypeStruct(np.shape(v), jnp.asarray(v).dtype)
              for n, v in first.items() if n not in ("tick", "updated")}
    if self._metrics_shapes is None:
      K = self.num_stages
      act = self._batch_spec if K == 1 else self._act_specs[K - 2]
      self._metrics_shapes = jax.eval_shape(lambda s, a: self._last_work(s, a, True)[2],
                                            self._core_spec(K - 1), act)
    return self._metrics_shapes

  def _constant(self, k: int, value, dtype):
    """A cached device scalar on stage k's devices (fills ticks with no value)."""
    key = (k, value, jnp.dtype(dtype).name)
    if key not in self._constants:
      self._constants[key] = jax.device_put(np.asarray(value, dtype),
                                            self.placement.scalar_shardings[k])
    return self._constants[key]

  # ------------------------------------------------------------------ accessors
  def stage_state(self, state, k: int) -> dict:
    """Stage k's state unpacked: params, model_state, opt_state, rng, pushes, pops and (but
    for the last stage) stash_batch. The stash: `stash`."""
    if self.plan.accumulates:
      return state["stages"][k]
    if k not in self._unpack_fns:
      self._unpack_fns[k] = jax.jit(self._core_layouts[k].unpack)
    return self._unpack_fns[k](self._core(state, k))

  def stash(self, state, k: int) -> tuple:
    """Stage k's stash ring: one [D_k, ...] buffer per leaf of an entry (() for the last,
    and for a plan that accumulates, whose stash lives within the tick)."""
    if self.plan.accumulates:
      return ()
    stash = self._packed_stage(state, k).get("stash")
    if stash is None:
      return ()
    ring, lay = stash["ring"], self._ring_layouts[k]
    if lay is None:
      return tuple(ring)
    if ("stash", k) not in self._unpack_fns:
      D = self.ring_sizes[k]
      self._unpack_fns["stash", k] = jax.jit(lambda r: tuple(lay.unpack_slots(r, D)))
    return self._unpack_fns["stash", k](ring)

  def _packed_stage(self, state, k: int) -> dict:
    """Stage k's packed state ({"core": ..., "stash": ...}), whatever the engine's layout."""
    s = state["stages"][k]
    return self._spmd.unflatten(state, k)[0] if "flat" in s else s

  def _core(self, state, k: int) -> dict:
    """Stage k's packed core buffers (no copy of the stash under any engine); a plan that
    accumulates: its unpacked state."""
    s = state["stages"][k]
    if self.plan.accumulates:
      return s
    return self._spmd.core(state, k) if "flat" in s else s["core"]

  def params(self, state) -> list:
    """The K per-stage parameter pytrees."""
    return [self.stage_state(state, k)["params"] for k in range(self.num_stages)]

  def model_states(self, state) -> list:
    """The K per-stage model states (e.g. BatchNorm running statistics)."""
    return [self.stage_state(state, k)["model_state"] for k in range(self.num_stages)]

  def evaluate(self, state, x):
    """Synchronous eval-mode forward of `x` through all stages with the current parameters.

    Returns the last stage's output (on the last stage's devices).
    """
    x = self.placement.put_batch(0, x)
    for k in range(self.num_stages):
      core = self._core(state, k)
      if k not in self._eval_fns:
        def fwd(core, a, k=k):
          s = core if self.plan.accumulates else self._core_layouts[k].unpack(core)
          return self.stages[k].apply(s["params"], s["model_state"], a, train=False)[0]
        self._eval_fns[k] = jax.jit(fwd)
      x = self._eval_fns[k](core, x)
      if k + 1 < self.num_stages:
        x = self.placement.put_batch(k + 1, x)
    return x

  def stash_bytes(self, state) -> list[int]:
    """Bytes held by each stage's delay buffer: its stash ring, the ring's head where it keeps
    one (`ring_heads`, `delays.slots_held`), and its batch indices."""
    out = []
    if self.plan.accumulates:  # the stash lives within the tick
      return [0] * self.num_stages
    for k, s in enumerate(state["stages"]):
      if "flat" in s:  # the SPMD engine: every stage holds a ring padded to the largest
        ring = self._spmd.ring_bytes()
        out.append(int(ring + (4 * self.ring_sizes[k] if k < self.num_stages - 1 else 0)))
        continue
      ring = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(s.get("stash", {})))
      out.append(int(ring + (4 * self.ring_sizes[k] if k < self.num_stages - 1 else 0)))
    return out


def _unstack(tree, num: int) -> list:
  """The first `num` entries along the leading axis: free for host arrays, one call for
  device arrays (indexing them one by one would be a dispatch per entry and leaf)."""
  if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(tree)):
    return [jax.tree.map(lambda a: a[i], tree) for i in range(num)]
  return _unstack_jit(tree, num)


@functools.partial(jax.jit, static_argnums=1)
def _unstack_jit(tree, num):
  return [jax.tree.map(lambda a: a[i], tree) for i in range(num)]


@functools.partial(jax.jit, static_argnames="axis")
def _stack_jit(tree_of_lists, axis=0):
  """`jnp.stack` of every list in the pytree, as one call (not one dispatch per entry)."""
  return jax.tree.map(lambda xs: jnp.stack(xs, axis), tree_of_lists,
                      is_leaf=lambda x: isinstance(x, list))


def _ticks(t0: int, num_ticks: int, length: int) -> np.ndarray:
  """run's `tick` metric: t0 .. t0+num_ticks-1, then -1 up to `length`."""
  return np.where(np.arange(length) < num_ticks, t0 + np.arange(length), -1)


def _zeros(spec, sharding):
  """Zero arrays of the given ShapeDtypeStruct pytree, created directly on `sharding`.

  `sharding` is one sharding for every leaf or a pytree of them matching `spec`. In a
  multi-process run they are made by one jitted call: a host value put on devices of
  several processes costs a cross-process check per array.
  """
  if isinstance(sharding, jax.sharding.Sharding):
    sharding = jax.tree.map(lambda _: sharding, spec)
  if jax.process_count() > 1:
    make = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)
    return jax.jit(make, out_shardings=sharding)()
  return jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), spec, sharding)


def bp(stages, loss_fn, optimizer, **kwargs) -> Schedule:
  """Backpropagation over K stages: every tick, forward, loss and backward of b_t.

  Keyword arguments: `devices`, `mesh`, `metrics_fn`, `engine`, `scan` (see `Schedule`).
  """
  return Schedule("bp", stages, loss_fn, optimizer, **kwargs)


def ddg(stages, loss_fn, optimizer, *, backward="stash", **kwargs) -> Schedule:
  """Decoupled parallel backprop (Huo et al. 2018): backward unlocked, delay K-1-k."""
  return Schedule("ddg", stages, loss_fn, optimizer, backward=backward, **kwargs)


def fdg(stages, loss_fn, optimizer, *, beta=1.0, backward="stash", **kwargs) -> Schedule:
  """Fully decoupled training (Zhuang et al. 2021): all locks broken, delay 2(K-1-k).

  `beta` in (0, 1] shrinks stage k's gradient by beta**(K-1-k) (see `fdg_jax.shrink`);
  `shrink_at="update"` scales stage k's update by that factor instead (a per-stage
  learning-rate scale: the form shrinking takes for Adam-like optimisers, which ignore a
  constant scale of the gradient).
  """
  return Schedule("fdg", stages, loss_fn, optimizer, beta=beta, backward=backward, **kwargs)


# The value of each schedule option that means "not used" (plans.OPTIONS).
_OPTION_OFF = {"beta": 1.0, "shrink_at": "gradient", "backward": "stash", "microbatches": 1}
_OPTION_WHAT = {"beta": "gradient shrinking", "shrink_at": "where beta applies",
                "backward": "the stash policy", "microbatches": "splitting the batch"}


def create(algorithm: str, stages, loss_fn, optimizer, **kwargs):
  """A registered schedule by name (`fdg_jax.plans.names()`: bp, ddg, fdg, gpipe, 1f1b and
  any registered with `fdg_jax.plans.register`). Each takes the options its spec lists
  (beta and shrink_at: fdg; backward: ddg and fdg; microbatches: gpipe and 1f1b, which
  return a `Schedule` of their plan for `microbatches`=M)."""
  if algorithm not in plans_lib.names():
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of "
                     f"{', '.join(plans_lib.names())} (or register one: "
                     "fdg_jax.plans.register)")
  sp = plans_lib.spec(algorithm)
  for option in plans_lib.OPTIONS:
    if (option in kwargs and option not in sp.options
        and kwargs[option] != _OPTION_OFF[option]):
      takers = [n for n in plans_lib.names() if option in plans_lib.spec(n).options]
      raise ValueError(f"{option} is an option of {' and '.join(takers)} "
                       f"({_OPTION_WHAT[option]}); {algorithm} takes none")
  if not sp.microbatched and kwargs.get("microbatches", 1) == 1:
    kwargs.pop("microbatches", None)
  return Schedule(algorithm, stages, loss_fn, optimizer, **kwargs)
