"""Checkpoints: the on-disk layout, staging, the background writer, cadence, and DCP save/load for ETTStrategy."""
