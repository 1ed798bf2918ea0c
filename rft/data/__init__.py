"""Tasksets and what chooses and cleans them before exploration: readers, cursors, selectors,
task operators. Tasks (what to explore) live here, apart from experience (what exploring produced),
which lives in rft/buffer/."""
