"""models: the LM family (`lm`: config and arch dispatch; `palm`, `llama`, `gpt_neox`;
shared `layers`), the Hugging Face loader (`hf`) and generation (`generate`)."""
