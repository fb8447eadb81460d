"""Developer sessions: ``nox -s tests lint typecheck`` (also ``docs``, ``bench``).

Install nox with ``pip install -e '.[dev]'`` (or ``pipx install nox``). Every
session builds its own virtualenv under ``.nox/`` and installs loopkit in it.
``tests`` runs for each listed Python that is installed (3.11; 3.12 also
works); CI runs ``.ci/run`` instead (Python 3.11 on the pyproject floors, Python 3.12 on the
newest JAX without TensorFlow; see the README).
"""

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHONS = ["3.11", "3.12"]


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
  """The default test suite on 8 fake CPU devices (``-m 'not slow'``); extra args go to pytest."""
  session.install("-e", ".[test]")
  session.run("python", "-m", "pytest", "-q", "-m", "not slow", *session.posargs)


@nox.session(python=PYTHONS[0])
def tests_slow(session: nox.Session) -> None:
  """Only the slow tests (multi-process, full example runs)."""
  session.install("-e", ".[test]")
  session.run("python", "-m", "pytest", "-q", "-m", "slow", *session.posargs)


@nox.session(python=PYTHONS[0])
def lint(session: nox.Session) -> None:
  """ruff over the library, tests and examples (config in pyproject.toml)."""
  session.install("ruff>=0.17")
  session.run("ruff", "check", "loopkit", "tests", "examples", *session.posargs)


@nox.session(python=PYTHONS[0])
def typecheck(session: nox.Session) -> None:
  """mypy over the library, lenient: untyped third-party imports and Optional narrowing ignored."""
  session.install("-e", ".[checkpoint]", "mypy>=2.4")
  session.run("mypy", "--ignore-missing-imports", "--no-strict-optional",
              "--follow-imports=silent", "loopkit", *session.posargs)


@nox.session(python=PYTHONS[0])
def docs(session: nox.Session) -> None:
  """Builds the Sphinx docs in docs/ with warnings as errors."""
  session.install("-e", ".[docs]")
  session.run("sphinx-build", "-W", "docs", "docs/_build", *session.posargs)


@nox.session(python=PYTHONS[0])
def bench(session: nox.Session) -> None:
  """The benchmarks (benchmarks/run.py); extra args go to the script."""
  session.install("-e", ".[examples]")
  session.run("python", "benchmarks/run.py", *session.posargs)
