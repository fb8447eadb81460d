"""The trainer kit: what a long run needs beyond the loop, each exact across K.

* :mod:`loopkit.training.plateau`: :class:`EarlyStopping` (stop when an evaluation metric
  stops improving, optionally handing back the best state) and :class:`ReduceLROnPlateau`
  (lower a learning rate held in the state);
* :mod:`loopkit.training.ema`: an exponential moving average of the parameters kept in the
  state, swapped in for evaluation;
* :mod:`loopkit.training.norms`: gradient, update and parameter norms as step metrics.

A wall-clock budget for a run is ``TrainLoop.run(..., max_time=...)``
(:mod:`loopkit.core.time_limit`). docs/operating.md ("Operating a long run") shows each.
"""

from loopkit.training import ema, norms
from loopkit.training.plateau import EARLY_STOPPED, EarlyStopping, ReduceLROnPlateau

__all__ = ["EARLY_STOPPED", "EarlyStopping", "ReduceLROnPlateau", "ema", "norms"]
