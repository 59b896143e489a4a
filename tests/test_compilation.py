"""The compile accounting counts real XLA compiles and persistent-cache reads."""

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.compilation import CompileCounts, CompileMeter, compile_counts


def test_meter_counts_each_new_program_once():
    @jax.jit
    def f(x):
        return jnp.sin(x) * 3.0 + 1.0

    with CompileMeter() as m:
        f(np.ones((3,), np.float32))
        f(np.ones((3,), np.float32))  # same shape: no new program
        f(np.ones((5,), np.float32))  # new shape: a second program
    assert m.counts.programs == 2
    assert m.counts.seconds > 0
    with CompileMeter() as again:
        f(np.ones((5,), np.float32))
    assert again.counts.programs == 0


def test_counts_subtract_and_render():
    a = CompileCounts(5, 2.5, 1, 0.5)
    b = CompileCounts(2, 1.0, 0, 0.25)
    assert a - b == CompileCounts(3, 1.5, 1, 0.25)
    assert (a - b).summary() == "3 programs compiled in 1.5 s (1 read from the cache)"
    assert (a - b).as_dict()["programs_compiled"] == 3
    assert compile_counts().programs >= 0


def _memory_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_release_programs_frees_memoized_executables():
    """A memoized builder's compiled programs hold code mappings until `release_programs` drops them."""
    from dflash_jax.compilation import program_cache, release_programs

    @program_cache(maxsize=64)
    def builder(i: int):
        return jax.jit(lambda x: jnp.cos(x) @ x.T + i)

    release_programs()
    before = _memory_maps()
    for i in range(40):
        builder(i)(np.ones((4, 4), np.float32)).block_until_ready()
    held = _memory_maps()
    assert builder.cache_info().currsize == 40
    release_programs()
    assert builder.cache_info().currsize == 0
    freed = held - _memory_maps()
    assert held - before >= 40 and freed >= 0.8 * (held - before), (before, held, freed)


def test_cancel_background_compiles_drops_the_queued_compiles_only():
    """Compiles left in the background after `finish` are dropped by `cancel_background_compiles` unless they have
    started; the executables waited for are unaffected."""
    import threading

    from dflash_jax.compilation import Precompiler, cancel_background_compiles

    x = jax.ShapeDtypeStruct((3, 3), jnp.float32)
    fns = [jax.jit(lambda a, i=i: jnp.sin(a) * i) for i in range(4)]
    gate = threading.Event()
    with Precompiler(threads=1) as planner:
        planner.plan("first", fns[0], (x,), {})
        first = planner.finish()["first"]  # compiled and waited for
        blocker = planner._pool.submit(gate.wait)  # holds the one compile thread
        for i in (1, 2, 3):
            planner.plan(i, fns[i], (x,), {})
        left = planner.finish(wait=lambda key: False)
    assert first.ready and not any(e.ready for e in left.values())
    assert cancel_background_compiles() == 3
    gate.set()
    blocker.result(timeout=60)
    assert all(e._compiled.cancelled() for e in left.values())
    assert cancel_background_compiles() == 0
    np.testing.assert_allclose(first.compiled(np.ones((3, 3), np.float32)), np.zeros((3, 3)), atol=0)
