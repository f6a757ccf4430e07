"""A Python script run on every rank as ``__main__`` (run("train.py"), the CLI, TorchDistributor)."""
from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

from ...errors import ConfigurationError


class ScriptExit(SystemExit):
    """A script run on a rank exited with a non-zero status."""

    def __init__(self, code):
        super().__init__(code)
        self.exit_code = code if isinstance(code, int) else 1


class ScriptMain:
    """Runs a Python file as ``__main__`` with ``sys.argv``, the way ``python file.py`` would.

    >>> run(ScriptMain("train.py", ["--epochs", "2"]), num_proc=2)  # doctest: +SKIP
    """

    def __init__(self, path: str, argv: Sequence[str] = ()):
        self.path = os.path.abspath(path)
        self.argv = [str(a) for a in argv]
        try:
            with open(self.path) as f:  # fail on the driver, not on every rank
                f.read(1)
        except OSError as exc:
            raise ConfigurationError(f"script {path!r} cannot be read ({exc.strerror}): pass the path of a "
                                     "Python file that exists on the driver") from exc

    def __call__(self) -> int:
        """Run the script as __main__ with its arguments; its exit status."""
        sys.argv = [self.path] + self.argv
        sys.path.insert(0, os.path.dirname(self.path))
        try:
            runpy.run_path(self.path, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
                raise ScriptExit(exc.code) from None
        return 0
