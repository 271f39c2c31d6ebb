"""Serving artifacts: their format and export, the publisher process, and the trainer's handle on it."""
