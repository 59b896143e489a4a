"""`StepPlan`: one jitted device step as host data (step kind, host numpy inputs, static arguments).

`SpecRunner` describes every jitted call it makes (prefill, propose, verify) as a plan and runs it with
`SpecRunner.apply_plan`. Multi-host serving (`spec_decode.multihost`) broadcasts rank 0's plans so every other rank
applies the very same sequence of steps, with the same shapes and inputs, to its own runner.

Wire format (`encode`/`decode`, no pickle): a little-endian u32 length, a JSON header
`{"kind", "static", "arrays": [[name, dtype, shape], ...]}`, then each array's raw C-order bytes in header order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

# Control plans of the multi-host channel (no device step).
NOOP = "noop"  # keep-alive: followers do nothing
SHUTDOWN = "shutdown"  # followers leave their loop

_STATIC_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class StepPlan:
    kind: str
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    static: Mapping[str, bool | int | float | str] = field(default_factory=dict)

    def encode(self) -> bytes:
        arrays = {k: np.ascontiguousarray(v) for k, v in self.arrays.items()}
        static = {}
        for k, v in self.static.items():
            v = v.item() if isinstance(v, np.generic) else v
            if not isinstance(v, _STATIC_TYPES):
                raise TypeError(f"step plan {self.kind!r}: static {k!r} must be bool/int/float/str, got {type(v)}")
            static[k] = v
        meta = {
            "kind": self.kind,
            "static": static,
            "arrays": [[k, v.dtype.str, list(v.shape)] for k, v in arrays.items()],
        }
        head = json.dumps(meta, separators=(",", ":")).encode()
        return b"".join([struct.pack("<I", len(head)), head, *(v.tobytes() for v in arrays.values())])

    @classmethod
    def decode(cls, data: bytes | memoryview) -> StepPlan:
        data = bytes(data)
        (n,) = struct.unpack_from("<I", data, 0)
        meta = json.loads(data[4 : 4 + n])
        off, arrays = 4 + n, {}
        for name, dtype_str, shape in meta["arrays"]:
            dtype = np.dtype(dtype_str)
            count = int(np.prod(shape, dtype=np.int64))
            arrays[name] = np.frombuffer(data, dtype, count=count, offset=off).reshape(shape).copy()
            off += count * dtype.itemsize
        if off != len(data):
            raise ValueError(f"step plan {meta['kind']!r}: {len(data) - off} trailing bytes")
        return cls(meta["kind"], arrays, meta["static"])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        mine, theirs = self.arrays, other.arrays
        return (
            self.kind == other.kind
            and dict(self.static) == dict(other.static)
            and list(mine) == list(theirs)
            and all(mine[k].dtype == theirs[k].dtype and np.array_equal(mine[k], theirs[k]) for k in mine)
        )

    __hash__ = None  # type: ignore[assignment]
