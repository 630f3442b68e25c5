"""DeepSeek-V4 (the math): config, layers and the language model. See README.md here."""

from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.model import DeepseekV4Model, ModelOutput
from primus_v4.models.deepseek_v4.params import param_counts

__all__ = ["DeepseekV4Config", "DeepseekV4Model", "ModelOutput", "param_counts"]
