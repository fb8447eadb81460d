"""Tools around a run; nothing in loopkit imports them.

* :mod:`loopkit.tools.aot`: compile a run's program ahead of time for a TPU
  topology (on CPU, through libtpu) and report its memory, FLOPs and time bound;
  :mod:`loopkit.tools.topology` names the chips and topologies.
* :mod:`loopkit.tools.tune`: measure and choose ``iterations_per_loop``
  (``python -m loopkit.tools.tune``).
* :mod:`loopkit.tools.follow`: evaluate each checkpoint of a training run once,
  beside it (``python -m loopkit.tools.follow``; :mod:`loopkit.tools.follower`).
* :mod:`loopkit.tools.testing`: fake CPU devices and real multi-process JAX runs
  on one machine (``python -m loopkit.tools.testing``).

Import the submodule you need (``from loopkit.tools import aot``).
"""
