"""XLA_FLAGS for the test process (conftest) and the processes tests start.

Without a GPU, XLA's LLVM back end compiles at -O0: the tests' programs are small and run briefly, so compiling
them is most of the run (-O0 took 21% off the wall time of the compile-heavy modules and 12% off the SmolLM2
parity modules).
"""

from __future__ import annotations

import os

CPU_ONLY = not os.path.exists("/dev/nvidiactl")


def xla_flags(devices: int = 1) -> str:
    """`devices` host devices (the flag only when more than one), at -O0 where there is no GPU."""
    flags = [f"--xla_force_host_platform_device_count={devices}"] if devices > 1 else []
    flags += ["--xla_backend_optimization_level=0"] if CPU_ONLY else []
    return " ".join(flags)
