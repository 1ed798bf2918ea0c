"""Tasksets and what chooses and cleans them before exploration: readers, cursors, selectors,
task operators (DESIGN.md section 8: data apart from experience, which lives in rft/buffer/)."""
