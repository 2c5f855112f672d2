"""Where the Python end-to-end tests find the built daemon and the model (shared by the test modules).

STRATA_BIN_DIR: directory holding strata-daemon (default: target/release under the repository root).
STRATA_MODEL: GGUF model file (default: $STRATA_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf, with STRATA_MODELS
defaulting to ~/.cache/strata/models).
"""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bin_dir() -> Path:
    d = Path(os.environ.get("STRATA_BIN_DIR", "target/release"))
    return d if d.is_absolute() else REPO / d


def model_path() -> Path:
    if os.environ.get("STRATA_MODEL"):
        return Path(os.environ["STRATA_MODEL"]).expanduser()
    models = os.environ.get("STRATA_MODELS") or os.path.join("~", ".cache", "strata", "models")
    return Path(models).expanduser() / MODEL_NAME
