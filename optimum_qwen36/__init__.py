"""optimum-qwen36: Qwen3.6 / Qwen3.5 hybrid models through a Hugging Face-native API."""

from ._version import __version__
from .modeling.cache import Qwen36HybridCache
from .modeling.causal_lm import NeuronModelForCausalLM, NeuronQwen36ForCausalLM
from .modeling.conditional_generation import NeuronQwen36ForConditionalGeneration
from .network.neuron_config import Qwen36NeuronConfig

__all__ = [
    "NeuronModelForCausalLM",
    "NeuronQwen36ForCausalLM",
    "NeuronQwen36ForConditionalGeneration",
    "Qwen36HybridCache",
    "Qwen36NeuronConfig",
    "__version__",
]
