"""Multi-host step plans in one process: the wire format, the channel's framing, and a follower runner that
replays a leader runner's plans ending in the very same device state (the 2-process run is test_multihost_serve)."""

from __future__ import annotations

import queue

import jax
import numpy as np
import pytest

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import DrafterModel
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.models.target import TargetModel
from dflash_jax.spec_decode.multihost import FRAME_BYTES, Leader, PlanChannel, follow
from dflash_jax.spec_decode.plan import NOOP, SHUTDOWN, StepPlan
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.testing.waits import wait_until
from dflash_jax.types import SamplingParams

TCFG = TargetConfig(
    arch="llama",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    name="plan",
)
DCFG = DrafterConfig(
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    vocab_size=128,
    block_size=4,
    mask_token_id=127,
    target_layer_ids=(0, 1),
    layer_attn=((0, False),),
    num_target_layers=2,
)


def _pair_channels() -> tuple[PlanChannel, PlanChannel, list[int]]:
    """A leader and a follower channel joined by a queue (stands in for broadcast_one_to_all); also the sizes."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    sizes: list[int] = []

    def send(x: np.ndarray) -> np.ndarray:
        sizes.append(x.size)
        q.put(x.copy())
        return x

    def recv(x: np.ndarray) -> np.ndarray:
        got = q.get_nowait()
        assert got.shape == x.shape and got.dtype == x.dtype  # the follower must know every shape in advance
        return got

    return PlanChannel(send), PlanChannel(recv), sizes


def test_plan_round_trips_every_dtype_and_static():
    plan = StepPlan(
        "verify",
        {
            "slot_ids": np.arange(4, dtype=np.int32),
            "temperature": np.full(4, 0.5, np.float32),
            "seed": np.asarray([1, 2**32 - 1, 0, 7], np.uint32),
            "tokens": np.arange(12, dtype=np.int32).reshape(3, 4),
            "empty": np.zeros((0, 3)),
        },
        {"kv_len": np.int64(128), "width": 4, "greedy": True},
    )
    back = StepPlan.decode(plan.encode())
    assert back == plan and back.static == {"kv_len": 128, "width": 4, "greedy": True}
    assert back.arrays["tokens"].shape == (3, 4) and back.arrays["seed"].dtype == np.uint32
    with pytest.raises(TypeError, match="static 'x'"):
        StepPlan("verify", {}, {"x": [1]}).encode()


def test_channel_inlines_small_plans_and_pads_large_ones():
    lead, fol, sizes = _pair_channels()
    small = StepPlan("propose", {"slot_ids": np.arange(2, dtype=np.int32)}, {"kv_len": 128})
    big = StepPlan("prefill", {"tokens": np.arange(3000, dtype=np.int32)}, {"greedy": False})
    for p in (small, big, StepPlan(NOOP), StepPlan(SHUTDOWN)):
        lead.send(p)
    assert fol.recv() == small and fol.recv() == big
    assert fol.recv().kind == NOOP and fol.recv().kind == SHUTDOWN
    assert sizes == [FRAME_BYTES, FRAME_BYTES, 16384, FRAME_BYTES, FRAME_BYTES]  # 12 KB plan -> a 16 KiB body


def _runner() -> SpecRunner:
    target = TargetModel(TCFG, RandomBuilder(0, std=0.2))
    target.embed[...] = target.embed[...].at[:, 0].add(2.0)
    target.lm_head[...] = target.lm_head[...].at[0, 0].add(3.0)
    drafter = DrafterModel(DCFG, TCFG.hidden_size, RandomBuilder(1, std=0.2))
    return SpecRunner(target, drafter, max_slots=2, max_model_len=300, batch_buckets=(1, 2))


def test_follower_replays_leader_steps_to_the_same_device_state():
    lead_ch, fol_ch, sizes = _pair_channels()
    leader_runner, follower_runner = _runner(), _runner()
    leader = Leader(lead_ch, keepalive_s=None).attach(leader_runner)
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3)
    leader_runner.add_many([(0, [5, 9, 17], SamplingParams()), (1, list(range(1, 200)), sp)])  # a 2-frame prefill
    for k in (4, 1, 4):  # speculative, plain and speculative steps
        leader_runner.step([0, 1], {0: k, 1: k})
    leader_runner.release(1)
    leader_runner.step([0], {0: 4})
    leader.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        leader_runner.step([0], {0: 4})

    assert max(sizes) > FRAME_BYTES
    steps = follow(follower_runner, fol_ch)
    assert steps == leader.steps == 6  # one prefill, 4 steps (one call each) and the catch-up after the plain one
    assert not follower_runner.slots  # a follower keeps no host scheduling state
    for name in leader_runner.state._fields:  # caches, pending taps, slot state
        a, b = getattr(leader_runner.state, name), getattr(follower_runner.state, name)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def test_serve_config_checks_the_multihost_flags_together():
    from dflash_jax.errors import UserError
    from dflash_jax.server.config import build_serve_config

    cfg = build_serve_config({"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 1})
    assert (cfg.num_processes, cfg.process_id) == (2, 1)
    with pytest.raises(UserError, match=r"^--process-id must be in 0..1 \(--num-processes 2\), got 2$"):
        build_serve_config({"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 2})
    with pytest.raises(UserError, match=r"missing --coordinator-address"):
        build_serve_config({"num_processes": 2, "process_id": 0})


def test_idle_leader_sends_keepalives_that_followers_skip():
    lead_ch, fol_ch, sizes = _pair_channels()

    class _NoRunner:
        def apply_plan(self, plan):  # pragma: no cover - no step plan is sent
            raise AssertionError(plan)

    leader = Leader(lead_ch, keepalive_s=0.05).attach(_NoRunner())
    assert wait_until(lambda: len(sizes) >= 2)
    leader.shutdown()
    leader.shutdown()  # idempotent
    assert len(sizes) >= 3  # some keep-alives, then the shutdown
    assert follow(_NoRunner(), fol_ch) == 0
