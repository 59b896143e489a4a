"""Multi-host start-up: `--coordinator-address HOST:PORT --num-processes N --process-id I`.

Every process calls `init_distributed` before touching any device; afterwards `jax.devices()` lists every process's
devices, so `make_mesh(world)` spans all of them. Every process then builds the same runner and runs the same
steps (multi-controller SPMD); only process 0 serves HTTP (`is_leader()`), the others follow its step sequence
(`multihost.follow`, started by `server.launch.serve_or_follow`).
On CPU the cross-process collectives are gloo (`jax_cpu_collectives_implementation`, JAX's default).
"""

from __future__ import annotations

import math

import jax

from dflash_jax.errors import UserError

FLAGS = ("--coordinator-address", "--num-processes", "--process-id")


def check_distributed_args(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Validate the three flags together. Returns True when multi-host is requested (all three given)."""
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if not any(given):
        return False
    if not all(given):
        missing = ", ".join(f for f, g in zip(FLAGS, given, strict=True) if not g)
        raise UserError(f"multi-host needs all of {', '.join(FLAGS)}; missing {missing}", param=FLAGS[0])
    host, sep, port = str(coordinator_address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--coordinator-address must be HOST:PORT, got {coordinator_address!r}", param=FLAGS[0])
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise UserError(f"--num-processes must be an integer >= 1, got {num_processes!r}", param=FLAGS[1])
    if isinstance(process_id, bool) or not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise UserError(
            f"--process-id must be in 0..{num_processes - 1} (--num-processes {num_processes}), got {process_id!r}",
            param=FLAGS[2],
        )
    return True


def init_distributed(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    local_device_ids: list[int] | None = None,
    timeout_s: float = 300,
) -> bool:
    """`jax.distributed.initialize` for the given flags (a no-op returning False when none is given).

    Process 0 hosts the coordinator at `coordinator_address`; the call blocks until all `num_processes` joined
    (or `timeout_s`). Must run before any other JAX call that touches devices."""
    if not check_distributed_args(coordinator_address, num_processes, process_id):
        return False
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=math.ceil(timeout_s),  # whole seconds
    )
    return True


def is_leader() -> bool:
    """True on the process that serves HTTP (process 0; also every single-process run)."""
    return jax.process_index() == 0


def world_size() -> int:
    """Devices over all processes (the mesh a multi-host `--tp-size` auto would span)."""
    return jax.device_count()
