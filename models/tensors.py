"""TensorDict: checkpoint tensors by HF name, remembering the file each came from."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

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


class LazyTensors(Mapping[str, np.ndarray]):
    """name -> np.ndarray made on each access and not kept (e.g. a GGUF tensor dequantized), so
    a reader going tensor by tensor holds at most one whole tensor at a time."""

    def __init__(self, origin: str, makers: dict[str, Callable[[], np.ndarray]]) -> None:
        self.origin = origin
        self.files = dict.fromkeys(makers, origin)
        self._makers = makers

    def __getitem__(self, name: str) -> np.ndarray:
        return self._makers[name]()

    def __contains__(self, name: object) -> bool:  # without making the tensor
        return name in self._makers

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def source_of(self, name: str) -> str:
        """The file a tensor comes from."""
        return self.files.get(name, self.origin)
