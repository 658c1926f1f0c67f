"""Integrations: the pytest plugin and its syrupy snapshots, CI reports (JUnit, GitHub annotations, cache keys),
batch runs and fan-out over Ray."""
