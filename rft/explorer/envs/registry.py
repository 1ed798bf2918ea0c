"""The environment registry, apart from the package that fills it: the built-ins (calculator.py,
grid_world.py) register into it, and rft/explorer/envs/__init__.py imports them, so neither
imports the other's importer."""

from rft.registry import Registry

ENVIRONMENTS = Registry("environment", params=("reset", "step"), is_class=True)
