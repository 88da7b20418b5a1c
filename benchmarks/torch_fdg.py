"""FDG in PyTorch, in the style of the FDG paper's official code: one thread per stage a tick.

Zhuang et al., "Fully Decoupled Neural Network Learning Using Delayed Gradients" (TNNLS 2021).
A torch.nn.Sequential is split into K stages, each with its own optimizer. At every tick each
stage reads only the messages its neighbours sent at the previous tick:
- stage 0 gets the tick's batch; stage k > 0 runs its forward on the activation stage k-1 sent
  at the previous tick (so at tick t stage k forwards batch t-k);
- the last stage computes the loss, its backward and its update in the same tick, and sends
  the gradient of its input to stage K-2;
- stage k < K-1 runs its backward on the input gradient stage k+1 sent at the previous tick,
  for the oldest of its stashed forwards, then updates, so the gradient it applies is
  2(K-1-k) ticks stale (its first update is at tick K-1 + (K-1-k)).
The backward uses the weights its forward ran with (weight stashing): every forward runs on a
snapshot of the stage's parameters (`torch.func.functional_call` with detached clones), kept in
the stash until its backward, whose gradient becomes the real parameters' `.grad` before the
optimizer's step. The module's own buffers serve the forward, so BatchNorm's running
statistics are updated as usual. A stage without an input yet does nothing (the pipeline
fills in 2(K-1) ticks). Each tick starts one `threading.Thread` per stage and joins them all;
messages are detached tensors, delivered to the neighbours' inboxes after the join.

    import torch_fdg                       # with benchmarks/ on sys.path
    pipe = torch_fdg.FDG(model, 4, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    loss = pipe.tick(x, y)                 # None until the first batch reaches the last stage
    torch_fdg.check_k1_matches_bp(); torch_fdg.check_k4_schedule()   # on ResNet-20
    pipe = torch_fdg.FDG(gpt, 4, torch_cpu.torch_adam, bounds=[1, 3, 4],
                         loss=torch_cpu.torch_lm_loss)   # a GPT, cut where fdg_jax cuts it
    torch_fdg.check_k1_matches_bp(workload=torch_cpu.TorchWorkload.gpt("gpt", [1, 3, 4]))
"""

from __future__ import annotations

import collections
import copy
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call


def split(model: nn.Sequential, num_stages: int,
          bounds: list[int] | None = None) -> list[nn.Sequential]:
  """K contiguous chunks of the Sequential's children, balanced by layer count (the first
  len % K chunks one child longer), or cut at `bounds` (K-1 increasing child indices, as
  `fdg_jax.partition`'s boundaries: chunk k is children [b_k, b_{k+1})); the chunks share
  the model's modules.

  Layer counts rather than parameter counts: ResNet-20's nine blocks cost about the same
  FLOPs each while their parameter counts grow 16-fold from the first to the last, so
  balancing parameters would pile most of the work onto the first stage.
  """
  children = list(model.children())
  if not 1 <= num_stages <= len(children):
    raise ValueError(f"cannot split {len(children)} layers into {num_stages} stages")
  if bounds is not None:
    bounds = [0, *bounds, len(children)]
    if len(bounds) != num_stages + 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
      raise ValueError(f"bounds {bounds[1:-1]} are not {num_stages - 1} increasing indices "
                       f"in (0, {len(children)})")
    return [nn.Sequential(*children[a:b]) for a, b in zip(bounds, bounds[1:])]
  q, r = divmod(len(children), num_stages)
  bounds = [0]
  for k in range(num_stages):
    bounds.append(bounds[-1] + q + (k < r))
  return [nn.Sequential(*children[a:b]) for a, b in zip(bounds, bounds[1:])]


class Stage:
  """One stage: its module and optimizer, its stash of forwards awaiting their backward, its
  inbox (the messages sent to it at the previous tick) and what it sent this tick."""

  def __init__(self, module: nn.Module, optimizer, first: bool, last: bool,
               loss=F.cross_entropy):
    self.module, self.first, self.last, self.loss_fn = module, first, last, loss
    self.names = [n for n, _ in module.named_parameters()]
    self.params = [p for _, p in module.named_parameters()]
    self.opt = optimizer(self.params)
    self.stash = collections.deque()  # (input, output, parameter snapshot), oldest first
    self.act_in = self.grad_in = None  # inbox: (activation, labels) and an input gradient
    self.act_out = self.grad_out = self.loss = None  # sent (and the loss) this tick
    self.updates = 0

  def work(self) -> None:
    """This tick's work: the backward and the update, then the forward (the last stage: the
    forward, the loss, the backward and the update of the tick's input)."""
    self.act_out = self.grad_out = self.loss = None
    if self.last:
      if self.act_in is not None:
        h, y = self.act_in
        inp, out, snap = self._forward(h)
        loss = self.loss_fn(out, y)
        loss.backward()
        self._update(inp, snap)
        self.loss = loss.detach()
      return
    if self.grad_in is not None:
      inp, out, snap = self.stash.popleft()
      out.backward(self.grad_in)
      self._update(inp, snap)
    if self.act_in is not None:
      h, y = self.act_in
      inp, out, snap = self._forward(h)
      self.stash.append((inp, out, snap))
      self.act_out = (out.detach(), y)

  def _forward(self, h: torch.Tensor):
    """The forward on a snapshot of the parameters; the input requires a gradient except at
    stage 0 (none is sent back from there)."""
    snap = {n: p.detach().clone().requires_grad_() for n, p in zip(self.names, self.params)}
    inp = h if self.first else h.detach().requires_grad_()
    return inp, functional_call(self.module, snap, (inp,)), snap

  def _update(self, inp: torch.Tensor, snap: dict) -> None:
    """The snapshot's gradient into the parameters' .grad, the optimizer's step, and the input
    gradient sent back."""
    for n, p in zip(self.names, self.params):
      p.grad = snap[n].grad
    self.opt.step()
    self.updates += 1
    if not self.first:
      self.grad_out = inp.grad


class FDG:
  """FDG training of `model` (an nn.Sequential) split into `num_stages` stages by `split`
  (at `bounds` when given); `optimizer(params)` builds each stage's optimizer; `loss(output,
  labels)` is the last stage's loss (default: cross-entropy over classes)."""

  def __init__(self, model: nn.Sequential, num_stages: int, optimizer, *,
               bounds: list[int] | None = None, loss=F.cross_entropy):
    chunks = split(model, num_stages, bounds)
    K = len(chunks)
    self.stages = [Stage(m, optimizer, k == 0, k == K - 1, loss)
                   for k, m in enumerate(chunks)]

  def tick(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """One tick: stage 0 gets (x, y), every stage does its work in its own thread, then the
    messages are delivered. Returns the last stage's loss this tick (None while filling)."""
    stages = self.stages
    stages[0].act_in = (x, y)
    errors = []

    def run(stage):
      try:
        stage.work()
      except BaseException as e:  # re-raised in the caller's thread below
        errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in stages]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    if errors:
      raise errors[0]
    for k, s in enumerate(stages):
      s.act_in = stages[k - 1].act_out if k > 0 else None
      s.grad_in = stages[k + 1].grad_out if k < len(stages) - 1 else None
    return stages[-1].loss


# ------------------------------------------------------------------------------ checks
def _workload(workload):
  """The checks' workload (`torch_cpu.TorchWorkload`: model, optimizer, loss, batches and
  split); None: ResNet-20 with SGD, as `torch_cpu.py` times it."""
  if workload is None:
    from torch_cpu import TorchWorkload
    workload = TorchWorkload.resnet20()
  return workload


def check_k1_matches_bp(ticks: int = 3, batch_size: int = 8, tol: float = 1e-6,
                        workload=None) -> float:
  """With K=1, `ticks` ticks of FDG equal as many plain BP steps (same init, same batches):
  returns the largest absolute difference over the parameters and buffers, asserted <= tol."""
  w = _workload(workload)
  torch.manual_seed(0)
  bp_model = w.model()
  fdg_model = copy.deepcopy(bp_model)
  bp_opt = w.optimizer(bp_model.parameters())
  pipe = FDG(fdg_model, 1, w.optimizer, loss=w.loss)
  g = torch.Generator().manual_seed(1)
  for _ in range(ticks):
    x, y = w.batch(batch_size, g)
    bp_opt.zero_grad(set_to_none=True)
    w.loss(bp_model(x), y).backward()
    bp_opt.step()
    pipe.tick(x, y)
  bp_state, fdg_state = bp_model.state_dict(), fdg_model.state_dict()
  diff = max((bp_state[n].double() - fdg_state[n].double()).abs().max().item()
             for n in bp_state)
  assert diff <= tol, f"K=1 FDG differs from BP by {diff}"
  return diff


def check_k4_schedule(ticks: int = 10, batch_size: int = 8, workload=None) -> dict:
  """K=4 for `ticks` ticks: the loss is None while the pipeline fills and finite after; stage
  k first updates at tick K-1 + (K-1-k); at the end stage k holds 2(K-1-k) stashed forwards
  (the forwards between a batch's forward and its backward there, its gradient's staleness)."""
  w = _workload(workload)
  K = 4
  torch.manual_seed(0)
  pipe = FDG(w.model(), K, w.optimizer, bounds=w.bounds, loss=w.loss)
  g = torch.Generator().manual_seed(1)
  first_update, losses = [None] * K, []
  for t in range(ticks):
    x, y = w.batch(batch_size, g)
    loss = pipe.tick(x, y)
    losses.append(None if loss is None else loss.item())
    for k, s in enumerate(pipe.stages):
      if s.updates and first_update[k] is None:
        first_update[k] = t
  stash = [len(s.stash) for s in pipe.stages]
  assert all(v is None for v in losses[:K - 1]), losses
  assert all(v is not None and torch.isfinite(torch.tensor(v)) for v in losses[K - 1:]), losses
  assert first_update == [K - 1 + (K - 1 - k) for k in range(K)], first_update
  assert stash == [2 * (K - 1 - k) for k in range(K)], stash
  assert [s.updates for s in pipe.stages] == [ticks - f for f in first_update]
  return {"first_update": first_update, "stash": stash, "losses": losses,
          "layers": [len(s.module) for s in pipe.stages]}
