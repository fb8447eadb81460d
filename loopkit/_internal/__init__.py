"""Private helpers shared by every layer: argument checks, every private JAX or
Orbax API (``compat``, each behind a probe with a fallback), optional imports
(``extras``), the logging setup (``logs``) and mesh helpers (``mesh``). Not part
of the public API; imports nothing else from loopkit."""
