"""`--model org/name[@revision]`: Hugging Face Hub names resolved from a cache laid out in the test
(HF_HOME in a temporary directory, HF_HUB_OFFLINE=1), through `tinyvllm generate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.model.test_hf_loader import _make_mistral, _save
from tests.model.test_loader_gguf import _write_gguf
from tinyvllm.model.synthetic import make_random_model, tiny_arch

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
PROMPT = "Hello world"


def _snapshot(hf_home, repo_id: str, commit: str, ref: str = "main"):
    """The folder huggingface_hub reads for `repo_id` at `ref` (models--org--name/...)."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A cache with `tinyvllm-test/tiny-mistral` (HF directory; main and tag v2 at two commits
    with different weights) and `tinyvllm-test/tiny-gguf` (one GGUF file)."""
    home = tmp_path_factory.mktemp("hf_home")
    torch.manual_seed(0)
    _save(_make_mistral(), _snapshot(home, "tinyvllm-test/tiny-mistral", COMMIT))
    torch.manual_seed(1)
    _save(_make_mistral(), _snapshot(home, "tinyvllm-test/tiny-mistral", OTHER_COMMIT, "v2"))
    from tests.model.test_loader_gguf import TOKENS
    arch = tiny_arch(vocab_size=len(TOKENS), tie_word_embeddings=True)
    model = make_random_model(arch, 3, torch.float32, torch.device("cpu"))
    _write_gguf(_snapshot(home, "tinyvllm-test/tiny-gguf", COMMIT) / "tiny.gguf", model)
    return home


def _generate(hub, model: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hub), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "tinyvllm.entrypoints.cli", "generate", "--model", model,
         "--max-tokens", "4", "--ignore-eos", "--json", PROMPT],
        capture_output=True, text=True, env=env, timeout=300)


def _token_ids(result: subprocess.CompletedProcess) -> list[int]:
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 4
    return out["token_ids"]


@pytest.mark.slow
def test_hf_directory_by_name_and_revision(hub):
    snapshot = hub / "hub" / "models--tinyvllm-test--tiny-mistral" / "snapshots"
    main = _token_ids(_generate(hub, "tinyvllm-test/tiny-mistral"))
    assert main == _token_ids(_generate(hub, str(snapshot / COMMIT)))
    assert _token_ids(_generate(hub, "tinyvllm-test/tiny-mistral@v2")) != main  # other weights


@pytest.mark.slow
def test_gguf_by_name(hub):
    file = hub / "hub" / "models--tinyvllm-test--tiny-gguf" / "snapshots" / COMMIT / "tiny.gguf"
    local = _token_ids(_generate(hub, str(file)))
    assert _token_ids(_generate(hub, "tinyvllm-test/tiny-gguf")) == local
    assert _token_ids(_generate(hub, f"tinyvllm-test/tiny-gguf/tiny.gguf@{COMMIT}")) == local


def test_absent_name_says_where_it_looked(hub):
    result = _generate(hub, "tinyvllm-test/absent@v1")
    assert result.returncode == 1
    assert "'tinyvllm-test/absent@v1' is not in the Hugging Face cache" in result.stderr
    assert str(hub / "hub") in result.stderr and "HF_HUB_OFFLINE is set" in result.stderr
    assert "Traceback" not in result.stderr


def test_reported_name_is_the_repo(hub):
    from tinyvllm.model_files import model_name

    snapshot = hub / "hub" / "models--tinyvllm-test--tiny-mistral" / "snapshots" / COMMIT
    assert model_name(snapshot) == "tinyvllm-test/tiny-mistral"


def test_serve_refuses_an_absent_name_before_listening(hub):
    env = {**os.environ, "HF_HOME": str(hub), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tinyvllm.entrypoints.serve", "--model", "tinyvllm-test/absent",
         "--port", "0", "--metrics-port", "0"], capture_output=True, text=True, env=env,
        timeout=120)
    assert result.returncode == 1
    assert "tinyvllm serve: model 'tinyvllm-test/absent' is not in the Hugging Face cache" in \
        result.stderr
