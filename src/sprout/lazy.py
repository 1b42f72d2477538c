"""Packages that re-export their modules' names without importing every module up front.

`from sprout.sandbox import Store` still works; `import sprout.sandbox.backends` no longer imports the
store, its settings and podman's client with it. A command's parser is then built without importing the
library (`sprout --help` costs ~0.65 s of CPU, not ~1.3 s), and a process imports only what it runs."""

import importlib
from collections.abc import Callable


def exports(package: str, homes: dict[str, list[str]]) -> Callable[[str], object]:
    """A module `__getattr__` (PEP 562) for `package`: `homes` maps each submodule (relative, e.g.
    ".store") to the names it exports; a name is imported from its home when it is first used."""
    home_of = {name: module for module, names in homes.items() for name in names}
    clashes = sorted(set(home_of) & {module.lstrip(".") for module in homes})
    if clashes:  # importing the submodule binds its name in the package to the module, whatever was first
        raise ValueError(f"{package} cannot export {', '.join(clashes)} lazily: a submodule has that name")

    def __getattr__(name: str) -> object:
        if name not in home_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home_of[name], package), name)

    return __getattr__
