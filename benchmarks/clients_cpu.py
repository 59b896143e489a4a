"""Third-party clients, unmodified, against `make serve` (the default model with its drafter):

- guidellm with its default backend (streamed chat completions), synchronous and 4 concurrent streams;
- lm-eval `local-completions` with `tokenizer_backend=remote` on a local multiple-choice task
  (benchmarks/clients/mc.jsonl, 32 questions).

Run from the repository root on an otherwise idle machine:

    .venv/bin/python benchmarks/clients_cpu.py --out benchmarks/results/cpu-2core/clients

It starts `make serve`, waits for /health, runs guidellm once to compile what the measured runs meet first (its
figures kept as `guidellm_warmup`), then the clients one after another, stops the server and writes
`clients.json` (the figures) beside each client's own report. guidellm needs a Hugging Face tokenizer directory for
its synthetic prompts: the script writes one from the default GGUF (tokenizer.json and tokenizer_config.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TASK = """task: mc32
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
target_delimiter: ""
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def write_tokenizer_dir(out: Path) -> Path:
    """The default model's tokenizer as a Hugging Face directory (what guidellm's `huggingface_auto` reads)."""
    from dflash_jax.checkpoints.gguf_loader import load_gguf
    from dflash_jax.checkpoints.loader import default_model_path
    from dflash_jax.checkpoints.tokenizer import tokenizer_from_gguf_fields

    _, _, fields = load_gguf(default_model_path())
    tok = tokenizer_from_gguf_fields(fields)
    out.mkdir(parents=True, exist_ok=True)
    tok.tk.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "chat_template": tok.chat_template,
        "model_max_length": 8192,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


def wait_healthy(url: str, proc: subprocess.Popen, limit_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            raise SystemExit(f"make serve exited with {proc.returncode} before /health answered")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"make serve not healthy after {limit_s:.0f} s")


def run(argv: list[str], log: Path, cwd: Path) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.monotonic()
    with log.open("w") as f:
        done = subprocess.run(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({done.returncode}); see {log}")
    return time.monotonic() - t0


def summary(dist: dict) -> dict:
    got = dist["successful"]
    return {
        "mean": round(got["mean"], 2),
        "median": round(got["median"], 2),
        "p95": round(got["percentiles"]["p95"], 2),
    }


def guidellm(
    url: str, tokenizer: Path, out: Path, profile: str, requests: int, prompt: int, output: int, tag: str
) -> dict:
    report = out / f"guidellm_{tag}.json"
    argv = [str(Path(sys.executable).with_name("guidellm")), "run", "--backend", f"kind=openai_http,target={url}"]
    argv += ["--profile", profile, "--constraint", f"kind=max_requests,count={requests}"]
    argv += ["--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}"]
    argv += ["--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--output", f"kind=json,path={report}"]
    argv += ["--disable-console-interactive"]
    wall = run(argv, report.with_suffix(".log"), out)
    bench = json.loads(report.read_text())["benchmarks"][0]
    m = bench["metrics"]
    return {
        "profile": profile,
        "request_format": bench["config"]["backend"]["request_format"],
        "requests": m["request_totals"],
        "output_tokens_per_s": round(m["output_token_count"]["successful"]["total_sum"] / bench["duration"], 2),
        "duration_s": round(bench["duration"], 1),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "time_to_first_token_ms": summary(m["time_to_first_token_ms"]),
        "inter_token_latency_ms": summary(m["inter_token_latency_ms"]),
        "wall_s": round(wall, 1),
    }


def lm_eval(url: str, model: str, out: Path) -> dict:
    task_dir = out / "lm_eval_task"
    task_dir.mkdir(exist_ok=True)
    data = ROOT / "benchmarks" / "clients" / "mc.jsonl"
    (task_dir / "mc32.yaml").write_text(TASK.format(data=data))
    args = f"base_url={url}/v1/completions,model={model},tokenizer_backend=remote,num_concurrent=2,max_retries=1"
    argv = [str(Path(sys.executable).with_name("lm_eval")), "--model", "local-completions", "--model_args", args]
    argv += ["--tasks", "mc32", "--include_path", str(task_dir), "--output_path", str(out / "lm_eval")]
    wall = run(argv, out / "lm_eval.log", out)
    (result,) = (out / "lm_eval").rglob("results_*.json")
    res = json.loads(result.read_text())["results"]["mc32"]
    return {
        "task": "mc32 (benchmarks/clients/mc.jsonl)",
        "docs": sum(1 for _ in data.open()),
        "acc": res["acc,none"],
        "acc_stderr": res["acc_stderr,none"],
        "model_args": "tokenizer_backend=remote,num_concurrent=2",
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--health-timeout", type=float, default=900)
    ap.add_argument("--requests", type=int, default=8, help="guidellm requests per profile")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer_dir(out / "tokenizer")
    serve_log = (out / "serve.log").open("w")
    proc = subprocess.Popen(
        ["make", "serve"], cwd=ROOT, stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        healthy_s = wait_healthy(a.url, proc, a.health_timeout)
        model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
        sizes = (a.requests, a.prompt_tokens, a.output_tokens)
        figures = {
            "server": "make serve",
            "model": model,
            "healthy_s": round(healthy_s, 1),
            # compiles the shapes the runs below meet first (batch buckets, prefill chunks); its figures are kept
            # but not comparable
            "guidellm_warmup": guidellm(a.url, tokenizer, out, "kind=concurrent,streams=4", *sizes, "warmup"),
            "guidellm_synchronous": guidellm(a.url, tokenizer, out, "kind=synchronous", *sizes, "synchronous"),
            "guidellm_concurrent_4": guidellm(
                a.url, tokenizer, out, "kind=concurrent,streams=4", *sizes, "concurrent_4"
            ),
            "lm_eval": lm_eval(a.url, model, out),
        }
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    (out / "clients.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
