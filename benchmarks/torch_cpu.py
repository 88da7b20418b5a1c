"""CPU time per batch: fdg_jax against PyTorch, side by side (ResNet-20, the small GPTs).

    python benchmarks/torch_cpu.py                     # ResNet-20, ~7 min on 2 cores
    python benchmarks/torch_cpu.py --xla_flags "--xla_cpu_use_onednn=true" --repeats 5
    python benchmarks/torch_cpu.py --bp_only --variants "" "xla_cpu_use_xnnpack=true"
    python benchmarks/torch_cpu.py --models gpt gpt_w64 --repeats 5 \
        --out docs/results/torch_cpu_gpt.json            # the GPTs, ~15 min on 2 cores
    python benchmarks/torch_cpu.py --models gpt --trace /tmp/gpt_trace   # + profiles
    python benchmarks/torch_cpu.py --device gpu --models gpt --no_checks   # on one GPU

PyTorch is not a dependency of fdg_jax: without it installed this prints how to install it
(`pip install torch`, a CPU build is enough) and times fdg_jax alone.

The workloads (--models, one or several; the repeats alternate over all of them):
- resnet20: ResNet-20 (option-A shortcuts, as `fdg_jax.models.create("resnet20")`), batch
  --batch_size (default 128) of 32x32x3 images, SGD lr 0.1, momentum 0.9, weight decay 5e-4,
  cross-entropy;
- gpt: `configs/lm.py`'s model and batch: fdg_jax's decoder-only GPT (`models.transformer`:
  a token embedding plus a learned position table, 4 causal pre-norm layers of width 128
  with 4 heads (LayerNorm eps 1e-6, attention projections with biases, a tanh-GELU MLP of
  4x width), a final LayerNorm and an untied head; no dropout), byte vocabulary 256,
  sequences of 128 tokens, batch 32, Adam lr 1e-3 (b1 0.9, b2 0.999, eps 1e-8, no weight
  decay: the config's optimizer at a constant rate), next-token cross-entropy over every
  token;
- gpt_w64: the same at the delay-robustness study's shape (`benchmarks/delay_robust.py`'s
  GPT part): width 64, 6 layers of 4 heads, sequences of 64 tokens, batch 32.
The contenders on each:
- torch BP: the same network written here in torch.nn (ResNet-20 NCHW; the GPT with one
  fused q/k/v Linear, as many parameters as Flax's three, and `F.scaled_dot_product_attention`,
  causal), one training step per batch, torch's default threads;
- torch FDG K=4 (threads): that network split into 4 stages, trained by FDG in the style of
  the paper's official code (`torch_fdg.py`: one Python thread per stage each tick, joined at
  its end; weight stashing; stage k's gradients 2(K-1-k) ticks stale; one optimizer per
  stage), one batch per tick, torch's default intra-op threads; its warm-up is at least the
  pipeline's fill plus one tick (7). ResNet-20 is split by layer count; the GPTs at
  `fdg_jax.partition`'s boundaries (--gpt_split, default uniform), the same as fdg_jax's;
- fdg_jax BP K=1 and FDG K=4 (ResNet-20: balanced split; the GPTs: --gpt_split): the
  trainer's path, the fused engine through `run` on one CPU device, --ticks_per_call ticks
  per call.
Each measurement is a fresh process (so they do not share threads or caches); the repeats
alternate between the contenders. Each timed window also records the other processes' load
on the machine (its busy CPU time from /proc/stat less the process's own, per second: in
cores); one during which they kept more than --max_others cores busy is measured again, up
to --retries times (on shared cores torch's OpenMP threads slow down by up to 10x when a
core is taken, XLA's far less). Prints seconds per batch, median [min, max], the ratio of
each figure to torch BP's and the side-by-side ratios fdg_jax BP / torch BP and fdg_jax FDG
K=4 / torch FDG K=4 (of the medians, and their range over the repeats, each repeat's pair
timed one after the other); writes --out (JSON).

--device gpu times every contender on the machine's first GPU instead (torch on "cuda",
synchronised before each window closes; fdg_jax on JAX's default backend; both with TF32
matmuls, JAX's default for float32 on GPUs: torch's set_float32_matmul_precision("high")).

Before timing a GPT, a checks process asserts: the torch and Flax parameter counts are
equal; with Flax's parameters copied into the torch GPT, both give the same losses over three
BP steps with Adam (the same function and the same update); torch FDG at K=1 equals torch
BP; torch FDG K=4's schedule (stage k first updates at tick K-1+(K-1-k), holds 2(K-1-k)
stashed forwards). --trace DIR profiles one process of each GPT contender instead of timing
it: fdg_jax's under JAX's profiler (XLA:CPU worker threads' time by thunk kind, grouped into
matmuls, attention softmax, layout copies and the rest, against the step's wall time),
torch's under torch.profiler (self CPU time by operator).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = 256  # the byte corpus's vocabulary (`fdg_jax.data.text.VOCAB_SIZE`; jax-free here)


# ------------------------------------------------------------------------------ workloads
def lm_config():
  """configs/lm.py's config, loaded from its file (ml_collections only, no jax)."""
  path = ROOT / "configs" / "lm.py"
  spec = importlib.util.spec_from_file_location("_fdg_config_lm", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def gpt_shape(name: str) -> tuple[dict, int]:
  """(the `fdg_jax.models.gpt` arguments, the batch size) of a GPT workload: "gpt" is
  configs/lm.py's model and batch, "gpt_w64" the delay-robustness study's shape
  (`delay_robust.workload("gpt")`: width 64, 6 layers of 4 heads, 64 tokens, batch 32)."""
  c = lm_config()
  if name == "gpt":
    kwargs = dict(c.model_kwargs)
    assert kwargs["seq_len"] == c.seq_len, (kwargs, c.seq_len)
    return {"num_classes": VOCAB, **kwargs}, int(c.batch_size)
  if name == "gpt_w64":
    return {"num_classes": VOCAB, "seq_len": 64, "dim": 64, "depth": 6, "num_heads": 4}, 32
  raise ValueError(f"unknown GPT workload {name!r}")


MODELS = ("resnet20", "gpt", "gpt_w64")


def torch_resnet20():
  """ResNet-20 with option-A shortcuts in torch.nn (NCHW): one nn.Sequential of 15 children,
  the stem's conv, BatchNorm and ReLU, the nine residual blocks, then pooling, flatten and the
  linear head."""
  import torch.nn as nn
  import torch.nn.functional as F

  class Block(nn.Module):
    def __init__(self, c_in, c_out, stride):
      super().__init__()
      self.c1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
      self.b1 = nn.BatchNorm2d(c_out)
      self.c2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
      self.b2 = nn.BatchNorm2d(c_out)
      self.stride, self.pad = stride, c_out - c_in

    def forward(self, x):
      y = F.relu(self.b1(self.c1(x)))
      y = self.b2(self.c2(y))
      s = x
      if self.stride != 1 or self.pad:  # option A: subsample, zero-pad the channels
        s = x[:, :, ::self.stride, ::self.stride]
        lo = self.pad // 2
        s = F.pad(s, (0, 0, 0, 0, lo, self.pad - lo))
      return F.relu(y + s)

  layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
  c = 16
  for width, stride in ((16, 1), (32, 2), (64, 2)):
    for i in range(3):
      layers.append(Block(c, width, stride if i == 0 else 1))
      c = width
  layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
  return nn.Sequential(*layers)


def torch_gpt(num_classes: int = VOCAB, *, seq_len: int, dim: int, depth: int, num_heads: int,
              mlp_ratio: float = 4.0, attention: str = "sdpa"):
  """fdg_jax's GPT (`fdg_jax.models.transformer.gpt`, no dropout) in torch.nn: one
  nn.Sequential of [embedding, depth layers, head], its blocks in Flax's order.

  - embedding: token embedding [vocab, dim] plus a learned position table [seq_len, dim];
  - layer (pre-norm): x + Out(Attention(LayerNorm(x))), then x + Fc2(GELU(Fc1(LayerNorm(x))))
    with LayerNorm eps 1e-6 (Flax's), GELU's tanh form (Flax's nn.gelu), hidden width
    mlp_ratio * dim; the attention is causal over num_heads heads of dim / num_heads, its
    q, k and v one Linear(dim, 3 dim) with bias (Flax: three DenseGenerals, the same
    parameters), scores scaled by head_dim ** -0.5, softmax, then Out = Linear(dim, dim);
    `attention` "sdpa" computes it with `F.scaled_dot_product_attention(is_causal=True)`,
    "math" with explicit matmuls, a -inf mask and softmax;
  - head: LayerNorm and an untied Linear(dim, vocab).
  Takes int64 tokens [B, T], returns logits [B, T, vocab].
  """
  import torch
  import torch.nn as nn
  import torch.nn.functional as F
  if attention not in ("sdpa", "math"):
    raise ValueError(f"attention must be sdpa or math, got {attention!r}")
  hidden, head_dim = int(mlp_ratio * dim), dim // num_heads

  class TokenEmbed(nn.Module):
    def __init__(self):
      super().__init__()
      self.tokens = nn.Embedding(num_classes, dim)
      self.pos = nn.Parameter(torch.empty(seq_len, dim))
      nn.init.normal_(self.tokens.weight, std=0.02)
      nn.init.normal_(self.pos, std=0.02)

    def forward(self, x):
      return self.tokens(x) + self.pos[:x.shape[1]]

  class Layer(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln_attn = nn.LayerNorm(dim, eps=1e-6)
      self.qkv = nn.Linear(dim, 3 * dim)
      self.out = nn.Linear(dim, dim)
      self.ln_mlp = nn.LayerNorm(dim, eps=1e-6)
      self.fc1 = nn.Linear(dim, hidden)
      self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
      B, T, _ = x.shape
      q, k, v = self.qkv(self.ln_attn(x)).view(B, T, 3, num_heads, head_dim).permute(
          2, 0, 3, 1, 4)  # each [B, heads, T, head_dim]
      if attention == "sdpa":
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      else:
        scores = (q * head_dim ** -0.5) @ k.transpose(-2, -1)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        a = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
      x = x + self.out(a.transpose(1, 2).reshape(B, T, dim))
      return x + self.fc2(F.gelu(self.fc1(self.ln_mlp(x)), approximate="tanh"))

  class Head(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln = nn.LayerNorm(dim, eps=1e-6)
      self.dense = nn.Linear(dim, num_classes)

    def forward(self, x):
      return self.dense(self.ln(x))

  return nn.Sequential(TokenEmbed(), *[Layer() for _ in range(depth)], Head())


def torch_sgd(params):
  """The benchmark's optimizer in torch: SGD lr 0.1, momentum 0.9, weight decay 5e-4."""
  import torch
  return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


def torch_adam(params):
  """configs/lm.py's optimizer in torch: Adam lr 1e-3 (b1 0.9, b2 0.999, eps 1e-8, no weight
  decay: optax.adam's defaults), torch's default implementation."""
  import torch
  return torch.optim.Adam(params, lr=1e-3)


def torch_lm_loss(logits, targets):
  """Mean next-token cross-entropy over every token (fdg_jax's `loss_fn` on [B, T, V])."""
  import torch.nn.functional as F
  return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TorchWorkload:
  """What the torch contenders train: `model()` (an nn.Sequential), `optimizer(params)`,
  `loss(output, labels)`, `batch(n, generator)` -> (x, y), `bounds` (the K=4 split; None:
  `torch_fdg.split`'s layer count)."""

  def __init__(self, model, optimizer, loss, batch, bounds=None):
    self.model, self.optimizer, self.loss, self.batch = model, optimizer, loss, batch
    self.bounds = bounds

  def on(self, device: str) -> "TorchWorkload":
    """The same workload with its model and batches on torch `device` ("cpu", "cuda")."""
    if device == "cpu":
      return self
    model, batch = self.model, self.batch

    def batch_on(n, g):
      return tuple(t.to(device) for t in batch(n, g))
    return TorchWorkload(lambda: model().to(device), self.optimizer, self.loss, batch_on,
                         self.bounds)

  @classmethod
  def resnet20(cls):
    import torch
    import torch.nn.functional as F

    def batch(n, g):
      return (torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    return cls(torch_resnet20, torch_sgd, F.cross_entropy, batch)

  @classmethod
  def gpt(cls, name: str, bounds=None, attention: str = "sdpa"):
    import torch
    kwargs, _ = gpt_shape(name)
    T, V = kwargs["seq_len"], kwargs["num_classes"]

    def batch(n, g):
      return (torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g))
    return cls(lambda: torch_gpt(**kwargs, attention=attention), torch_adam, torch_lm_loss, batch,
               bounds)


def torch_device(args) -> str:
  """The torch device of --device: "cuda" for gpu (TF32 matmuls, as JAX's default there)."""
  if getattr(args, "device", "cpu") != "gpu":
    return "cpu"
  import torch
  torch.set_float32_matmul_precision("high")
  return "cuda"


def torch_workload(args) -> TorchWorkload:
  """args.model's torch workload (ResNet-20 when args has no model: conv_profile.py's), on
  --device's torch device."""
  if getattr(args, "model", "resnet20") == "resnet20":
    w = TorchWorkload.resnet20()
  else:
    w = TorchWorkload.gpt(args.model, args.bounds, args.torch_attention)
  return w.on(torch_device(args))


def _sync(args) -> None:
  """Waits for torch's queued GPU work (nothing on CPU)."""
  if torch_device(args) == "cuda":
    import torch
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------ contenders
def _machine_busy_s() -> float:
  """CPU seconds all of the machine's cores have been busy (not idle nor waiting on I/O)
  since boot, from /proc/stat (0 where there is none)."""
  try:
    with open("/proc/stat") as f:
      v = [int(t) for t in f.readline().split()[1:]]
  except (OSError, ValueError):
    return 0.0
  return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
  import resource
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


class Window:
  """A timed window: its wall seconds, this process's CPU seconds (all its threads) and the
  other processes' mean load over it in cores (the machine's busy time less this process's,
  per wall second): on shared cores, what the figure was measured against."""

  def __enter__(self):
    self.t0, self.busy0, self.cpu0 = time.perf_counter(), _machine_busy_s(), _self_cpu_s()
    return self

  def __exit__(self, *exc):
    self.wall = time.perf_counter() - self.t0
    self.cpu = _self_cpu_s() - self.cpu0
    busy = _machine_busy_s() - self.busy0
    self.others = max(0.0, busy - self.cpu) / self.wall if busy and self.wall > 0 else None
    return False

  def result(self, steps: int) -> dict:
    return {"seconds_per_batch": self.wall / steps, "cpu_cores": self.cpu / self.wall,
            "others_cores": self.others}


def torch_timed(args, step, warmup: int) -> dict:
  """Seconds per call of step() over args.batches calls, after `warmup` untimed ones (and the
  window's loads, `Window`); the calls train on one fixed random batch of args.batch_size."""
  import torch
  g = torch.Generator().manual_seed(0)
  x, y = torch_workload(args).batch(args.batch_size, g)
  for _ in range(warmup):
    step(x, y)
  _sync(args)
  with Window() as w:
    for _ in range(args.batches):
      step(x, y)
    _sync(args)
  return w.result(args.batches)


def torch_bp_step(w: TorchWorkload):
  model = w.model()
  opt = w.optimizer(model.parameters())

  def step(x, y):
    opt.zero_grad(set_to_none=True)
    w.loss(model(x), y).backward()
    opt.step()

  return step


def torch_bp(args) -> dict:
  return torch_timed(args, torch_bp_step(torch_workload(args)), args.warmup)


def torch_fdg_run(args, k: int) -> dict:
  """FDG with K=k stages in torch (`torch_fdg.FDG`); the warm-up is at least the pipeline's
  fill, 2(k-1) ticks, plus one."""
  import torch_fdg
  w = torch_workload(args)
  pipe = torch_fdg.FDG(w.model(), k, w.optimizer, bounds=w.bounds, loss=w.loss)
  return torch_timed(args, pipe.tick, max(args.warmup, 2 * (k - 1) + 1))


def resnet20_schedule(algorithm: str, k: int, batch_size: int, ticks: int):
  """fdg_jax's ResNet-20 at K stages with the benchmark's SGD (lr 0.1, momentum 0.9, weight
  decay 5e-4): (schedule, its initial state, `ticks` batches of random images and labels)."""
  import numpy as np
  import fdg_jax
  from fdg_jax.bench import common as B
  from fdg_jax.optim import make_optimizer
  model = B.build_model("resnet20", {}, None)
  _, stages, params, states = B.build_stages(model, k, "balanced", batch_size)
  opt = make_optimizer("sgd", 0.1, momentum=0.9, weight_decay=5e-4)
  sched = fdg_jax.create(algorithm, stages, B.loss_fn, opt)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(ticks, batch_size, 32, 32, 3)).astype(np.float32)
  ys = rng.integers(0, 10, size=(ticks, batch_size)).astype(np.int32)
  return sched, sched.init(params, states), (xs, ys)


def gpt_model(name: str):
  from fdg_jax import models
  kwargs, _ = gpt_shape(name)
  return models.create("gpt", **kwargs)


def gpt_params(name: str, bounds):
  """fdg_jax's GPT split at `bounds`: (stages, params, model states), as the trainer builds
  them (PRNGKey(0), float32)."""
  import jax
  import jax.numpy as jnp
  import fdg_jax
  from fdg_jax import partition
  model = gpt_model(name)
  stages = partition.stages_from_boundaries(model, list(bounds))
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0),
                                       jnp.zeros((1, model.input_shape[0]), jnp.int32))
  return stages, params, states


def gpt_schedule(name: str, algorithm: str, bounds, batch_size: int, ticks: int,
                 batches=None):
  """fdg_jax's GPT `name` at len(bounds)+1 stages with configs/lm.py's Adam (lr 1e-3,
  constant): (schedule, its initial state, `ticks` batches of random tokens and targets, or
  `batches` (xs, ys) [ticks, B, T])."""
  import numpy as np
  import fdg_jax
  from fdg_jax.bench import common as B
  from fdg_jax.optim import make_optimizer
  stages, params, states = gpt_params(name, bounds)
  sched = fdg_jax.create(algorithm, stages, B.loss_fn, make_optimizer("adam", 1e-3))
  if batches is None:
    T = gpt_shape(name)[0]["seq_len"]
    rng = np.random.default_rng(0)
    batches = tuple(rng.integers(0, VOCAB, size=(ticks, batch_size, T)).astype(np.int32)
                    for _ in range(2))
  return sched, sched.init(params, states), batches


def fdg_jax_schedule(args, algorithm: str, k: int):
  if getattr(args, "model", "resnet20") == "resnet20":
    return resnet20_schedule(algorithm, k, args.batch_size, args.ticks_per_call)
  return gpt_schedule(args.model, algorithm, args.bounds if k > 1 else [], args.batch_size,
                      args.ticks_per_call)


def enable_compilation_cache() -> None:
  """JAX's persistent compilation cache, as train.py has it (FDG_JAX_COMPILATION_CACHE: a
  directory, or off; default the user-level one): later processes skip the compilation,
  which the timings exclude anyway."""
  from fdg_jax.runtime import compile_cache
  compile_cache.enable(os.environ.get("FDG_JAX_COMPILATION_CACHE", "auto"))


def fdg_jax_run(args, algorithm: str, k: int) -> dict:
  import jax
  enable_compilation_cache()
  T = args.ticks_per_call
  sched, state, batches = fdg_jax_schedule(args, algorithm, k)
  calls = max(1, args.batches // T)
  for _ in range(max(1, args.warmup // T + 1)):
    state, m = sched.run(state, batches)
  jax.block_until_ready((state, m))
  with Window() as w:
    for _ in range(calls):
      state, m = sched.run(state, batches)
    jax.block_until_ready((state, m))
  return w.result(calls * T)


# ------------------------------------------------------------------------------ checks
def copy_flax_gpt(params: dict, model) -> None:
  """Flax's GPT parameters (one stage's, K=1: {"block_i": ...}) into `torch_gpt`'s `model`."""
  import numpy as np
  import torch

  def t(a):
    return torch.from_numpy(np.array(a, dtype=np.float32))

  def dense(lin, p):  # Flax kernels are [in, out], torch weights [out, in]
    lin.weight.data.copy_(t(p["kernel"]).reshape(lin.in_features, -1).T)
    lin.bias.data.copy_(t(p["bias"]).reshape(-1))

  def norm(ln, p):
    ln.weight.data.copy_(t(p["scale"]))
    ln.bias.data.copy_(t(p["bias"]))

  blocks = list(model.children())
  embed = params["block_0"]
  blocks[0].tokens.weight.data.copy_(t(embed["tokens"]["embedding"]))
  blocks[0].pos.data.copy_(t(embed["pos"]))
  for i, layer in enumerate(blocks[1:-1], start=1):
    p = params[f"block_{i}"]
    norm(layer.ln_attn, p["ln_attn"])
    norm(layer.ln_mlp, p["ln_mlp"])
    a = p["attn"]
    d = layer.qkv.in_features
    layer.qkv.weight.data.copy_(torch.cat([t(a[n]["kernel"]).reshape(d, d).T
                                           for n in ("query", "key", "value")]))
    layer.qkv.bias.data.copy_(torch.cat([t(a[n]["bias"]).reshape(-1)
                                         for n in ("query", "key", "value")]))
    layer.out.weight.data.copy_(t(a["out"]["kernel"]).reshape(-1, d).T)
    layer.out.bias.data.copy_(t(a["out"]["bias"]))
    dense(layer.fc1, p["fc1"])
    dense(layer.fc2, p["fc2"])
  head = params[f"block_{len(blocks) - 1}"]
  norm(blocks[-1].ln, head["ln"])
  dense(blocks[-1].dense, head["dense"])


def gpt_checks(args) -> dict:
  """The GPT workload's checks (see the module docstring); each asserted, the figures
  returned."""
  import numpy as np
  import torch
  import torch_fdg
  import jax
  from fdg_jax import partition
  enable_compilation_cache()
  name, bounds = args.model, list(args.bounds)
  w = TorchWorkload.gpt(name, bounds, args.torch_attention)
  torch.manual_seed(0)
  model = w.model()
  torch_count = sum(p.numel() for p in model.parameters())
  _, params, _ = gpt_params(name, [])
  jax_count = partition.param_count(params)
  print(f"{name}: parameters: torch {torch_count}, fdg_jax {jax_count}", file=sys.stderr)
  assert torch_count == jax_count, (torch_count, jax_count)
  # The same function and the same Adam step: Flax's initial parameters in torch, three BP
  # steps on the same batches in both; the losses (each before its step) must agree.
  copy_flax_gpt(params[0], model)
  steps, n = 3, 8
  T = gpt_shape(name)[0]["seq_len"]
  rng = np.random.default_rng(1)
  xs, ys = (rng.integers(0, VOCAB, size=(steps, n, T)).astype(np.int32) for _ in range(2))
  sched, state, _ = gpt_schedule(name, "bp", [], n, steps, batches=(xs, ys))
  state, m = sched.run(state, (xs, ys))
  jax_losses = [float(v) for v in np.asarray(m["loss"])]
  step = torch_bp_step(TorchWorkload(lambda: model, w.optimizer, w.loss, w.batch))
  torch_losses = []
  for i in range(steps):
    x, y = torch.from_numpy(xs[i].astype(np.int64)), torch.from_numpy(ys[i].astype(np.int64))
    with torch.no_grad():
      torch_losses.append(float(w.loss(model(x), y)))
    step(x, y)
  rel = [abs(a - b) / abs(b) for a, b in zip(torch_losses, jax_losses)]
  print(f"{name}: BP losses torch {torch_losses}, fdg_jax {jax_losses}", file=sys.stderr)
  assert rel[0] <= 1e-5 and max(rel) <= 1e-4, rel
  k1 = torch_fdg.check_k1_matches_bp(workload=w)
  k4 = torch_fdg.check_k4_schedule(workload=w)
  sizes = np.diff([0, *bounds, gpt_model(name).num_blocks]).tolist()
  assert k4["layers"] == sizes, (k4["layers"], sizes)
  del jax
  return {"parameters": {"torch": torch_count, "fdg_jax": jax_count},
          "bp_losses": {"torch": torch_losses, "fdg_jax": jax_losses,
                        "max_rel_diff": max(rel)},
          "torch_fdg_k1_vs_bp_max_abs_diff": k1, "torch_fdg_k4": k4, "blocks_per_stage": sizes}


# ------------------------------------------------------------------------------ profiles
# What an XLA:CPU thunk computes, from its HLO (the op codes of the fusion's computation).
HLO_GROUPS = ("matmuls (dot)", "softmax, log-softmax (exp + reduce)",
              "data movement (transpose, copy, slice, stash writes)",
              "reductions (LayerNorm, bias grads)", "elementwise (GELU, Adam, adds)", "other")
_MOVES = {"transpose", "copy", "broadcast", "slice", "concatenate", "pad", "dynamic-slice",
          "dynamic-update-slice", "reshape", "iota", "bitcast", "parameter", "constant",
          "tuple", "get-tuple-element", "gather", "scatter", "select", "convert"}


def hlo_group(ops: set) -> str:
  if ops & {"dot", "convolution"}:
    return HLO_GROUPS[0]
  if "exponential" in ops and ops & {"reduce", "reduce-window"}:
    return HLO_GROUPS[1]
  if ops and ops <= _MOVES:
    return HLO_GROUPS[2]
  if ops & {"reduce", "reduce-window"}:
    return HLO_GROUPS[3]
  if ops - _MOVES:
    return HLO_GROUPS[4]
  return HLO_GROUPS[5]


def hlo_groups(dump_dir: str) -> dict:
  """{(module, instruction): group} over the optimized HLO modules XLA dumped (text) into
  `dump_dir`: a fusion by the op codes of its computation (nested calls included), any
  other instruction by its own."""
  import glob
  import re
  inst = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][\w\-]*)\((.*)$")
  out = {}
  for path in glob.glob(os.path.join(dump_dir, "*.cpu_after_optimizations.txt")):
    module = re.sub(r"^module_\d+\.", "", os.path.basename(path)).split(".cpu_after")[0]
    comps, cur = {}, None
    with open(path) as f:
      for line in f:
        if not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
          cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
          comps[cur] = []
        elif line.startswith("}"):
          cur = None
        elif cur is not None and (m := inst.match(line)):
          calls = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", m.group(3))
          comps[cur].append((m.group(1), m.group(2), calls))

    def ops_of(comp, seen):
      ops = set()
      for _, op, calls in comps.get(comp, ()):
        ops.add(op)
        for c in calls:
          if c not in seen:
            seen.add(c)
            ops |= ops_of(c, seen)
      return ops

    for comp, rows in comps.items():
      for name, op, calls in rows:
        ops = {op} if op != "fusion" else set()
        for c in calls:
          ops |= ops_of(c, {c})
        out[(module, name)] = hlo_group(ops - {"fusion"} if op == "fusion" else ops)
  return out


def trace_fdg_jax(args, algorithm: str, k: int) -> dict:
  """JAX's profiler (Python tracing off) over the timed run calls of fdg_jax's step, after
  the warm-up: XLA:CPU worker threads' time by thunk kind (`conv_profile.thunk_breakdown`)
  and by what the thunks compute (`hlo_groups`, from the optimized HLO XLA dumps where
  FDG_TRACE_HLO names a directory), the wall time and the window's loads, per tick."""
  import glob
  import gzip
  import jax
  import conv_profile
  T = args.ticks_per_call
  sched, state, batches = fdg_jax_schedule(args, algorithm, k)
  for _ in range(max(1, args.warmup // T + 1)):
    state, m = sched.run(state, batches)
  jax.block_until_ready((state, m))
  calls = max(1, args.batches // T)
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  trace_dir = os.path.join(args.trace, f"{args.model}_{algorithm}{k}")
  with jax.profiler.trace(trace_dir, profiler_options=options):
    with Window() as w:
      for _ in range(calls):
        state, m = sched.run(state, batches)
      jax.block_until_ready((state, m))
  ticks = calls * T
  kinds = [(kind, ms / ticks, n / ticks) for kind, ms, n in
           conv_profile.thunk_breakdown(trace_dir)]
  groups: dict = {}
  hlo_dir = os.environ.get("FDG_TRACE_HLO", "")
  if hlo_dir:
    table = hlo_groups(hlo_dir)
    path = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*",
                                         "*.trace.json.gz")))[-1]
    events = json.load(gzip.open(path))["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    for e in events:
      if "dur" not in e or e["name"].startswith(("ThunkExecutor", "end: ")):
        continue
      if not threads.get((e["pid"], e["tid"]), "").startswith("tf_XLAEigen"):
        continue
      a = e.get("args", {})
      g = ("thread-pool waits" if e["name"].startswith("SlinkyThreadPool")
           else table.get((a.get("hlo_module", ""), a.get("hlo_op", e["name"])), "unmatched"))
      groups[g] = groups.get(g, 0.0) + e["dur"] / 1e3 / ticks
  return {"wall_ms_per_tick": 1e3 * w.wall / ticks, "cpu_cores": w.cpu / w.wall,
          "others_cores": w.others, "thunks_ms_per_tick": kinds, "groups_ms_per_tick": groups}


# torch operators by what they compute (self CPU time), matched in order on the name.
TORCH_GROUPS = (
    ("matmuls (dot)", ("mm", "addmm", "bmm", "matmul", "linear")),
    ("attention (SDPA, its matmuls and softmax)", ("scaled_dot_product",)),
    ("softmax, log-softmax (exp + reduce)", ("softmax", "log_softmax", "nll_loss")),
    ("data movement (transpose, copy, slice, stash writes)",
     ("copy", "clone", "contiguous", "transpose", "permute", "cat", "index", "embedding",
      "slice", "view", "reshape", "t", "select", "unsafe_split", "split", "zero", "fill",
      "detach", "as_strided", "expand")),
    ("reductions (LayerNorm, bias grads)", ("layer_norm", "sum", "mean")),
    ("elementwise (GELU, Adam, adds)", ("gelu", "add", "mul", "div", "sqrt", "addcdiv",
                                          "addcmul", "lerp", "sub", "neg", "pow", "foreach")),
)


def torch_group(op: str) -> str:
  name = op.split("::")[-1].split("#")[0].strip("_")
  for group, keys in TORCH_GROUPS:
    if any(name == k or name.startswith(k + "_") or (len(k) > 3 and k in name) for k in keys):
      return group
  return "Python, autograd and other overhead"


def trace_torch(args, algorithm: str, k: int) -> dict:
  """torch.profiler over args.batches steps after the warm-up: self CPU time per operator,
  per tick (all threads), and the wall time."""
  import torch
  import torch_fdg
  w = torch_workload(args)
  if algorithm == "bp":
    step, warmup = torch_bp_step(w), args.warmup
  else:
    step = torch_fdg.FDG(w.model(), k, w.optimizer, bounds=w.bounds, loss=w.loss).tick
    warmup = max(args.warmup, 2 * (k - 1) + 1)
  x, y = w.batch(args.batch_size, torch.Generator().manual_seed(0))
  for _ in range(warmup):
    step(x, y)
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    with Window() as w:
      for _ in range(args.batches):
        step(x, y)
  ops = sorted(((e.key, e.self_cpu_time_total / 1e3 / args.batches, e.count / args.batches)
                for e in prof.key_averages()), key=lambda r: -r[1])
  groups: dict = {}
  for op, v, _ in ops:
    groups[torch_group(op)] = groups.get(torch_group(op), 0.0) + v
  return {"wall_ms_per_tick": 1e3 * w.wall / args.batches, "cpu_cores": w.cpu / w.wall,
          "others_cores": w.others, "ops_ms_per_tick": ops[:25],
          "self_cpu_ms_per_tick": sum(v for _, v, _ in ops), "groups_ms_per_tick": groups}


# ------------------------------------------------------------------------------ processes
def run_child(script: str, argv: list[str], env_updates: dict | None = None) -> dict | None:
  """Runs `python script argv` in a fresh process (without the parent's JAX_NUM_CPU_DEVICES)
  and returns the JSON object of its last output line; None, after one line, if it failed."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env.update(env_updates or {})
  out = subprocess.run([sys.executable, os.path.abspath(script), *argv], capture_output=True,
                       text=True, env=env)
  if out.returncode != 0:
    print(f"{argv[1] if len(argv) > 1 else script}: failed: "
          f"{out.stderr.strip().splitlines()[-1] if out.stderr else ''}")
    return None
  return json.loads(out.stdout.strip().splitlines()[-1])


# name: (library, algorithm, K); the torch ones are timed when torch is installed
CONTENDERS = {"torch BP": ("torch", "bp", 1), "torch FDG K=4 (threads)": ("torch", "fdg", 4),
              "fdg_jax BP K=1": ("fdg_jax", "bp", 1), "fdg_jax FDG K=4": ("fdg_jax", "fdg", 4)}
# the side-by-side ratios reported: (fdg_jax contender, torch contender)
PAIRS = (("fdg_jax BP K=1", "torch BP"), ("fdg_jax FDG K=4", "torch FDG K=4 (threads)"))


def env_for(args, env: dict) -> dict:
  """A child's environment updates: with --device cpu, JAX on its CPU backend."""
  return {**env, "JAX_PLATFORMS": "cpu"} if args.device == "cpu" else env


def child(args) -> None:
  if args.child == "checks":
    print(json.dumps(gpt_checks(args)))
    return
  if args.child.startswith("trace:"):
    library, algorithm, k = CONTENDERS[args.child[len("trace:"):]]
    fn = trace_fdg_jax if library == "fdg_jax" else trace_torch
    print(json.dumps(fn(args, algorithm, k)))
    return
  library, algorithm, k = CONTENDERS[args.child]
  if library == "fdg_jax":
    res = fdg_jax_run(args, algorithm, k)
  elif algorithm == "bp":
    res = torch_bp(args)
  else:
    res = torch_fdg_run(args, k)
  print(json.dumps(res))


def child_argv(args, model: str, what: str) -> list[str]:
  return ["--child", what, "--models", model, "--batch_size", str(batch_size(args, model)),
          "--batches", str(args.batches), "--warmup", str(args.warmup),
          "--ticks_per_call", str(args.ticks_per_call),
          "--bounds", ",".join(map(str, args.split_bounds.get(model, []))),
          "--torch_attention", args.torch_attention, "--trace", args.trace,
          "--device", args.device]


def measure(args, model: str, contender: str, xla_flags: str) -> dict | None:
  """One fresh process's figures (`Window.result`), or None if it failed. A measurement
  during which the other processes kept more than args.max_others cores busy on average is
  taken again, up to args.retries times (the last one kept, whatever its load); "tries"
  counts them."""
  for attempt in range(args.retries + 1):
    res = run_child(__file__, child_argv(args, model, contender),
                    env_for(args, {"XLA_FLAGS": xla_flags}))
    if res is None:
      return None
    res["tries"] = attempt + 1
    others = res.get("others_cores")
    if others is None or others <= args.max_others:
      break
  return res


def batch_size(args, model: str) -> int:
  if args.batch_size:
    return args.batch_size
  return 128 if model == "resnet20" else gpt_shape(model)[1]


def gpt_bounds(model: str, split: str) -> list[int]:
  """fdg_jax.partition's K=4 boundaries of the GPT `model` (`split` as the trainer's)."""
  import jax.numpy as jnp
  from fdg_jax import partition
  m = gpt_model(model)
  x = jnp.zeros((gpt_shape(model)[1],) + tuple(m.input_shape), jnp.int32)
  return partition.boundaries(m, 4, partition.parse_split(split), example_input=x)


def machine(device: str = "cpu") -> dict:
  info = {"cpus": os.cpu_count(), "platform": platform.platform(),
          "python": platform.python_version(), "note": "CPU only"}
  if device == "gpu":
    try:
      import torch
      info["note"] = f"GPU: {torch.cuda.get_device_name(0)}"
    except ImportError:
      import jax
      info["note"] = f"GPU: {jax.devices()[0].device_kind}"
  for mod in ("jax", "torch"):
    with contextlib.suppress(ImportError):
      info[mod] = __import__(mod).__version__
  with contextlib.suppress(OSError):
    info["load_average_at_start"] = os.getloadavg()
  return info


def report(model: str, args, times: dict, flags: str, windows: dict) -> dict:
  """Prints the workload's table and ratios (of all the measurements, and of the quiet ones:
  the windows in which the other processes kept at most args.max_others cores busy);
  returns its JSON record."""
  med = {c: statistics.median(v) for c, v in times.items() if v}
  others = {c: [w["others_cores"] for w in v if w.get("others_cores") is not None]
            for c, v in windows.items()}
  quiet = {c: [w["seconds_per_batch"] for w in v
               if w.get("others_cores") is not None and w["others_cores"] <= args.max_others]
           for c, v in windows.items()}
  qmed = {c: statistics.median(v) for c, v in quiet.items() if v}
  if model == "resnet20":
    title = f"ResNet-20, batch {batch_size(args, model)}, SGD momentum 0.9{flags}"
  else:
    kw, _ = gpt_shape(model)
    title = (f"{model}: GPT width {kw['dim']}, {kw['depth']} layers of {kw['num_heads']} "
             f"heads, {kw['seq_len']} tokens, vocabulary {kw['num_classes']}, batch "
             f"{batch_size(args, model)}, Adam lr 1e-3, fp32; K=4 split "
             f"{args.split_bounds[model]} ({args.gpt_split}){flags}")
  print(f"\n{title}\n")
  print(f"| contender | s per batch, median [min, max] | × torch BP | others' load, cores "
        f"[min, max] | quiet runs (others ≤ {args.max_others}): n, median [min, max] |")
  print("|---|---|---|---|---|")
  for c, v in times.items():
    if not v:
      continue
    ratio = f"{med[c] / med['torch BP']:.2f}" if "torch BP" in med else "–"
    load = f"{min(others[c]):.2f}–{max(others[c]):.2f}" if others.get(c) else "?"
    q = quiet.get(c) or []
    qcell = f"{len(q)}, {qmed[c]:.4f} [{min(q):.4f}, {max(q):.4f}]" if q else "0"
    print(f"| {c} | {med[c]:.4f} [{min(v):.4f}, {max(v):.4f}] | {ratio} | {load} | {qcell} |")
  ratios = {}
  for ours, theirs in PAIRS:
    if ours in med and theirs in med:
      paired = [a / b for a, b in zip(times[ours], times[theirs])]
      rec = {"of_medians": med[ours] / med[theirs], "per_repeat": paired}
      line = (f"\n{ours} / {theirs}: {med[ours] / med[theirs]:.2f} (per repeat "
              f"{min(paired):.2f}–{max(paired):.2f})")
      if ours in qmed and theirs in qmed:
        rec["of_quiet_medians"] = qmed[ours] / qmed[theirs]
        line += f"; quiet runs {qmed[ours] / qmed[theirs]:.2f}"
      ratios[f"{ours} / {theirs}"] = rec
      print(line, end="")
  print()
  return {"title": title, "seconds_per_batch": times, "median": med, "ratios": ratios,
          "quiet_seconds_per_batch": quiet, "quiet_median": qmed,
          "spread": {c: (max(v) - min(v)) / med[c] for c, v in times.items() if v}}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["resnet20"], choices=MODELS,
                      help="workloads, timed in turns (default resnet20)")
  parser.add_argument("--batch_size", type=int, default=0,
                      help="0: the workload's own (ResNet-20 128; the GPTs 32)")
  parser.add_argument("--batches", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=4)
  parser.add_argument("--ticks_per_call", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--gpt_split", default="uniform",
                      help="the GPTs' K=4 split, for both libraries (fdg_jax.partition: "
                      "uniform | balanced | boundaries like 2,4,5)")
  parser.add_argument("--torch_attention", default="sdpa", choices=("sdpa", "math"),
                      help="the torch GPT's attention: F.scaled_dot_product_attention or "
                      "explicit matmuls and softmax")
  parser.add_argument("--xla_flags", default=os.environ.get("XLA_FLAGS", ""),
                      help="XLA_FLAGS for the fdg_jax processes")
  parser.add_argument("--variants", nargs="+", default=None,
                      help="several XLA_FLAGS values, each timed as its own fdg_jax contender "
                      "(side by side with the others and torch), each written without its leading "
                      "'--', e.g. xla_cpu_use_xnnpack=true; '' is XLA's defaults")
  parser.add_argument("--bp_only", action="store_true",
                      help="time the BP contenders only (fdg_jax BP K=1 and torch BP)")
  parser.add_argument("--no_checks", action="store_true", help="skip the GPT checks")
  parser.add_argument("--max_others", type=float, default=0.5,
                      help="cores the other processes may keep busy, on average over a timed "
                      "window, before the measurement is taken again (--retries times)")
  parser.add_argument("--retries", type=int, default=1,
                      help="new measurements when others exceed --max_others (0: none)")
  parser.add_argument("--trace", default="",
                      help="GPTs: profile one process of each contender into this directory "
                      "instead of timing (fdg_jax: JAX's profiler by XLA:CPU thunk kind; "
                      "torch: torch.profiler by operator)")
  parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                      help="where every contender runs: the CPU (JAX_PLATFORMS=cpu for "
                      "fdg_jax) or the first GPU (torch on cuda, fdg_jax's default backend)")
  parser.add_argument("--out", default="")
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  parser.add_argument("--bounds", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    args.model = args.models[0]
    args.bounds = [int(b) for b in args.bounds.split(",")] if args.bounds else None
    child(args)
    return 0
  start = time.perf_counter()
  info = machine(args.device)
  args.split_bounds = {m: gpt_bounds(m, args.gpt_split) for m in args.models if m != "resnet20"}
  chosen = {c: lib for c, (lib, alg, _) in CONTENDERS.items() if not args.bp_only or alg == "bp"}
  ours = [c for c, lib in chosen.items() if lib == "fdg_jax"]
  # A variant's flags may be written without their leading "--" (argparse would take
  # "--xla_..." for an option of this script): "xla_cpu_use_xnnpack=true".
  variants = ([" ".join(f if f.startswith("--") else f"--{f}" for f in v.split())
               for v in args.variants] if args.variants is not None else [args.xla_flags])
  contenders = [(c if len(variants) == 1 else f"{c} [{v or 'defaults'}]", c, v)
                for v in variants for c in ours]
  have_torch = True
  try:
    import torch  # noqa: F401
    contenders[:0] = [(c, c, "") for c, lib in chosen.items() if lib == "torch"]
  except ImportError:
    have_torch = False
    print("PyTorch is not installed: timing fdg_jax alone (pip install torch; a CPU build is "
          "enough, e.g. pip install torch --index-url https://download.pytorch.org/whl/cpu)")
  checks = {}
  if have_torch and not args.no_checks:
    for model in args.split_bounds:
      checks[model] = run_child(__file__, child_argv(args, model, "checks"), env_for(args, {}))
      if checks[model] is None:
        print(f"{model}: the checks failed; not timing it")
        return 1
      c = checks[model]
      print(f"{model} checks: parameters torch {c['parameters']['torch']} = fdg_jax "
            f"{c['parameters']['fdg_jax']}; BP losses agree to "
            f"{c['bp_losses']['max_rel_diff']:.1e} (relative); torch FDG K=1 = torch BP "
            f"(max |diff| {c['torch_fdg_k1_vs_bp_max_abs_diff']:.1e}); torch FDG K=4 first updates "
            f"{c['torch_fdg_k4']['first_update']}, stashes {c['torch_fdg_k4']['stash']}, "
            f"blocks per stage {c['blocks_per_stage']}", flush=True)
  if args.trace:
    profiles = {}
    for model in args.split_bounds:
      for label, c, flags in contenders:
        env = {"XLA_FLAGS": flags}
        if CONTENDERS[c][0] == "fdg_jax":  # its optimized HLO, to tell what each thunk is
          hlo = os.path.join(os.path.abspath(args.trace), f"hlo_{model}_{c.split()[1]}")
          env = {"XLA_FLAGS": f"{flags} --xla_dump_to={hlo} --xla_dump_hlo_as_text".strip(),
                 "FDG_TRACE_HLO": hlo}
        res = run_child(__file__, child_argv(args, model, f"trace:{c}"), env_for(args, env))
        profiles.setdefault(model, {})[label] = res
        if res is not None:
          print_profile(model, label, res)
    if args.out:
      with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": info, "checks": checks,
                   "profiles": profiles, "wall_s": time.perf_counter() - start}, f, indent=1)
    return 0
  times = {m: {label: [] for label, _, _ in contenders} for m in args.models}
  windows = {m: {label: [] for label, _, _ in contenders} for m in args.models}
  for r in range(args.repeats):
    for model in args.models:
      for label, c, flags in contenders:
        res = measure(args, model, c, flags)
        if res is None:
          print(f"repeat {r}: {model}: {label}: failed", flush=True)
          continue
        times[model][label].append(res["seconds_per_batch"])
        windows[model][label].append(res)
        others = res.get("others_cores")
        print(f"repeat {r}: {model}: {label}: {res['seconds_per_batch']:.4f} s/batch (own "
              f"{res['cpu_cores']:.2f} cores, others "
              f"{'?' if others is None else f'{others:.2f}'}; try {res['tries']})", flush=True)
  flags = "" if len(variants) > 1 else f"; XLA_FLAGS={variants[0]!r}"
  records = {m: {**report(m, args, times[m], flags, windows[m]), "windows": windows[m]}
             for m in args.models}
  wall = time.perf_counter() - start
  print(f"\n{os.cpu_count()} CPUs ({info['note']}); {wall:.0f} s in all")
  if args.out:
    out = {"args": vars(args), "machine": info, "checks": checks, "workloads": records,
           "wall_s": wall}
    if args.models == ["resnet20"]:
      out["seconds_per_batch"] = times["resnet20"]  # the earlier files' layout
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return 0


def print_profile(model: str, label: str, res: dict) -> None:
  others = res.get("others_cores")
  print(f"\n{model}: {label} under the profiler: {res['wall_ms_per_tick']:.1f} ms wall per "
        f"tick (own {res['cpu_cores']:.2f} cores, others "
        f"{'?' if others is None else f'{others:.2f}'})")
  if "thunks_ms_per_tick" in res:
    busy = sum(v for _, v, _ in res["thunks_ms_per_tick"])
    print(f"XLA:CPU worker threads busy in thunks {busy:.1f} ms per tick (both cores together; "
          f"2 x wall = {2 * res['wall_ms_per_tick']:.1f})\n")
  else:
    busy = res["self_cpu_ms_per_tick"]
    print(f"self CPU time {busy:.1f} ms per tick (all threads; 2 x wall = "
          f"{2 * res['wall_ms_per_tick']:.1f})\n")
  groups = res.get("groups_ms_per_tick") or {}
  if groups:
    total = sum(groups.values())
    print("| what | ms per tick | share |")
    print("|---|---|---|")
    for g, v in sorted(groups.items(), key=lambda r: -r[1]):
      print(f"| {g} | {v:.1f} | {100 * v / total:.0f}% |")
    print()
  if "thunks_ms_per_tick" in res:
    print("| thunk kind | ms per tick | count per tick |")
    print("|---|---|---|")
    for kind, v, n in res["thunks_ms_per_tick"][:12]:
      print(f"| {kind} | {v:.2f} | {n:.0f} |")
  elif res["ops_ms_per_tick"]:
    print("| operator | self CPU ms per tick | calls per tick |")
    print("|---|---|---|")
    for op, v, n in res["ops_ms_per_tick"][:12]:
      print(f"| {op} | {v:.2f} | {n:.0f} |")
  else:
    print("(torch.profiler records no operator of the per-tick stage threads: wall time only)")


if __name__ == "__main__":
  sys.exit(main())
