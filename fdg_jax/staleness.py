"""The staleness toolkit under its first name: a thin module re-exporting `fdg_jax.optim`.

Kept so that `fdg_jax.staleness.error_feedback`, `staleness.recommend`,
`staleness.STUDY`, ... keep working. The code lives in the package, one concern a module:

- the delayed-transform protocol (`DelayedTransformation`, `with_forward`, `chain`):
  `fdg_jax.optim.delayed`;
- the remedies (`lr_by_delay`, `weight_prediction`, `spike_compensation`,
  `delay_compensation`, `nesterov_delay`, `error_feedback`, `discrepancy_correction`) and
  their states: `fdg_jax.optim.remedies`;
- the method registry (`METHODS`, `stage_optimizer`, `parse_methods`):
  `fdg_jax.optim.methods`;
- `staleness=auto` (`recommend`, `STUDY`, `Choice`, `Row`):
  `fdg_jax.optim.auto`;
- the delay-tolerant optimisers `basis_rotation` and `nadam_warmup`:
  `fdg_jax.optim.adaptive`.
"""

from fdg_jax.optim.adaptive import basis_rotation, nadam_warmup
from fdg_jax.optim.auto import STUDY, Choice, Row, recommend
from fdg_jax.optim.delayed import DelayedTransformation, chain, with_forward
from fdg_jax.optim.methods import METHODS, parse_methods, stage_optimizer
from fdg_jax.optim.remedies import (DelayCompensationState, DiscrepancyState,
                                    ErrorFeedbackState, LrByDelayState, NesterovDelayState,
                                    SpikeCompensationState, WeightPredictionState,
                                    delay_compensation, discrepancy_correction, error_feedback,
                                    lr_by_delay, nesterov_delay, spike_compensation,
                                    weight_prediction)

__all__ = [
    "Choice", "DelayCompensationState", "DelayedTransformation", "DiscrepancyState",
    "ErrorFeedbackState", "LrByDelayState", "METHODS", "NesterovDelayState", "Row", "STUDY",
    "SpikeCompensationState", "WeightPredictionState", "basis_rotation", "chain",
    "delay_compensation", "discrepancy_correction", "error_feedback", "lr_by_delay",
    "nadam_warmup", "nesterov_delay", "parse_methods", "recommend", "spike_compensation",
    "stage_optimizer", "weight_prediction", "with_forward",
]
