"""Shared test set-up.

XLA must see 8 host devices before jax is imported (the parallel/TP tests build meshes over them), so the flag is
set here, at the very top, before anything imports jax.
"""

import os

from tests.xla_env import xla_flags  # imports no jax

os.environ.setdefault("XLA_FLAGS", xla_flags(devices=8))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# No persistent compilation cache, the test servers' included (`dflash-jax serve` turns one on by default): writing
# every program costs more than the repeats save (a full run took 1915 s with one cache shared by the run, 1515 s
# with none).
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from dflash_jax.config import DrafterConfig, TargetConfig  # noqa: E402

# ------------------------------------------------------------------------------------------ tiny random configs
TINY_LLAMA = TargetConfig(
    arch="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    name="tiny-llama",
)

TINY_QWEN3 = dataclasses.replace(
    TINY_LLAMA,
    arch="qwen3",
    num_heads=4,
    num_kv_heads=1,
    head_dim=24,
    rope_theta=1e6,
    tie_word_embeddings=True,
    name="tiny-qwen3",
)


def tiny_drafter_config(tcfg: TargetConfig, **overrides) -> DrafterConfig:
    """A 2-layer drafter shaped for `tcfg` (its attention shape deliberately differs from the target's)."""
    base = DrafterConfig(
        hidden_size=tcfg.hidden_size,
        intermediate_size=80,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=tcfg.vocab_size,
        block_size=4,
        mask_token_id=tcfg.vocab_size - 1,
        target_layer_ids=(0, tcfg.num_layers - 2),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        layer_attn=((0, False), (0, False)),
        num_target_layers=tcfg.num_layers,
    )
    return dataclasses.replace(base, **overrides)


def make_target(cfg: TargetConfig, seed: int = 0, std: float = 0.2):
    """A random-weight TargetModel. std 0.2 (not the usual 0.02) keeps logits well separated, so greedy
    argmax never hinges on a float-rounding tie between two computations of the same math."""
    from dflash_jax.models.layers import RandomBuilder
    from dflash_jax.models.target import TargetModel

    return TargetModel(cfg, RandomBuilder(seed, std=std))


def make_drafter(dcfg: DrafterConfig, target_hidden: int, seed: int = 1, std: float = 0.2):
    from dflash_jax.models.drafter import DrafterModel
    from dflash_jax.models.layers import RandomBuilder

    return DrafterModel(dcfg, target_hidden, RandomBuilder(seed, std=std))


@pytest.fixture(autouse=True, scope="module")
def _release_programs_after_module():
    """Free each module's compiled programs when it ends. Every XLA:CPU executable maps a few code pages; a worker
    that keeps thousands of them alive reaches the kernel's limit on memory maps (vm.max_map_count, 65530 by
    default), and XLA's compiler then dies in mmap (SIGSEGV / SIGABRT) on whichever test compiles next."""
    yield
    from dflash_jax.compilation import release_programs

    release_programs()


@pytest.fixture
def highest_matmul_precision():
    """Every dot at full precision (IEEE f32 for f32 operands) for the test, whatever the process sets: on a GPU
    the default f32 dot is a TF32 one (~1e-3 relative error), which no f32 reference tolerance admits. A module
    of tests compared against f32 references names it in `pytestmark`."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="session")
def tiny_llama_cfg() -> TargetConfig:
    return TINY_LLAMA


@pytest.fixture(scope="session")
def tiny_qwen3_cfg() -> TargetConfig:
    return TINY_QWEN3


@pytest.fixture(scope="session")
def tiny_target(tiny_llama_cfg):
    """A random-weight tiny Llama target (shared: treat as read-only)."""
    return make_target(tiny_llama_cfg, seed=0)


@pytest.fixture(scope="session")
def tiny_drafter(tiny_llama_cfg):
    """A random-weight 2-layer drafter for `tiny_target` (shared: treat as read-only)."""
    return make_drafter(tiny_drafter_config(tiny_llama_cfg), tiny_llama_cfg.hidden_size, seed=1)


@pytest.fixture(scope="session")
def target_factory():
    """`target_factory(cfg, seed=0, std=0.2)` -> a random-weight TargetModel."""
    return make_target


@pytest.fixture(scope="session")
def drafter_factory():
    """`drafter_factory(tcfg, seed=1, std=0.2, **DrafterConfig overrides)` -> a random-weight DrafterModel."""

    def build(tcfg: TargetConfig, seed: int = 1, std: float = 0.2, **overrides):
        return make_drafter(tiny_drafter_config(tcfg, **overrides), tcfg.hidden_size, seed=seed, std=std)

    return build
