"""Watching a running job from outside its training path: hangs (launcher side) and stragglers."""
