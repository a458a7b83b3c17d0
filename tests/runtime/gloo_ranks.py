"""Two gloo ranks on this host for the distributed worker scripts of this folder: each rank's process group,
its result line, and the spawn of the ranks on a free port."""

from __future__ import annotations

import os
import socket
import sys
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def join(rank: int, world: int, port: int) -> None:
    """Join the gloo process group of `world` ranks on 127.0.0.1:`port`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def report(line: str) -> None:
    """Print `line` in one write: under PYTHONUNBUFFERED, print's text and its newline are two writes, which the
    other rank's line can land between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[[int, int, int], None], world: int = 2) -> None:
    """Run `worker(rank, world, port)` on `world` ranks forked from this process: they start with its imports
    (torch, transformers, memplan: 4-5 CPU-seconds a process) instead of importing them again, as spawned ranks
    do. Safe here: no CUDA, and one OpenMP thread (a forked child cannot use its parent's thread pool)."""
    mp.start_processes(worker, args=(world, free_port()), nprocs=world, start_method="fork")
