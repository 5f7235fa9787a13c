"""Searching again under a change: re-planning, what-if sweeps, group data parallelism over mixed device types."""
