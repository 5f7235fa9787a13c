"""The kinds of collective communication: one enum for the cluster spec's per-kind link overrides
(`costmodel.hardware.network.CollectiveLink`) and the collective cost model (`costmodel.hardware.collectives`)."""

from __future__ import annotations

import enum


class Collective(enum.StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"
