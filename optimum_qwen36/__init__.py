"""optimum-qwen36: Qwen3.6 / Qwen3.5 hybrid models through a Hugging Face-native API."""

from .modeling.cache import Qwen36HybridCache
from .modeling.causal_lm import NeuronModelForCausalLM, NeuronQwen36ForCausalLM
from .neuron_config import Qwen36NeuronConfig

__version__ = "0.1.0"

__all__ = ["NeuronModelForCausalLM", "NeuronQwen36ForCausalLM", "Qwen36HybridCache", "Qwen36NeuronConfig"]
