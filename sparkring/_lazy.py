"""Names a package exports but imports on first use (PEP 562 module __getattr__)."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Tuple


def lazy_exports(package: str, table: Dict[str, str], namespace: Dict[str, Any],
                 exported: List[str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """The package's ``__getattr__`` and ``__dir__``: ``table`` maps a name to the module that
    defines it (or, for a subpackage, to the subpackage itself), imported when the name is first
    read (then kept in ``namespace``).

    >>> __getattr__, __dir__ = lazy_exports(__name__, {"Store": "sparkring.data"}, globals(), __all__)  # doctest: +SKIP
    """

    def getattr_(name: str) -> Any:
        if name in table:
            module = importlib.import_module(table[name])
            # a subpackage is its own export: ``import sparkring as horovod; horovod.spark.run``
            value = module if table[name] == f"{package}.{name}" else getattr(module, name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> List[str]:
        return sorted(list(namespace) + exported)

    return getattr_, dir_
