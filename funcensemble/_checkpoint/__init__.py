"""Checkpoint files of ensembles and pytrees: safetensors, checksums, per-member state_dicts."""
