"""Every benchmark of fdg_jax, behind one CLI: `python -m fdg_jax.bench COMMAND ...`.

  throughput, overhead, dispatch, memory, speedup, all   the schedules, one module each
                (`throughput`, `overhead`, `dispatch`, `memory`, `speedup`; what they share
                in `common` and `timing`; the command line in `cli`)
  concurrency   host dispatch vs device time per tick, overlap of the stages (`concurrency`)
  data          input pipeline images/s (`data`)
  processes     a pipeline across two processes: message and tick cost (`processes`)
  nested        backward convolutions at top level vs in a loop or switch (`nested`)

Results: JSON next to the printed tables (--out), written up in docs/notes.md.
"""

from fdg_jax.bench.cli import parse_args, run
from fdg_jax.bench.common import ALGORITHMS, POLICIES, PRESETS, TINY, build_model, build_stages
from fdg_jax.bench.speedup import predict

__all__ = ["ALGORITHMS", "POLICIES", "PRESETS", "TINY", "build_model", "build_stages",
           "parse_args", "predict", "run"]
