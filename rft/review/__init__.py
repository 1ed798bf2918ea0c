"""Human review of rollouts: an on-disk queue the run fills (`queue.py`), a terminal UI a person
scores it with (`app.py`, `python -m rft.review RUN_DIR`), and the labels the trainer reads back."""
