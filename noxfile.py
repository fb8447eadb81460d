"""Developer sessions: ``nox -s tests lint typecheck`` (also ``tests_slow``, ``docs``, ``bench``).

Install nox with ``pip install -e '.[dev]'`` (or ``pipx install nox``). Every session builds its
own virtualenv under ``.nox/`` and installs loopkit in it. ``tests`` runs the README's test command
(``python -m pytest -q``, the default suite without the ``slow`` tests) for each listed Python that
is installed. CI runs ``bash .ci/run`` instead: that same pytest command on Python 3.11 with the
pyproject floors and on Python 3.12 with the newest JAX without TensorFlow, plus ``typecheck``'s
and ``docs``' commands as their own steps (see the README).
"""

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHONS = ["3.11", "3.12"]


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
  """The default test suite on 8 fake CPU devices (pyproject's addopts: ``-m 'not slow'``).

  Extra args go to pytest, e.g. ``nox -s tests -- -m 'slow or not slow'`` for every test.
  """
  session.install("-e", ".[test]")
  session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(python=PYTHONS[0])
def tests_slow(session: nox.Session) -> None:
  """Only the slow tests (multi-process, full example runs)."""
  session.install("-e", ".[test]")
  session.run("python", "-m", "pytest", "-q", "-m", "slow", *session.posargs)


@nox.session(python=PYTHONS[0])
def lint(session: nox.Session) -> None:
  """ruff over the library, tests, examples and benchmarks (config in pyproject.toml)."""
  session.install("ruff>=0.17")
  session.run("ruff", "check", "loopkit", "tests", "examples", "benchmarks", *session.posargs)


@nox.session(python=PYTHONS[0])
def typecheck(session: nox.Session) -> None:
  """mypy over loopkit/ with pyproject's [tool.mypy] options (strict optional), as CI runs it."""
  session.install("-e", ".[test,typecheck]")
  session.run("python", "-m", "mypy", "--no-incremental", *session.posargs)


@nox.session(python=PYTHONS[0])
def docs(session: nox.Session) -> None:
  """Builds the Sphinx docs into docs/_build/html, warnings as errors, and checks the pages."""
  session.install("-e", ".[docs]")
  session.run("python", ".ci/docs.py", "docs/_build/html", *session.posargs)


@nox.session(python=PYTHONS[0])
def bench(session: nox.Session) -> None:
  """The benchmarks (benchmarks/run.py); extra args go to the script."""
  session.install("-e", ".[examples]")
  session.run("python", "benchmarks/run.py", *session.posargs)
