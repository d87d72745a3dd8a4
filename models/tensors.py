"""TensorDict: checkpoint tensors by HF name, remembering the file each came from."""

from __future__ import annotations

import numpy as np


class TensorDict(dict[str, np.ndarray]):
    """name -> np.ndarray in HF naming, with per-tensor source files for error messages."""

    def __init__(self, origin: str):
        super().__init__()
        self.origin = origin  # the checkpoint as a whole (dir or .gguf path)
        self.files: dict[str, str] = {}  # tensor name -> file it was read from

    def source_of(self, name: str) -> str:
        """The file a tensor came from, or the checkpoint origin."""
        return self.files.get(name, self.origin)
