"""What a run reports: metrics.jsonl (and TensorBoard), the progress bar, console lines.

`MetricWriter` appends one JSON object per evaluation (or telemetry step) to
`<workdir>/metrics.jsonl`, dropping the rows past the step a resumed run restarts from, and
mirrors the numbers to TensorBoard where tensorboardX is installed; only process 0 writes.
"""

from __future__ import annotations

import json
import os

import jax

METRICS_FILE = "metrics.jsonl"


def log(msg: str) -> None:
  """A line on the console, at once (the progress bar and other processes interleave)."""
  print(msg, flush=True)


def run_label(config) -> str:
  """What the run trains, for its last line: "FDG K=4 beta=0.5 mlp on digits"."""
  label = f"{config.algorithm.upper()} K={config.num_stages}"
  if config.beta != 1.0:  # only a schedule that takes beta gets past validation with one
    label += f" beta={config.beta:g}"
  return f"{label} {config.model} on {config.dataset}"


def progress_bar(config, steps_per_epoch, step):
  """A bar over the current epoch (steps, loss, samples/s); None when disabled."""
  if not config.progress_bar:
    return None
  try:
    from tqdm import tqdm
  except ImportError:
    return None
  epoch = step // steps_per_epoch
  return tqdm(total=steps_per_epoch, initial=step % steps_per_epoch, unit="step",
              dynamic_ncols=True, disable=None, leave=True,
              desc=f"epoch {epoch + 1}/{config.num_epochs}")


def _rows_up_to(path: str, step: int) -> list[str]:
  """The lines of metrics.jsonl up to `step`. A last line cut mid-write (a full disk, a
  kill) is dropped with a line; an unreadable line before the last is a UserError."""
  from fdg_jax.config_check import UserError
  with open(path) as f:
    lines = [l if l.endswith("\n") else l + "\n" for l in f if l.strip()]
  keep = []
  for i, line in enumerate(lines):
    try:
      row = json.loads(line)
    except ValueError:
      if i == len(lines) - 1:
        log(f"dropped the last line of {path}, cut mid-write: {line.strip()[:60]!r}")
        break
      raise UserError(f"line {i + 1} of {path} is not JSON ({line.strip()[:60]!r}); mend or "
                      "delete that line, then resume") from None
    if row.get("step", 0) <= step:
      keep.append(line)
  return keep


class MetricWriter:
  """metrics.jsonl (one object per evaluation) and TensorBoard scalars."""

  def __init__(self, workdir: str, resume_step: int):
    self.path = os.path.join(workdir, METRICS_FILE)
    self.tb = None
    self.enabled = jax.process_index() == 0  # one writer in a multi-process run
    if not self.enabled:
      return
    # Drop records written after the checkpoint we resume from: they will be recomputed.
    if os.path.exists(self.path):
      keep = _rows_up_to(self.path, resume_step)
      tmp = self.path + ".tmp"
      with open(tmp, "w") as f:
        f.writelines(keep)
      os.replace(tmp, self.path)
    try:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    except ImportError:  # TensorBoard files are optional
      self.tb = None

  def write(self, record: dict) -> None:
    """Appends `record` to metrics.jsonl and its numbers to TensorBoard."""
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self.tb is not None:
      for k, v in record.items():
        if k not in ("step", "epoch") and isinstance(v, (int, float)):
          self.tb.add_scalar(k, v, record["step"])
        elif isinstance(v, list):  # per-stage values (telemetry): one scalar per stage
          for i, x in enumerate(v):
            if isinstance(x, (int, float)):
              self.tb.add_scalar(f"{k}/stage_{i}", x, record["step"])
      self.tb.flush()

  def close(self):
    """Closes the TensorBoard writer."""
    if self.tb is not None:
      self.tb.close()
