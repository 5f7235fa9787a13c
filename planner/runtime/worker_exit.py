"""How a rank of a torch.distributed job ends: all ranks quiet before the group is torn down, then the process
leaves without the interpreter's teardown.

That teardown can abort in torch's C++ threads after a correct run ("terminate called without an active
exception", SIGABRT: seen on gloo ranks after pipeline and FSDP work, here and in CI), and torchrun then kills
the other ranks and fails the launch. A rank whose results are out has nothing left to lose by skipping it.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import NoReturn


def quiesce() -> None:
    """Drop what still holds the process groups (pipeline schedules, FSDP states), then wait for every rank, so
    that no rank tears the group down while another still uses it. Call before `destroy_process_group`."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()


def exit_without_teardown(code: int) -> NoReturn:
    """End the process with `code` once its output is flushed, skipping the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
