"""XLA temporary buffers of the dense-cache prefill of one 8192-token bucket (default model + drafter, f32); run
from a checkout of b000fbd, the last commit with dense per-slot caches. Output: dense_prefill_temp.json."""

import json

import numpy as np

from dflash_jax.builder import build_runner, load_models
from dflash_jax.spec_decode.sampling import SamplingArrays
from dflash_jax.types import MAX_ENDING_TOKENS

m = load_models("default", "default")
r = build_runner(m, max_slots=1, max_model_len=8192)
t = 8192
b = 1
sp = SamplingArrays(np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32), np.zeros(b, np.uint32))
low = r.programs.prefill.lower(
    r.weights,
    r.state,
    np.zeros(b, np.int32),
    np.ones((b, t), np.int32),
    np.full((b,), 6000, np.int32),
    sp,
    np.zeros(b, np.int32),
    np.full((b, MAX_ENDING_TOKENS), -1, np.int32),
    sampled=0,
    bans=False,
    logprobs=False,
    prompt_logprobs=False,
)
print(
    json.dumps({"dense_prefill_tokens": t, "xla_temp_mib": low.compile().memory_analysis().temp_size_in_bytes / 2**20})
)
