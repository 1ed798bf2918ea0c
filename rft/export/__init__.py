"""`python -m rft.export`: a run's sharded checkpoint as an HF model directory (rft/export/convert.py)."""
