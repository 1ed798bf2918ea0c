"""The launcher's one rich Console: the progress bar and every message go through it, so that a
message printed while the bar is live does not tear it."""

from rich.console import Console

console = Console()
