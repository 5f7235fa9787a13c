"""Measuring this machine: operators, collectives and framework overheads, into a profile the cost model reads."""
