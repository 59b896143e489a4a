"""The GPU proof kit's driver (`benchmarks/gpu/run.sh --out DIR [--budget-s N] [--dry-run]`).

Five steps, each time-boxed, each but the first in its own Python process (a step that overruns its box is killed;
the JSON it last wrote stays):
  tests       the GPU test subset (pytest): passed/failed counts
  attention   the paged attention's XLA path and Pallas kernel on bf16 decode, verify and prefill cases of the 8B
              shape: the largest error against the f32 reference over its bound, wall and on-device time per call;
              then `paged_attention_bench.check_paths` (every path and tiling against the reference)
  decode      plain vs speculative decoding of the default model on the held-out prompts by batch size, and at one
              batch size with the Pallas kernel (tok/s, and whether its greedy output equals the XLA path's)
  cost        the Qwen3-8B-shaped random-weight cost table (`dflash_jax.bench.cost_table`)
  data_train  target-generated training data for as long as its share allows, continued training of the default
              drafter, the candidate exported, teacher-forced τ on held-out greedy responses for both drafters
The output files and their fields: `dflash_jax.bench.gpu_kit`. The run exits 0 whatever a step did; a failure is
recorded in summary.json with its error. `--dry-run`: tiny models and sizes, the whole run in about a minute on a
CPU.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dflash_jax.bench import gpu_kit as kit  # noqa: E402

GPU_TESTS = (
    "tests/kernels/test_matmul_kernels.py tests/quant/test_quant_linear.py tests/spec_decode/test_spec_parity.py "
    "tests/train/test_fast_generate.py tests/kernels/test_paged_attention.py tests/spec_decode/test_paged_runner.py"
)
DRY_TESTS = (
    "tests/train/test_fast_generate.py tests/kernels/test_paged_attention.py "
    "-k 'test_length_bucket or test_causal_bounds'"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/gpu/run.sh",
        description="The GPU proof kit: the GPU test subset, the paged attention kernel, plain vs speculative decode, "
        "the 8B-shaped cost table, drafter data and training, each time-boxed; at most 8 files in --out and a summary "
        "table.",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory (at most 8 files are written)")
    p.add_argument("--budget-s", type=float, default=None, help="whole-run time budget (default 420; dry run 600)")
    p.add_argument("--dry-run", action="store_true", help="tiny models and sizes (CPU, about a minute)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, f32 on CPU) | bfloat16 | float16 | float32")
    p.add_argument("--model", default="default", help="target of the decode and data steps (a .gguf, HF dir)")
    p.add_argument("--draft-model", default=None, help="drafter directory (default: the committed default drafter)")
    p.add_argument("--tests", default=None, help=f"pytest arguments of the test step (default: {GPU_TESTS})")
    p.add_argument("--decode-batches", default=None, help="batch sizes of the decode step (default 1,8,32)")
    p.add_argument(
        "--pallas-decode-batches",
        default=None,
        help="decode-step batch sizes also run with --attention-backend pallas, each one of --decode-batches "
        "(default 8 where --decode-batches has it)",
    )
    p.add_argument(
        "--attention-cases",
        default=None,
        help="BxTxKVLEN cases of the paged attention step (default "
        + ",".join("x".join(map(str, c)) for c in kit.ATTENTION_CASES)
        + ")",
    )
    p.add_argument(
        "--decode-prompts",
        type=int,
        default=None,
        help="held-out prompts per batch size, at least the batch (default 12)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request in the decode step (128)")
    p.add_argument("--cost-batches", default=None, help="batch sizes of the cost table (default 1,8,32,64)")
    p.add_argument("--gammas", default=None, help="verify widths of the cost table, e.g. 2-16 or 2,4,8,16")
    p.add_argument("--hbm-bandwidth", type=float, default=4.8e12, help="device memory bandwidth, B/s (H200)")
    p.add_argument("--kernel-backend", default="auto", help="quantized drafter matmuls: auto | xla | pallas")
    p.add_argument("--rows-per-shard", type=int, default=None, help="rows per generated data shard (1024)")
    p.add_argument("--self-prompt-fraction", type=float, default=0.75, help="share of prompts the target writes")
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch directory (data, checkpoints; default: OUT/../dflash-gpu-kit-work)",
    )
    p.add_argument("--part-mib", type=float, default=15.0, help="the candidate drafter's tar parts, MiB each")
    p.add_argument("--run-step", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ctx", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.budget_s is None:
        a.budget_s = 600.0 if a.dry_run else 420.0
    return a


def parse_ints(s: str, flag: str) -> tuple[int, ...]:
    out: list[int] = []
    try:
        for part in s.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise SystemExit(f"{flag}: expected integers like 1,8,32 or 2-16, got {s!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"{flag}: expected positive integers, got {s!r}")
    return tuple(out)


def parse_cases(s: str, flag: str) -> tuple[tuple[int, int, int], ...]:
    try:
        cases = tuple(tuple(int(x) for x in c.lower().split("x")) for c in s.split(",") if c.strip())
    except ValueError:
        raise SystemExit(f"{flag}: expected BxTxKVLEN items like 8x1x2048, got {s!r}") from None
    if not cases or any(len(c) != 3 or min(c) < 1 or c[2] % 16 for c in cases):
        raise SystemExit(f"{flag}: expected BxTxKVLEN items of positive integers, KVLEN a multiple of 16, got {s!r}")
    return cases


# ---------------------------------------------------------------------------------------------------- driver
def main(argv=None) -> int:
    a = parse_args(argv)
    if a.run_step:
        return run_step(a.run_step, json.loads(a.ctx.read_text()))
    decode_batches = parse_ints(a.decode_batches or ("1,2" if a.dry_run else "1,8,32"), "--decode-batches")
    if a.pallas_decode_batches is None:  # 8 (the dry run: 2) where the decode step runs it
        pallas_batches = tuple(b for b in ((2,) if a.dry_run else (8,)) if b in decode_batches)
    else:
        pallas_batches = parse_ints(a.pallas_decode_batches, "--pallas-decode-batches")
    if not set(pallas_batches) <= set(decode_batches):
        raise SystemExit(
            f"--pallas-decode-batches: each must be one of --decode-batches {decode_batches}, got {pallas_batches}"
        )
    attention_cases = kit.DRY_ATTENTION_CASES if a.dry_run else kit.ATTENTION_CASES
    if a.attention_cases:
        attention_cases = parse_cases(a.attention_cases, "--attention-cases")
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    for old in [*kit.FILES, *(p.name for p in out.glob(kit.CANDIDATE_PREFIX + "*"))]:  # one run's files only
        (out / old).unlink(missing_ok=True)
    work = a.work or out.resolve().parent / "dflash-gpu-kit-work"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    log_path = out / "run.log"
    log_f = log_path.open("a", buffering=1)

    def log(msg: str) -> None:
        line = f"[kit {time.time() - t_start:6.1f}s] {msg}"
        print(line, flush=True)
        log_f.write(line + "\n")

    budgets = kit.step_budgets(a.budget_s)
    ctx = {
        "dry_run": a.dry_run,
        "dtype": a.dtype,
        "model": a.model,
        "draft_model": a.draft_model,
        "decode_batches": decode_batches,
        "pallas_decode_batches": pallas_batches,
        "attention_cases": attention_cases,
        "decode_prompts": a.decode_prompts or (2 if a.dry_run else 12),
        "max_tokens": a.max_tokens or (8 if a.dry_run else 128),
        "cost_batches": parse_ints(a.cost_batches or ("1,2" if a.dry_run else "1,8,32,64"), "--cost-batches"),
        "gammas": parse_ints(a.gammas or ("2,16" if a.dry_run else "2-16"), "--gammas"),
        "hbm_bandwidth": a.hbm_bandwidth,
        "kernel_backend": a.kernel_backend,
        "rows_per_shard": a.rows_per_shard or (4 if a.dry_run else 1024),
        "self_prompt_fraction": a.self_prompt_fraction,
        "work": str(work),
        "out": str(out),
        "part_mib": a.part_mib,
        # sizes of the data and training step
        "data_shards": 2 if a.dry_run else 64,
        "max_prompt": 192 if a.dry_run else 128,  # the dry run's byte-level tokenizer spends one token per byte
        "max_new": 8 if a.dry_run else 256,
        "self_prompt_max": 8 if a.dry_run else 64,
        "train_batch": 4 if a.dry_run else 128,
        "train_anchors": 4 if a.dry_run else 64,
        "train_steps": 6 if a.dry_run else None,  # None: fitted to the time left
        "eval_max_new": 8 if a.dry_run else 128,
    }
    summary: dict = {
        "dry_run": a.dry_run,
        "budget_s": a.budget_s,
        "dtype": a.dtype,
        "settings": {k: v for k, v in ctx.items() if k not in ("work", "out")},
        "command": " ".join(shlex.quote(x) for x in sys.argv),
        "machine": {},
        "steps": {},
    }
    log(f"GPU proof kit: out {out}, work {work}, budget {a.budget_s:.0f} s ({'dry run' if a.dry_run else 'full'})")

    # a: the GPU test subset, in this process's child pytest
    t0 = time.time()
    tests_args = a.tests or (DRY_TESTS if a.dry_run else GPU_TESTS)
    summary["tests"], st = run_tests(tests_args, budgets["tests"], log_f, log)
    summary["steps"]["tests"] = {**st, "wall_s": time.time() - t0, "budget_s": budgets["tests"]}

    # b-e: one process per step
    for name in ("attention", "decode", "cost", "data_train"):
        t0 = time.time()
        st = run_child(name, ctx, budgets[name], work, log_f, log)
        summary["steps"][name] = {**st, "wall_s": time.time() - t0, "budget_s": budgets[name]}
        m = (kit.read_json(work / "machine.json") or {}) if not summary["machine"] else summary["machine"]
        summary["machine"] = m
        if name in kit.SUMMARY_STEPS:
            summary[name] = kit.read_json(step_path(name, ctx))
            if summary[name] is not None and st["timed_out"]:  # killed at its hard limit: what it had written
                summary[name]["timed_out"] = True

    decode = kit.read_json(out / "decode.json")
    cost = kit.read_json(out / "cost8b.json")
    data = kit.read_json(out / "data_train.json")
    if cost and cost.get("by_batch"):
        try:
            kit.plot_cost(cost, out / "cost.png")
        except Exception as e:  # noqa: BLE001 - the figure is optional; the JSON holds the numbers
            log(f"cost.png not written: {e!r}")
    summary["headline"] = kit.headline(decode, cost, data, summary.get("attention"))
    summary["wall_s"] = time.time() - t_start
    kit.write_json(out / "summary.json", summary)
    from rich.console import Console

    kit.print_summary(summary, decode, cost, Console(width=max(Console().width, 120)))
    with log_path.open("a") as f:  # the table in the log too
        kit.print_summary(summary, decode, cost, Console(file=f, width=140))
    log(f"done in {summary['wall_s']:.0f} s: {', '.join(sorted(p.name for p in out.iterdir()))}")
    log_f.close()
    return 0


def run_tests(args: str, budget: float, log_f, log) -> tuple[dict, dict]:
    """pytest with `args` (verbose, so a killed run still shows what passed); counts from its per-test lines."""
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-p", "no:cacheprovider", *shlex.split(args)]
    log(f"tests: {' '.join(cmd[1:])} (budget {budget:.0f} s)")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # f32 tests compare against f32 references
    timed_out, err = False, None
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        timed_out, rc = True, None
    except OSError as e:
        text, rc, err = "", None, repr(e)
    log_f.write(text)
    counts = {k: len(re.findall(rf"^\S+::\S.* {k.upper()}", text, re.M)) for k in ("passed", "failed", "skipped")}
    counts["errors"] = len(re.findall(r"^\S+::\S.* ERROR", text, re.M))
    if rc not in (0, 1, None) and err is None:  # 0: all passed, 1: some failed; else pytest itself broke
        err = f"pytest exited {rc}: " + text.strip().splitlines()[-1] if text.strip() else f"pytest exited {rc}"
    failed = [m for m in re.findall(r"^(\S+::\S+).* FAILED", text, re.M)]
    res = {**counts, "failed_tests": failed, "command": " ".join(cmd[1:]), "returncode": rc}
    log(f"tests: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors")
    status = "timed_out" if timed_out else ("failed" if err or counts["failed"] or counts["errors"] else "ok")
    return res, {"status": status, "timed_out": timed_out, "error": err}


def run_child(name: str, ctx: dict, budget: float, work: Path, log_f, log) -> dict:
    """Run step `name` in a child process with a soft deadline (the step's own) and a hard one (killed)."""
    cpath = work / f"ctx_{name}.json"
    if kit.STEP_FILES[name]:
        step_path(name, ctx).unlink(missing_ok=True)
    deadline = time.time() + budget
    kit.write_json(cpath, {**ctx, "deadline": deadline, "budget_s": budget})
    result_path = work / f"step_{name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", ctx["out"], "--run-step", name, "--ctx", str(cpath)]
    grace = min(30.0, max(10.0, 0.1 * budget))
    log(f"{name}: budget {budget:.0f} s (killed after {budget + grace:.0f} s)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    killed = False
    log_f.flush()
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        import threading

        def pump():
            for line in p.stdout:
                sys.stdout.write(line)
                log_f.write(line)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        try:
            p.wait(timeout=budget + grace)
        except subprocess.TimeoutExpired:
            killed = True
            p.kill()
            p.wait()
        th.join(timeout=5)
    res = kit.read_json(result_path) or {}
    if killed:
        log(f"{name}: killed at its hard limit; the output it last wrote is kept")
        return {"status": "timed_out", "timed_out": True, "error": f"killed after {budget + grace:.0f} s"}
    if not res:
        return {
            "status": "failed",
            "timed_out": False,
            "error": f"the step process exited {p.returncode} without a result (see run.log)",
        }
    return res


# ---------------------------------------------------------------------------------------------------- steps
def step_path(name: str, ctx: dict) -> Path:
    """Where step `name` writes its JSON: the output directory, or the scratch one for `kit.SUMMARY_STEPS`."""
    return Path(ctx["work"] if name in kit.SUMMARY_STEPS else ctx["out"]) / (kit.STEP_FILES[name] or "")


def run_step(name: str, ctx: dict) -> int:
    """In the child: run one step; record ok / timed_out / failed (with the error) for the driver."""
    work = Path(ctx["work"])
    res = {"status": "ok", "timed_out": False, "error": None}
    try:
        _setup_jax(work)
        out = STEP_FUNCS[name](ctx)
        res["timed_out"] = bool(out.get("timed_out"))
        res["status"] = "timed_out" if res["timed_out"] else "ok"
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        res.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000])
        path = step_path(name, ctx)
        partial = kit.read_json(path) if kit.STEP_FILES[name] else None
        if partial is not None:
            partial["error"] = res["error"]
            kit.write_json(path, partial)
    kit.write_json(work / f"step_{name}.json", res)
    return 0


def _setup_jax(work: Path) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", str(work / "jax_cache"))  # a second run compiles less
    from dflash_jax.bench.decode import machine_info

    if not (work / "machine.json").exists():
        info = machine_info()
        try:
            info["device_kind"] = jax.devices()[0].device_kind
        except Exception:  # noqa: BLE001
            pass
        kit.write_json(work / "machine.json", info)


def _log(msg: str) -> None:
    print(msg, flush=True)


def _dtype(ctx):
    from dflash_jax.builder import resolve_dtype

    return resolve_dtype(ctx["dtype"])


def _tiny_target(work: Path) -> Path:
    """The dry run's target: a tiny random Llama checkpoint with a byte-level tokenizer."""
    from tests.tinymodels import write_tiny_llama

    d = work / "tiny_target"
    if not (d / "config.json").exists():
        write_tiny_llama(d, hidden=64, layers=4, heads=4, kv_heads=2, inter=128)
    return d


def _target_spec(ctx) -> str:
    return str(_tiny_target(Path(ctx["work"]))) if ctx["dry_run"] else ctx["model"]


def _committed_drafter(ctx, lt) -> Path:
    """The drafter the data step continues: the committed default (dry run: a tiny random DFlash2 drafter)."""
    from dflash_jax.builder import DEFAULT_DRAFTER_DIR

    if not ctx["dry_run"]:
        return Path(ctx["draft_model"]) if ctx["draft_model"] else DEFAULT_DRAFTER_DIR
    import numpy as np

    from dflash_jax.checkpoints.export import export_drafter
    from dflash_jax.train.trainer import TrainConfig, init_drafter

    d = Path(ctx["work"]) / "tiny_committed_drafter"
    if not (d / "config.json").exists():
        tc = TrainConfig(
            num_layers=1, block_size=4, target_layer_ids=(1, 2), mask_token_id=3, arch="dflash2", selector_rank=8
        )
        export_drafter(init_drafter(lt.cfg, tc), d, lt.cfg.num_layers, dtype=np.float32)
    return d


ATTENTION_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 16}  # Qwen3-8B's attention
DRY_ATTENTION_SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16, "page_size": 16}
ATTENTION_BACKENDS = ("xla", "pallas")


def step_attention(ctx: dict) -> dict:
    """The paged attention (`kernels.paged_attention`) in bf16 on each case of `ctx["attention_cases"]`: a shuffled
    page pool of standard normal keys and values drawn on the device (`paged_case`), queries at the last T
    positions of each row (causal).

    Per case and backend: the largest |out - ref| against the f32 reference on the same bf16 inputs, and its
    ratio to the elementwise bound 2^-8 (|ref| + Σ p |v|) (Σ p |v|: the reference over |v|). The scores are
    exact products summed in f32 on every path; rounding the probabilities to bf16 moves the output by at most
    2^-9 Σ p |v| and rounding the output by 2^-9 |ref|, so a correct kernel stays within half the bound, while a
    wrong page, mask or normalisation is off by about |ref|. `ok`: ratio <= 1. Then
    `paged_attention_bench.check_paths` (both backends, three Pallas tilings, ragged rows, a sliding window, the
    lse; the dry run: one case, bf16, the table's tiling), then per case the on-device microseconds per call
    (`*_dev_us`: chained calls in one jitted loop). The Pallas kernel is compiled on a GPU and interpreted
    elsewhere (where its times mean nothing). A failure is recorded in its case; the step goes on."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.kernels import paged_attention_bench as pab
    from dflash_jax.kernels.bench import device_time_us
    from dflash_jax.kernels.paged_attention import paged_attention

    path = step_path("attention", ctx)
    dry = ctx["dry_run"]
    interpret = jax.default_backend() != "gpu"
    shape = DRY_ATTENTION_SHAPE if dry else ATTENTION_SHAPE
    repeats, iters = (2, 2) if dry else (20, 50)
    res: dict = {
        "platform": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "shape": shape,
        "dtype": "bfloat16",
        "pallas_interpret": interpret,
        "bound": "2^-8 (|ref| + Σ p |v|) elementwise, ref = the f32 reference on the same bf16 inputs",
        "repeats": repeats,
        "device_iters": iters,
        "cases": [],
        "check": None,
        "check_disagreements": None,
        "timed_out": False,
    }
    kit.write_json(path, res)
    deadline = ctx["deadline"] - 2
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    kept = []  # (record, q, paged operands, backends that ran) for the on-device pass
    for b, t, kv_len in ctx["attention_cases"]:
        if time.time() > deadline:
            res["timed_out"] = True
            break
        rec: dict = {"b": b, "t": t, "kv_len": kv_len, "dtype": "bfloat16", "ok": False}
        for be in ATTENTION_BACKENDS:
            rec |= {f"{be}_{k}": None for k in ("ok", "max_abs_err", "err_over_bound", "ms", "median_ms", "dev_us")}
        rec["pallas_over_xla"] = None
        res["cases"].append(rec)
        try:
            q, kp, vp, table, lo, hi = paged_case(b, t, kv_len, **shape, seed=b + t)
            ops = (kp, vp, table, lo, hi)
            ref = paged_attention(f32(q), f32(kp), f32(vp), table, lo, hi, kv_len=kv_len, backend="reference")
            mag = paged_attention(f32(q), f32(kp), jnp.abs(f32(vp)), table, lo, hi, kv_len=kv_len, backend="reference")
            bound = jnp.maximum(2.0**-8 * (jnp.abs(ref) + mag), jnp.finfo(jnp.float32).tiny)
            rec["max_abs_ref"] = float(jnp.max(jnp.abs(ref)))
            del mag
            fns, ran = [], []
            for be in ATTENTION_BACKENDS:
                fn = functools.partial(
                    paged_attention, kv_len=kv_len, backend=be, interpret=interpret and be == "pallas"
                )
                try:
                    err = jnp.abs(f32(fn(q, *ops)) - ref)
                    rec[f"{be}_max_abs_err"] = float(jnp.max(err))
                    rec[f"{be}_err_over_bound"] = ratio = float(jnp.max(err / bound))
                    rec[f"{be}_ok"] = bool(ratio <= 1.0)  # False for NaN
                    fns.append((be, fn))
                except Exception as e:  # noqa: BLE001 - recorded; the other backend and cases go on
                    rec[f"{be}_error"] = f"{type(e).__name__}: {e}"[:2000]
                    rec[f"{be}_ok"] = False
            del ref, bound
            times = pab.time_all([(fn, (q, *ops)) for _, fn in fns], repeats)
            for (be, _), (t_min, t_med) in zip(fns, times, strict=True):
                rec[f"{be}_ms"], rec[f"{be}_median_ms"] = t_min, t_med
                ran.append(be)
            if rec["xla_ms"] and rec["pallas_ms"]:
                rec["pallas_over_xla"] = rec["pallas_ms"] / rec["xla_ms"]
            rec["ok"] = all(rec[f"{be}_ok"] for be in ATTENTION_BACKENDS)
            kept.append((rec, q, ops, ran))
        except Exception as e:  # noqa: BLE001 - the case's error is recorded, the next case runs
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        _log(f"attention: {_attention_line(rec)}")
        kit.write_json(path, res)
    if time.time() < deadline:
        narrow = {"cases": ((2, 5, 64, 24),), "dtypes": (jnp.bfloat16,), "tiles": (None,)} if dry else {}
        res["check"] = pab.check_paths(interpret=interpret, **narrow)
        res["check_disagreements"] = sum(not r["ok"] for r in res["check"])
        _log(f"attention: path check, {len(res['check'])} paths, {res['check_disagreements']} disagreements")
        for r in res["check"]:
            if not r["ok"]:
                _log(f"attention: path check disagreement {json.dumps(r)[:600]}")
        kit.write_json(path, res)
    else:
        res["timed_out"] = True
    for rec, q, ops, ran in kept:
        if time.time() > deadline:
            res["timed_out"] = True
            break
        for be in ran:
            fn = lambda q, rest, kv_len=rec["kv_len"], be=be: paged_attention(  # noqa: E731
                q, *rest, kv_len=kv_len, backend=be, interpret=interpret and be == "pallas"
            )
            try:
                rec[f"{be}_dev_us"] = device_time_us(fn, q, ops, iters=iters, repeats=min(repeats, 5), touch_w=False)
            except Exception as e:  # noqa: BLE001
                rec[f"{be}_dev_error"] = f"{type(e).__name__}: {e}"[:2000]
        _log(
            f"attention: B={rec['b']} T={rec['t']} kv_len={rec['kv_len']} on device: "
            + ", ".join(f"{be} {_f1(rec[f'{be}_dev_us'])} us" for be in ran)
        )
        kit.write_json(path, res)
    kit.write_json(path, res)
    return res


def paged_case(b: int, t: int, kv_len: int, *, heads: int, kv_heads: int, head_dim: int, page_size: int, seed: int):
    """bf16 (q, k_pages, v_pages, table, lo, hi) as `paged_attention_bench.make_case` lays them out (physical
    pages 1..B*n in a random order, page 0 the null page), drawn on the device: seconds less per case on the host
    at 32 x 8K keys."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
    def draw(b, t, kv_len, heads, kv_heads, head_dim, page_size, key):
        n = kv_len // page_size
        kt, kk, kv, kq = jax.random.split(key, 4)
        table = (jax.random.permutation(kt, b * n) + 1).reshape(b, n).astype(jnp.int32)
        pool = (b * n + 1, kv_heads, page_size, head_dim)
        k_pages = jax.random.normal(kk, pool, jnp.bfloat16).at[0].set(0)
        v_pages = jax.random.normal(kv, pool, jnp.bfloat16).at[0].set(0)
        q = jax.random.normal(kq, (b, t, heads, head_dim), jnp.bfloat16)
        hi = jnp.broadcast_to(kv_len - t + 1 + jnp.arange(t, dtype=jnp.int32), (b, t))
        return q, k_pages, v_pages, table, jnp.zeros_like(hi), hi

    return draw(b, t, kv_len, heads, kv_heads, head_dim, page_size, jax.random.key(seed))


def _f1(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def _attention_line(r: dict) -> str:
    if "error" in r:
        return f"B={r['b']} T={r['t']} kv_len={r['kv_len']}: {r['error'][:300]}"
    parts = [f"B={r['b']} T={r['t']} kv_len={r['kv_len']} {r['dtype']}"]
    for be in ATTENTION_BACKENDS:
        if r.get(f"{be}_error"):
            parts.append(f"{be} ERROR {r[f'{be}_error'][:300]}")
        else:
            parts.append(
                f"{be} {'ok' if r[f'{be}_ok'] else 'FAIL'} (err {r[f'{be}_max_abs_err']:.2e}, "
                f"{r[f'{be}_err_over_bound']:.2f} of its bound) {r[f'{be}_ms']:.3f} ms"
            )
    return ", ".join(parts)


def step_decode(ctx: dict) -> dict:
    from dflash_jax.bench.decode import bench_decode
    from dflash_jax.bench.prompts import load_prompt_file
    from dflash_jax.builder import DEFAULT_DRAFTER_DIR, load_models, make_controller

    path = Path(ctx["out"]) / "decode.json"
    dtype = _dtype(ctx)
    draft = "random:1" if ctx["dry_run"] else (ctx["draft_model"] or str(DEFAULT_DRAFTER_DIR))
    models = load_models(_target_spec(ctx), draft, dtype, "declared", ctx["kernel_backend"])
    res = {
        "model": models.target.model_id,
        "draft_model": draft,
        "dtype": str(models.target.model.embed[...].dtype),
        "max_tokens": ctx["max_tokens"],
        "runs": [],
        "pallas_runs": [],
        "timed_out": False,
    }
    kit.write_json(path, res)
    heldout = load_prompt_file(None)
    last = 0.0
    # every batch with the XLA attention; right after one of `pallas_decode_batches`, the same with Pallas
    plan = [(b, be) for b in ctx["decode_batches"] for be in ATTENTION_BACKENDS]
    plan = [(b, be) for b, be in plan if be == "xla" or b in ctx["pallas_decode_batches"]]
    xla_runs: dict[int, dict] = {}
    for b, backend in plan:
        if time.time() + last > ctx["deadline"]:  # a larger batch takes at least as long as the last one did
            res["timed_out"] = True
            break
        t0 = time.time()
        n = max(b, ctx["decode_prompts"])
        prompts = (heldout * (n // len(heldout) + 1))[:n]
        _log(f"decode: batch {b}, {n} prompts, {ctx['max_tokens']} tokens, attention {backend}")
        try:
            r = bench_decode(
                models,
                prompts,
                batch_size=b,
                max_tokens=ctx["max_tokens"],
                make_controller=lambda: make_controller(models.drafter),
                draft_model_id=draft,
                log=_log,
                runner_kwargs={"attention_backend": backend},
            )
        except Exception as e:
            if backend == "xla":
                raise
            traceback.print_exc()  # a Pallas failure is a finding of its own: recorded, the XLA runs go on
            res["pallas_runs"].append({"batch_size": b, "attention_backend": backend, "error": repr(e)[:2000]})
            kit.write_json(path, res)
            last = time.time() - t0
            continue
        r.pop("machine", None)
        r["num_prompts"] = n
        r["attention_backend"] = backend
        if backend == "xla":
            xla_runs[b] = r
            res["runs"].append(r)
        else:
            x = xla_runs[b]
            r["plain_outputs_equal_xla"] = r["plain_outputs_sha256"] == x["plain_outputs_sha256"]
            r["spec_outputs_equal_xla"] = r["outputs_sha256"] == x["outputs_sha256"]
            r["outputs_equal_xla"] = r["plain_outputs_equal_xla"] and r["spec_outputs_equal_xla"]
            r["plain_tokens_per_s_xla"] = x["plain_tokens_per_s"]
            r["spec_tokens_per_s_xla"] = x["spec_tokens_per_s"]
            res["pallas_runs"].append(r)
        last = time.time() - t0
        same = f", equal to the xla run {r['outputs_equal_xla']}" if backend != "xla" else ""
        _log(
            f"decode batch {b} ({backend}): plain {r['plain_tokens_per_s']:.1f} tok/s, spec "
            f"{r['spec_tokens_per_s']:.1f} tok/s, speedup {r['speedup']:.2f}, τ {r['tau_mean']:.2f}, identical "
            f"{r['outputs_identical']}{same}"
        )
        kit.write_json(path, res)
    kit.write_json(path, res)
    return res


def step_cost(ctx: dict) -> dict:
    from dflash_jax.bench.cost_table import QWEN3_8B, TINY_QWEN3, measure_cost_table
    from dflash_jax.quant import resolve_kernel_backend

    path = Path(ctx["out"]) / "cost8b.json"
    dry = ctx["dry_run"]
    return measure_cost_table(
        TINY_QWEN3 if dry else QWEN3_8B,
        dtype=_dtype(ctx),
        batches=tuple(ctx["cost_batches"]),
        gammas=tuple(ctx["gammas"]),
        draft_layers=5,
        block_size=16,
        prompt_len=64,
        steps=2 if dry else 8,
        tier_batches=(1,) if dry else (1, 8),
        kernel_backend=resolve_kernel_backend(ctx["kernel_backend"]),
        hbm_bytes_per_s=ctx["hbm_bandwidth"],
        deadline=ctx["deadline"] - 5,
        on_update=lambda r: kit.write_json(path, r),
        log=_log,
    )


def step_data_train(ctx: dict) -> dict:
    import numpy as np

    from dflash_jax.bench.prompts import heldout_user_messages
    from dflash_jax.checkpoints.drafter import load_drafter
    from dflash_jax.checkpoints.export import export_drafter
    from dflash_jax.checkpoints.hub import resolve_model_dir
    from dflash_jax.checkpoints.loader import load_target
    from dflash_jax.train.data import DataConfig, build_dataset, load_shards
    from dflash_jax.train.trainer import ShardData, TrainConfig, train

    t_begin = time.time()
    work = Path(ctx["work"])
    path = Path(ctx["out"]) / "data_train.json"
    budget = ctx["deadline"] - t_begin
    res: dict = {"timed_out": False}
    kit.write_json(path, res)
    src = resolve_model_dir(_target_spec(ctx), "--model")
    lt = load_target(src, _dtype(ctx))  # generation: the target in the run's dtype
    lt32 = load_target(src)  # training and evaluation: f32, as `train drafter` runs
    committed = _committed_drafter(ctx, lt32)
    dcfg = load_drafter(committed, lt32.cfg).cfg
    # --- data
    data_dir = work / "data"
    if data_dir.exists():
        import shutil

        shutil.rmtree(data_dir)
    cfg = DataConfig(
        taps=tuple(dcfg.target_layer_ids),
        num_shards=ctx["data_shards"],
        rows_per_shard=ctx["rows_per_shard"],
        max_prompt=ctx["max_prompt"],
        max_new=ctx["max_new"],
        sampled_fraction=0.25,
        seed=11,
        store_taps=False,
        self_prompt_fraction=ctx["self_prompt_fraction"],
        self_prompt_max=ctx["self_prompt_max"],
    )
    gen_s = 0.45 * budget
    shard_t: list[float] = []
    total = [0]
    t0 = time.time()

    def progress(s, n, skipped, tokens=0):
        total[0] += tokens
        shard_t.append(time.time() - t0)
        _log(f"data: shard {s + 1}/{n}, {total[0]} response tokens, {shard_t[-1]:.1f} s")

    build_dataset(lt, cfg, data_dir, progress, max_seconds=gen_s, exclude=heldout_user_messages())
    gen_wall = time.time() - t0
    shards = load_shards(data_dir)
    seqs = len(shards) * cfg.rows_per_shard
    steady = (len(shards) - 1) * cfg.rows_per_shard / (shard_t[-1] - shard_t[0]) * 60 if len(shard_t) > 1 else None
    res["data"] = {
        "sequences": seqs,
        "response_tokens": total[0],
        "shards": len(shards),
        "seconds": gen_wall,
        "sequences_per_minute": seqs / gen_wall * 60,
        "sequences_per_minute_after_first_shard": steady,
        "response_tokens_per_s": total[0] / gen_wall,
        "dtype": str(lt.model.embed[...].dtype),
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
    }
    _log(f"data: {seqs} sequences in {gen_wall:.1f} s ({res['data']['sequences_per_minute']:.0f} per minute)")
    kit.write_json(path, res)
    del lt
    # --- training (continues the committed drafter)
    eval_reserve = 0.2 * budget
    train_s = max(ctx["deadline"] - time.time() - eval_reserve, 5.0)
    tc = TrainConfig(
        num_layers=dcfg.num_layers,
        block_size=dcfg.block_size,
        target_layer_ids=tuple(dcfg.target_layer_ids),
        mask_token_id=dcfg.mask_token_id,
        num_anchors=ctx["train_anchors"],
        batch_size=ctx["train_batch"],
        steps=ctx["train_steps"] or 100_000,
        lr=6e-4,
        warmup_steps=2 if ctx["train_steps"] else 30,
        arch=dcfg.arch,
        conv_group_size=getattr(dcfg, "conv_group_size", 16),
        selector_rank=getattr(dcfg, "selector_rank", 256) or 256,
        selector_top_k=getattr(dcfg, "selector_top_k", 16) or 16,
        time_budget=0.0 if ctx["train_steps"] else train_s,
        save_every=1_000_000,
        log_every=2 if ctx["train_steps"] else 10,
        init_from=str(committed),
        seed=11,
    )
    run_dir = work / "train"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    t0 = time.time()
    model, history = train(
        lt32.cfg,
        lt32.model.embed[...],
        lt32.model.lm_head[...],
        ShardData(shards),
        tc,
        run_dir,
        final_norm=lt32.model.norm[...],
        target=lt32.model,
        on_log=lambda r: _log(f"train: step {r['step']} loss {r['loss']:.3f} τ {r['tau']:.2f}"),
    )
    last = history[-1] if history else {}
    res["train"] = {
        "steps": int(last.get("step", 0)),
        "seconds": time.time() - t0,
        "s_per_step": last.get("s_per_step"),
        "final_loss": last.get("loss"),
        "final_tau_train": last.get("tau"),
        "budget_s": train_s,
        "config": {k: getattr(tc, k) for k in tc.__dataclass_fields__},
    }
    kit.write_json(path, res)
    cand = work / "candidate_drafter"
    export_drafter(model, cand, lt32.cfg.num_layers, dtype=np.float16)
    res["candidate"] = write_candidate_parts(cand, Path(ctx["out"]), ctx["part_mib"])
    kit.write_json(path, res)
    # --- held-out τ of both drafters
    res["eval"] = heldout_tau(lt32, {"committed": committed, "candidate": cand}, max_new=ctx["eval_max_new"])
    _log(f"eval: committed τ {res['eval']['committed_tau']:.3f}, candidate τ {res['eval']['candidate_tau']:.3f}")
    res["timed_out"] = time.time() > ctx["deadline"]
    kit.write_json(path, res)
    return res


def write_candidate_parts(src: Path, out: Path, part_mib: float) -> dict:
    """The drafter directory as one uncompressed tar, split into `candidate_drafter.tar.NN` files of at most
    `part_mib` MiB (`cat candidate_drafter.tar.* | tar -x` restores it)."""
    for old in out.glob(kit.CANDIDATE_PREFIX + "*"):
        old.unlink()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(src, arcname="candidate_drafter")
    data = buf.getvalue()
    size = max(int(part_mib * 2**20), 1)
    files = []
    for i in range(0, len(data), size):
        name = f"{kit.CANDIDATE_PREFIX}{i // size:02d}"
        (out / name).write_bytes(data[i : i + size])
        files.append(name)
    return {"files": files, "bytes": len(data), "restore": "cat candidate_drafter.tar.* | tar -x"}


def heldout_tau(lt, drafters: dict[str, Path], *, max_new: int, anchors: int = 24, batch: int = 8) -> dict:
    """Teacher-forced τ (as `benchmarks/teacher_forced_eval.py`: the training loss's own forward, f32 LM head) of
    each drafter on the target's greedy responses to the held-out prompts (the same random anchors for all)."""
    from functools import partial

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash_jax.bench.prompts import encode_prompts, load_prompt_file
    from dflash_jax.checkpoints.drafter import load_drafter
    from dflash_jax.train.data import DataConfig, generate_shard
    from dflash_jax.train.losses import sample_anchors, teacher_forced_tau
    from dflash_jax.train.trainer import TrainConfig, drafter_loss

    prompts = encode_prompts(lt.tokenizer, load_prompt_file(None))
    out: dict = {"method": "teacher-forced τ on greedy responses to the held-out prompts", "max_new": max_new}
    d = None
    for name, path in drafters.items():
        drafter = load_drafter(path, lt.cfg)
        cfg = drafter.cfg
        if d is None:
            dc = DataConfig(
                taps=tuple(cfg.target_layer_ids),
                max_prompt=max(map(len, prompts)),
                max_new=max_new,
                sampled_fraction=0.0,
            )
            d = generate_shard(lt, dc, prompts, 0)
        tc = TrainConfig(
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            target_layer_ids=cfg.target_layer_ids,
            mask_token_id=cfg.mask_token_id,
            num_anchors=anchors,
            arch=cfg.arch,
            ce_dtype="float32",
        )

        graphdef, dstate = nnx.split(drafter)

        @partial(jax.jit, static_argnums=0)
        def stats(graphdef, dstate, embed, head, b, tc=tc):  # weights as arguments, not constants of the program
            _, (_, valid, correct, _) = drafter_loss(nnx.merge(graphdef, dstate), embed, head, b, tc)
            c3 = correct.reshape(-1, anchors, tc.block_size - 1)
            v3 = valid.reshape(-1, anchors, tc.block_size - 1)
            kept = jnp.sum(v3[..., 0])
            return teacher_forced_tau(c3, v3) * kept, kept, jnp.sum(c3 & v3, axis=(0, 1)), jnp.sum(v3, axis=(0, 1))

        rng = np.random.default_rng(0)
        n = len(d["tokens"])
        tau_sum = blocks = 0.0
        hits, seen = np.zeros(tc.block_size - 1), np.zeros(tc.block_size - 1)
        for i in range(0, n, batch):
            rows = {k: d[k][i : i + batch] for k in ("tokens", "loss_mask", "lengths", "taps")}
            rows["anchors"], rows["keep"] = sample_anchors(
                rows["loss_mask"], rows["lengths"], anchors, tc.block_size, rng
            )
            batch_ = {k: jnp.asarray(v) for k, v in rows.items()}
            t, k, h, s = stats(graphdef, dstate, lt.model.embed[...], lt.model.lm_head[...], batch_)
            tau_sum, blocks = tau_sum + float(t), blocks + float(k)
            hits, seen = hits + np.asarray(h), seen + np.asarray(s)
        out[f"{name}_tau"] = tau_sum / max(blocks, 1.0)
        out[f"{name}_acceptance_by_position"] = [float(x) for x in hits / np.maximum(seen, 1)]
        out[f"{name}_path"] = str(path)
        out["rows"], out["blocks"] = n, blocks
    return out


STEP_FUNCS = {"attention": step_attention, "decode": step_decode, "cost": step_cost, "data_train": step_data_train}

if __name__ == "__main__":
    sys.exit(main())
