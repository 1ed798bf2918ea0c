"""`torch = lazy_module("torch")`: a module imported where it is first used, not where it is named.

The launcher imports the extension registries on the login node to check a config's names and
signatures (rft/config/plugin_checks.py), and never runs what they hold. The algorithm modules use
torch only inside their functions, yet importing it cost the launcher 2-2.5 s of its start on 2
cores (measured). Python 3.11's importlib.util.LazyLoader cannot stand in: a later plain
`import torch` anywhere reads the lazy module's __spec__, and that loads it.
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    """Stands for the module `name`; the first attribute read imports it and copies its names in,
    so later reads cost what a plain module's do."""

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        self.__dict__.update({k: v for k, v in vars(module).items() if k not in ("__name__", "__spec__", "__loader__")})
        return getattr(module, attr)


def lazy_module(name: str) -> Any:
    """A stand-in for `import name` (typed Any: it answers whatever the module has)."""
    return LazyModule(name)
