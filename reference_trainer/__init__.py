"""Reference 4D-parallel (DP/ZeRO, PP, CP, TP) Llama-style trainer; see launch.launch()."""

from .config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig"]
