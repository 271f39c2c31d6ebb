"""``lightning run``: the command line, the elastic launcher, preloaded workers and fault injection."""
