"""Float64 NumPy reference of Kimi-Linear: every op and the full model. Imports numpy only
(plus safetensors/json to read checkpoints); never torch or triton."""
from .config import PRESETS, ConfigError, KimiConfig
