"""Models: the language models we attribute (Flax NNX, with the tap protocol), loaders, generation.

- `lm`: `LMConfig`, the architecture registry (`Architecture`, `register`, `architecture`) and
  the functions on any of them (`make_model`, `apply`, `abstract_params`, `attributed_paths`).
- `layers`: what every architecture shares (the `Tap` protocol, Linear, Norm, RoPE, attention, losses).
- `palm`, `llama`, `gpt_neox`: the architectures; each registers itself (its constraints, HF
  model types and tensor names, GGUF names). A new one is a module here plus its import below.
- `hf`: Hugging Face folders (config.json + safetensors) -> `(LMConfig, params)`.
- `gguf`: GGUF files (llama.cpp) -> HF-named tensors (dequantized).
- `generate`: greedy completions (fact prompts, prediction-mode targets).
"""

# The built-in architectures register themselves on import (`lm.register`).
from trackstar_jax.models import gpt_neox, llama, palm  # noqa: E402, F401
