"""`python -m rft.doctor [overrides]`: a preflight of this node for a run (rft/doctor/checks.py)."""
