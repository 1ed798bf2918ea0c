"""Imports the built-in trackers so that they register (rft/runtime/trackers/__init__.py)."""

from rft.runtime.trackers import mlflow_tracker, tensorboard_tracker, wandb_tracker  # noqa: F401
