"""torch.compile across restarts: persistent caches and their portable bundle, dynamic batch dimensions."""
