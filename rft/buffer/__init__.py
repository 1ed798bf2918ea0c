"""Tasksets in, experience shards out: the data plane between explorers and trainers."""
