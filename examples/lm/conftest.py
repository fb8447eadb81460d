"""pytest: ``main.py`` defines absl flags at import (also defined by other examples' ``main.py``),
so it is not collected as a doctest module; ``lm_test.py`` runs it in a subprocess."""

collect_ignore = ["main.py"]
