"""The clients people benchmark and evaluate with, unmodified, against `dflash-jax serve` on a tiny random Llama:
guidellm with its default backend (streamed chat completions with vLLM's `continuous_usage_stats`), 4 concurrent
streams; lm-eval's `local-completions` with `tokenizer_backend=remote` (`/tokenizer_info`,
`/tokenize`, echoed prompt log-probabilities) on a local multiple-choice task, its log-likelihoods checked against
the server's own scoring of the same token ids. Each client skips when it is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from dflash_jax.testing import waits
from tests.server.real_server import RealServer
from tests.tinymodels import write_tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny"
CLIENT_TIMEOUT_S = 300  # seconds of an idle core; `waits.run` stretches it by the load
DOCS = [
    {"question": "What colour is the sky?", "choices": [" blue", " green", " red"], "answer": 0},
    {"question": "2 + 2 =", "choices": [" 4", " 5", " 22"], "answer": 1},
    {"question": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0},
    {"question": "Ice is", "choices": [" cold", " hot", " loud", " sour"], "answer": 2},
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=2)


@pytest.fixture(scope="module")
def real_server(model_dir):
    args = ["--no-spec", "--served-model-name", MODEL, "--max-num-seqs", "4", "--max-model-len", "160"]
    with RealServer(model_dir, *args) as srv:
        yield srv
        log = srv.log()
    assert "Traceback" not in log, log[-4000:]


def _client(argv: list[str], cwd: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = waits.run(argv, CLIENT_TIMEOUT_S, cwd=cwd, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    return out


def _script(name: str) -> str:
    found = Path(sys.executable).with_name(name)
    return str(found) if found.exists() else (shutil.which(name) or name)


def test_guidellm_default_backend(real_server, model_dir, tmp_path):
    """4 concurrent streams (a synchronous run sends the same requests one at a time)."""
    _needs("guidellm")
    report = tmp_path / "guidellm.json"
    argv = [_script("guidellm"), "run", "--backend", f"kind=openai_http,target={real_server.url}"]
    argv += ["--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=6"]
    argv += ["--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=12"]
    argv += ["--tokenizer", f"kind=huggingface_auto,model={model_dir}", "--output", f"kind=json,path={report}"]
    _client([*argv, "--disable-console-interactive"], tmp_path)
    bench = json.loads(report.read_text())["benchmarks"][0]
    assert bench["config"]["backend"]["request_format"] == "/v1/chat/completions"
    assert bench["metrics"]["request_totals"] == {"successful": 6, "errored": 0, "incomplete": 0, "total": 6}
    out = bench["metrics"]["output_token_count"]["successful"]
    assert out["min"] == out["max"] == 12  # guidellm read each request's usage (ignore_eos: exactly 12)


def test_lm_eval_local_completions_with_the_remote_tokenizer(real_server, tmp_path):
    _needs("lm_eval")
    _needs("tenacity")  # lm-eval[api]
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(TASK.format(data=data))
    url = real_server.url + "/v1/completions"
    model_args = f"base_url={url},model={MODEL},tokenizer_backend=remote,num_concurrent=2,max_retries=1"
    argv = [_script("lm_eval"), "--model", "local-completions", "--model_args", model_args, "--tasks", "tiny_mc"]
    argv += ["--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"), "--log_samples"]
    _client(argv, tmp_path)
    (samples,) = (tmp_path / "out").rglob("samples_tiny_mc_*.jsonl")
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
    assert [r["doc"] for r in rows] == DOCS
    with httpx.Client(base_url=real_server.url, timeout=waits.stretched(60)) as http:

        def ids(text: str) -> list[int]:
            return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

        for row, doc in zip(rows, DOCS, strict=True):
            context = f"Question: {doc['question']}\nAnswer:"
            scores = []
            for choice in doc["choices"]:
                whole, ctx = ids(context + " " + choice), ids(context)  # lm-eval's target delimiter: " "
                body = {"model": MODEL, "prompt": whole, "max_tokens": 0, "echo": True, "logprobs": 0}
                lps = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
                scores.append(sum(lps[len(ctx) :]))
            got = [float(resp[0][0]) for resp in row["resps"]]
            np.testing.assert_allclose(got, scores, rtol=0, atol=1e-4)
            assert row["acc"] == float(int(np.argmax(scores)) == doc["answer"])
