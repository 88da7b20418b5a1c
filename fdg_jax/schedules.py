"""A schedule: a plan of ticks over K stages, run by an engine (the library's facade).

`Schedule` is what users hold: `init`, `step` (one tick), `run` (T ticks in one call),
`params`, `model_states`, `stage_state`, `stash`, `evaluate`, `stash_bytes`, `telemetry`.
It wires the pieces, each in its own module:

- the plan (`fdg_jax.plans`): the calls of a tick, by a registered name or given as a value;
  BP, DDG, FDG, GPipe and 1F1B are plans, and everything that depends on a schedule's name
  is read from the registry there;
- the per-stage maths (`stage_math.StageMath`): what a stage computes when a call reaches it,
  the pure functions every engine runs, and each stage's optimizer (`stage_optimizers`);
- the interpreter (`interpreter.run_tick`): the one tick body, the plan's calls in order;
- the state's layout (`shapes.Shapes`): each stage's core packed into a few flat buffers per
  dtype, its stash ring, the inbox of messages sent at tick t-1 and read at t+1;
- an engine (`fdg_jax.engines`): fused (every stage in one program on one device), per-stage
  (a device per stage, or a (data, stage) mesh) or SPMD (the ticks as one program over the
  devices); each says what it refuses, and "auto" picks by the placement (`engines.choose`);
- the platform's tuning (`fdg_jax.tuning`): compiler options, scan, gate.

Each stage k has its own state::

    params, model_state, opt_state, rng,
    stash:        the ring buffer of delayed-backward entries, D_k slots (D_k = 1 for BP,
                  K-k for DDG, 2(K-1-k) for FDG; the last stage has none),
    stash_batch:  int32[D_k], which batch each slot belongs to,
    pushes, pops: int32 counters; the next slot written is pushes % D_k, read pops % D_k.

A stash entry is, under `backward="stash"`, the residuals of `jax.vjp` of the stage's forward
(so the delayed backward is exactly the gradient at the weights that forward used), and
under `backward="recompute"` only the stage input and its RNG key (the backward re-runs the
vjp with the current weights). A plan that accumulates (GPipe, 1F1B) carries nothing between
ticks but each stage's params, model and optimizer states and key.

Whether a stage forwards or backwards at tick t (warm-up) is known from t: on the host the
flags are Python booleans and select a compiled variant; inside a program whose ticks may
lie in the pipeline fill they are traced, so one program serves every tick and steady ticks
never retrace.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fdg_jax import engines, tuning
from fdg_jax import plans as plans_lib
from fdg_jax.delays import ring_heads_default
from fdg_jax.placement import Placement
from fdg_jax.shapes import Shapes
from fdg_jax.stage_math import StageMath, classification_metrics, stage_optimizers
from fdg_jax.stages import Stage
from fdg_jax.telemetry import Telemetry
from fdg_jax.tuning import COND_GATE_MAX_FLOPS, compiler_options_for  # noqa: F401 (public)

PyTree = Any
ALGORITHMS = plans_lib.names(microbatched=False)  # the built-in tick plans (bp, ddg, fdg)
BACKWARD_POLICIES = ("stash", "recompute")
SHRINK_AT = ("gradient", "update")  # where FDG's beta scales stage k: its gradient or update
GATES = ("mask", "cond")
__all__ = ["ALGORITHMS", "Schedule", "bp", "classification_metrics", "create", "ddg", "fdg"]


class Schedule(Telemetry):
  """A decoupled-training schedule over K stages. Build with `bp`, `ddg`, `fdg` or `create`.

  Public methods: `init`, `step` (one tick), `run` (T ticks in one call), `params`,
  `model_states`, `stage_state`, `stash`, `evaluate`, `stash_bytes`. `engine`: "auto"
  (fused on one device, else per-stage), "fused", "per_stage" or "spmd" (see
  `fdg_jax.engines`). `compiler_options`: XLA options of the programs that run ticks (None:
  the platform's measured default, `tuning.compiler_options_for`; {}: XLA's own defaults).
  `ring_heads`: whether each stash ring of two slots or more keeps its head (see
  `ring.with_ring`; None: where XLA is not known to update the rings in place without one,
  that is, except on CPU with the default compiler options). `gate`: how the fused engine's
  programs gate a stage's work during the pipeline fill, "mask" or "cond" (None: the
  measured default of the platform and model, `tuning.default_gate`). `microbatches`: M for
  a plan that splits the batch (GPipe, 1F1B). The state is a pytree of device arrays plus a
  host integer `tick`; `step` and `run` consume (donate) the state they are given, so always
  continue from the state they return.
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
    if engine != "auto" and engine not in engines.CLASSES:
      raise ValueError(f"unknown engine {engine!r}; choose one of "
                       f"{('auto',) + engines.names()}")
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
    self.plan = _plan(algorithm, len(stages), microbatches)
    if self.plan.num_stages != len(stages):
      raise ValueError(f"the plan {self.plan.name!r} is for {self.plan.num_stages} stages, "
                       f"got {len(stages)}")
    self.algorithm = self.plan.name
    self.microbatches = self.plan.microbatches
    self.plan.kind.check_options(self.algorithm, beta=beta, backward=backward,
                                 telemetry=telemetry, shrink_at=shrink_at, mesh=mesh)
    self.stages = stages
    self.num_stages = len(stages)
    self.loss_fn = loss_fn
    self.beta = float(beta)
    self.shrink_at = shrink_at
    self.backward = backward
    self.telemetry_enabled = bool(telemetry)
    self.placement = Placement.create(self.num_stages, devices=devices, mesh=mesh)
    self.optimizers = stage_optimizers(optimizer, self.delays, self.beta, shrink_at)
    self.engine = engines.choose(engine, self.placement)
    engine_class = engines.CLASSES[self.engine]
    why = engine_class.refusal(self.plan, self.placement, telemetry=self.telemetry_enabled)
    if why:
      raise ValueError(why)
    self._scan, self._gate = scan, gate
    self.compiler_options = (compiler_options_for(self.platform) if compiler_options is None
                             else dict(compiler_options))
    if ring_heads is None:  # the default options of this platform, or a head
      ring_heads = (ring_heads_default(self.platform)
                    or self.compiler_options != compiler_options_for(self.platform))
    self.ring_heads = bool(ring_heads)
    self.shapes = Shapes(self.plan, stages, self.placement, backward=backward,
                         flat_rings=engine_class.flat_rings and not telemetry,
                         ring_heads=self.ring_heads)
    self.math = StageMath(self.plan, stages, loss_fn, self.optimizers, metrics_fn, backward,
                          self.telemetry_enabled, self.shapes)
    self.metrics_fn = self.math.metrics_fn
    self._flops = None  # `forward_flops`
    self._metrics_shapes = None
    self._eval_fns: dict = {}
    self._unpack_fns: dict = {}
    self._constants: dict = {}
    self._telemetry_fns: dict = {}
    self.engine_impl = engine_class(self)

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
  def platform(self) -> str:
    """The platform of the stages' devices ("cpu", "gpu", "tpu")."""
    return next(iter(self.placement.state_shardings[0].device_set)).platform

  @property
  def scan(self) -> bool:
    """Whether the fused `run` loops over its ticks on the device (`tuning.default_scan`)."""
    if self._scan is not None:
      return bool(self._scan)
    return tuning.default_scan(self.platform, self.shapes.has_conv)

  @property
  def gate(self) -> str:
    """How the fused engine gates a stage's work on traced flags, "mask" or "cond"
    (`tuning.default_gate`)."""
    if self._gate is not None:
      return self._gate
    return tuning.default_gate(self.platform, self.plan, self.backward, self.shapes.has_conv,
                               self.forward_flops)

  def forward_flops(self) -> list[float]:
    """Each stage's training forward's FLOPs at the prepared batch shapes
    (`tuning.forward_flops`)."""
    if self._flops is None:
      self._flops = tuning.forward_flops(self.stages, self.shapes)
    return self._flops

  def jit(self, fn, **kwargs):
    """`jax.jit` for a program that runs ticks, with `compiler_options`."""
    if self.compiler_options:
      kwargs["compiler_options"] = self.compiler_options
    return jax.jit(fn, **kwargs)

  # ------------------------------------------------------------------ state
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
    state = self.shapes.init_state(params, model_state, rng, self.optimizers)
    if example_batch is not None and self.plan.kind.ready_at_init:
      state = self.ready(state, self.placement.put_batch(0, tuple(example_batch)))
    return state

  def ready(self, state, batch_spec) -> dict:
    """`state` with its buffers allocated (in the engine's layout), and this schedule
    prepared for its shapes. `batch_spec`: the global batch (arrays or ShapeDtypeStructs)."""
    return self.plan.kind.ready(self, state, batch_spec)

  # ------------------------------------------------------------------ ticks
  def step(self, state: dict, batch) -> tuple[dict, dict]:
    """Runs one tick: batch b_t = (x_t, y_t) enters the pipeline.

    Returns:
      (state, metrics). metrics has `tick`, `updated` (per stage: the index of the batch
      whose gradient the stage applied this tick, as a device scalar, or None if it did not
      update), and, once a batch reaches the loss, `loss`, `batch` (its index) and the
      `metrics_fn` values (default `accuracy`) of that batch.
    """
    self.plan.kind.check_batch_size(self.plan, int(np.shape(jax.tree.leaves(batch[0])[0])[0]))
    return self.engine_impl.step(state, batch)

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
    self.plan.kind.check_batch_size(self.plan, int(np.shape(jax.tree.leaves(xs)[0])[1]))
    return self.engine_impl.run(state, xs, ys, T, length)

  def metrics_spec(self, first: dict | None = None) -> dict:
    """Shapes of the last stage's metrics (loss, batch, metrics_fn's); for a plan that
    accumulates, those of `first`, a tick's metrics (every tick has them)."""
    return self.plan.kind.metrics_spec(self, first)

  def constant(self, k: int, value, dtype):
    """A cached device scalar on stage k's devices (fills ticks with no value)."""
    key = (k, value, jnp.dtype(dtype).name)
    if key not in self._constants:
      self._constants[key] = jax.device_put(np.asarray(value, dtype),
                                            self.placement.scalar_shardings[k])
    return self._constants[key]

  # ------------------------------------------------------------------ accessors
  def stage_state(self, state, k: int) -> dict:
    """Stage k's state unpacked: params, model_state, opt_state, rng, pushes, pops and (but
    for the last stage) stash_batch (a plan that accumulates: params, model_state,
    opt_state, rng). The stash: `stash`."""
    if not self.plan.kind.carries_stash:  # its state is kept unpacked
      return state["stages"][k]
    if k not in self._unpack_fns:
      self._unpack_fns[k] = jax.jit(self.shapes.core_layouts[k].unpack)
    return self._unpack_fns[k](self.engine_impl.core(state, k))

  def stash(self, state, k: int) -> tuple:
    """Stage k's stash ring: one [D_k, ...] buffer per leaf of an entry (() for the last,
    and for a plan that accumulates, whose stash lives within the tick)."""
    if not self.plan.kind.carries_stash:
      return ()
    stash = self.engine_impl.packed_stage(state, k).get("stash")
    if stash is None:
      return ()
    ring, lay = stash["ring"], self.shapes.ring_layouts[k]
    if lay is None:
      return tuple(ring)
    if ("stash", k) not in self._unpack_fns:
      D = self.ring_sizes[k]
      self._unpack_fns["stash", k] = jax.jit(lambda r: tuple(lay.unpack_slots(r, D)))
    return self._unpack_fns["stash", k](ring)

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
      core = self.engine_impl.core(state, k)
      if k not in self._eval_fns:
        def fwd(core, a, k=k):
          s = self.plan.kind.view(self.shapes.core_layouts[k], core)
          return self.stages[k].apply(s["params"], s["model_state"], a, train=False)[0]
        self._eval_fns[k] = jax.jit(fwd)
      x = self._eval_fns[k](core, x)
      if k + 1 < self.num_stages:
        x = self.placement.put_batch(k + 1, x)
    return x

  def stash_bytes(self, state) -> list[int]:
    """Bytes held by each stage's delay buffer: its stash ring, the ring's head where it keeps
    one (`ring_heads`, `delays.slots_held`), and its batch indices."""
    K = self.num_stages
    if not self.plan.kind.carries_stash:  # the stash lives within the tick
      return [0] * K
    return [int(self.engine_impl.stash_bytes(state, k) + (4 * self.ring_sizes[k] if k < K - 1
                                                          else 0)) for k in range(K)]


def _plan(algorithm, num_stages: int, microbatches):
  """The plan of a registered schedule's name (with its micro-batches), or the plan given."""
  if not isinstance(algorithm, str):
    if not isinstance(algorithm, plans_lib.Plan):
      raise TypeError(f"algorithm must be a registered schedule's name or a plans.Plan, got "
                      f"{type(algorithm).__name__}")
    return algorithm
  sp = plans_lib.spec(algorithm)
  if microbatches is not None and not sp.microbatched:
    raise ValueError(f"microbatches is an option of "
                     f"{' and '.join(plans_lib.names(microbatched=True))}; {algorithm} splits "
                     "no batch")
  if sp.microbatched and microbatches is None:
    raise ValueError(f"{algorithm} needs microbatches=M (the parts of each batch)")
  if sp.microbatched and int(microbatches) < 1:
    raise ValueError(f"microbatches must be >= 1, got {microbatches}")
  options = {"microbatches": int(microbatches)} if sp.microbatched else {}
  return plans_lib.plan(algorithm, num_stages, **options)


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
  return a `Schedule` of their plan for `microbatches=M`)."""
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
