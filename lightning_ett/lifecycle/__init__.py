"""The job's processes: they die with the launcher, and faults injected into them for tests and benchmarks."""
