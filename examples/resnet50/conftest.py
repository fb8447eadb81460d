"""pytest: skip importing the command-line scripts during doctest collection.

``main.py`` defines absl flags at import (``--workdir``/``--config``, also
defined by other examples' ``main.py``) and ``gpu_bench.py`` is a script; both
are exercised by ``resnet50_test.py`` in subprocesses instead.
"""

collect_ignore = ["main.py", "gpu_bench.py"]
