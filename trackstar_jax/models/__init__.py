"""Models: the language models we attribute (Flax NNX, with the tap protocol), loaders, generation.

- `lm`: `LMConfig` (`arch` = "palm" | "llama" | "gpt_neox") and the architecture dispatch
  (`make_model`, `apply`, `abstract_params`, `attributed_paths`).
- `layers`: what every architecture shares (the `Tap` protocol, Linear, Norm, RoPE, attention, losses).
- `palm`, `llama`, `gpt_neox`: the architectures.
- `hf`: Hugging Face folders (config.json + safetensors) -> `(LMConfig, params)`.
- `gguf`: GGUF files (llama.cpp) -> HF-named tensors (dequantized).
- `generate`: greedy completions (fact prompts, prediction-mode targets).
"""
