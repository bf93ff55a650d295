"""Models: the language models we attribute (Flax NNX, with the tap protocol), generation.

- `palm`: the paper's PaLM-style decoder (`LMConfig`, `make_model`, `apply`, the `Tap` protocol).
- `generate`: greedy completions (fact prompts, prediction-mode targets).
"""
