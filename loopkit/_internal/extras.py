"""Optional dependencies: one door that imports them and names the extra to install.

loopkit's core needs only JAX and NumPy. Every other import goes through
:func:`require`, so a missing package fails with the ``pip install`` line
that brings it, not a bare ``ModuleNotFoundError``.

=================== =========================== ===================================
extra               packages                    needed by
=================== =========================== ===================================
``checkpoint``      orbax-checkpoint (+ etils)  :mod:`loopkit.checkpoint`
``data``            grain, tensorflow-datasets  Grain / TFDS helpers in :mod:`loopkit.data.sources`
``observability``   tensorboardX, tqdm,         ``TensorBoardWriter``, ``ProgressHook(bar=True)``,
                    matplotlib                  :mod:`loopkit.tools.tune` plots
``nnx``             flax, optax                 :mod:`loopkit.nnx`
``mlflow``          mlflow-skinny               ``loopkit.observe.MlflowWriter``
``wandb``           wandb                       ``loopkit.observe.WandbWriter``
=================== =========================== ===================================
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {  # top-level module -> (pip package, loopkit extra)
    "orbax": ("orbax-checkpoint", "checkpoint"),
    "etils": ("orbax-checkpoint", "checkpoint"),
    "grain": ("grain", "data"),
    "tensorflow_datasets": ("tensorflow-datasets", "data"),
    "tensorflow": ("tensorflow-cpu", "data"),
    "tensorboardX": ("tensorboardX", "observability"),
    "tqdm": ("tqdm", "observability"),
    "matplotlib": ("matplotlib", "observability"),
    "flax": ("flax", "nnx"),
    "optax": ("optax", "nnx"),
    "mlflow": ("mlflow-skinny", "mlflow"),
    "wandb": ("wandb", "wandb"),
}


def missing(error: ImportError, feature: str) -> ImportError:
  """An ImportError for ``feature`` naming the extra that provides the missing module.

  Args:
    error: the original ImportError (its ``name`` is the missing module).
    feature: what needed it, e.g. ``"loopkit.CheckpointHook"``.
  """
  top = (error.name or "").split(".")[0]
  package, extra = EXTRAS.get(top, (top or "?", None))
  hint = f"pip install 'loopkit[{extra}]'" if extra else f"pip install {package}"
  new = ImportError(f"{feature} needs {package} ({error.name} is not installed): {hint}",
                    name=error.name)
  new.__cause__ = error
  return new


def require(module: str, feature: str) -> ModuleType:
  """Imports ``module`` or raises :func:`missing`'s ImportError for ``feature``.

  Raises:
    ImportError: the module (or one it imports) is missing; the message names
      the extra, e.g. ``pip install 'loopkit[checkpoint]'``.
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise missing(e, feature) from e
