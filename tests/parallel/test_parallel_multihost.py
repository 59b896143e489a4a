"""Multi-host TP: 2 processes on localhost (CPU, gloo collectives, 2 devices each) form one 4-device mesh through
`jax.distributed.initialize` and decode the same greedy tokens as one process on one device.

Each worker runs this module as a script (`python test_parallel_multihost.py PID NPROC PORT`), so the model and
the decode loop are the very same code in the workers and in the in-process reference.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

# 8 query heads / 8 KV heads for the target and the drafter, so both split over the 4 ranks.
PROMPTS = ([7, 7, 2], [5, 9, 17, 3, 44])
STEPS = 4


def greedy_tokens(mesh) -> dict:
    """Greedy speculative decoding of PROMPTS with a tiny random target/drafter (TP over `mesh`, or none)."""
    from dflash_jax.config import DrafterConfig, TargetConfig
    from dflash_jax.models.drafter import DrafterModel
    from dflash_jax.models.layers import RandomBuilder
    from dflash_jax.models.target import TargetModel
    from dflash_jax.spec_decode.runner import SpecRunner
    from dflash_jax.types import SamplingParams

    tcfg = TargetConfig(
        arch="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=8,
        num_kv_heads=8,
        head_dim=8,
        name="mh",
    )
    dcfg = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=8,
        num_kv_heads=8,
        head_dim=8,
        vocab_size=128,
        block_size=4,
        mask_token_id=127,
        target_layer_ids=(0, 1),
        layer_attn=((0, False), (3, True), (0, False)),
        num_target_layers=3,
    )
    target = TargetModel(tcfg, RandomBuilder(0, std=0.2))
    target.embed[...] = target.embed[...].at[:, 0].add(2.0)  # lean towards token 0 so drafts get accepted
    target.lm_head[...] = target.lm_head[...].at[0, 0].add(3.0)
    drafter = DrafterModel(dcfg, tcfg.hidden_size, RandomBuilder(1, std=0.2))
    runner = SpecRunner(target, drafter, max_slots=2, max_model_len=40, batch_buckets=(2,), mesh=mesh)
    slots = list(range(len(PROMPTS)))
    res = runner.add_many([(s, list(PROMPTS[s]), SamplingParams()) for s in slots])
    toks = {str(s): list(res[s].tokens) for s in slots}
    accepted = []
    for _ in range(STEPS):
        out = runner.step(slots, {s: runner.gamma for s in slots})
        for s in slots:
            toks[str(s)] += out[s].tokens
        accepted.append([out[s].num_accepted for s in slots])
    return {"tokens": toks, "accepted": accepted, "draft_tp": runner.draft_tp}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_form_one_mesh_and_match_one_process(tmp_path):
    from dflash_jax.testing.waits import COMPILE_GUARD_S, communicate
    from tests.xla_env import xla_flags

    port = _free_port()
    env = dict(os.environ)
    env.update(XLA_FLAGS=xla_flags(devices=2), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(pid), "2", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for pid in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(communicate(p, COMPILE_GUARD_S))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
        line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    for r in results:
        assert r["devices"] == 4 and r["local_devices"] == 2 and r["mesh_processes"] == [0, 1]
        assert r["out"]["draft_tp"] == 4  # auto = the world size
    assert results[0]["out"]["tokens"] == results[1]["out"]["tokens"]

    ref = greedy_tokens(None)  # one process, one device, no mesh
    assert ref["draft_tp"] == 1
    assert max(max(a) for a in ref["accepted"]) > 0  # the drafts matter for the output
    assert results[0]["out"]["tokens"] == ref["tokens"]
    assert results[0]["out"]["accepted"] == ref["accepted"]


def _worker(pid: int, nproc: int, port: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dflash_jax.parallel.distributed import init_distributed
    from dflash_jax.testing.waits import COMPILE_GUARD_S

    init_distributed(f"127.0.0.1:{port}", nproc, pid, timeout_s=int(COMPILE_GUARD_S))
    import jax

    from dflash_jax.parallel.mesh import make_mesh

    mesh = make_mesh(jax.device_count(), num_heads=8, num_kv_heads=8)
    out = greedy_tokens(mesh)
    procs = sorted({d.process_index for d in mesh.devices.flat})
    print(
        "RESULT "
        + json.dumps(
            {
                "devices": jax.device_count(),
                "local_devices": jax.local_device_count(),
                "mesh_processes": procs,
                "out": out,
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
