"""Counting primitives in traced programs (the tests that check quantized matmuls reach the Pallas kernels)."""

from __future__ import annotations

import jax


def primitive_count(jaxpr, name: str) -> int:
    """Occurrences of primitive `name` in a jaxpr and every jaxpr nested in its equations (jit, shard_map, scan)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    n += primitive_count(sub.jaxpr, name)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    n += primitive_count(sub, name)
    return n


def pallas_calls(fn, *args) -> int:
    """`pallas_call`s in the program `fn(*args)` traces to (each kernel launch counted where it is traced)."""
    return primitive_count(jax.make_jaxpr(fn)(*args).jaxpr, "pallas_call")
