"""pytest: do not import ``main.py`` during doctest collection.

``main.py`` defines absl flags at import (``--workdir``/``--config``, also defined by other
examples' ``main.py``); ``digits_test.py`` runs it in a subprocess instead.
"""

collect_ignore = ["main.py"]
