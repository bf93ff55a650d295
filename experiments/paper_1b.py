"""The paper's 1B model shape (Table A.3). Builds abstractly with jax.eval_shape."""

from experiments import base


def get_config(arg: str | None = None):
    c = base.get_config(arg)
    c.model.num_layers = 16
    c.model.embed_dim = 2048
    c.model.mlp_dim = 8192
    c.model.num_heads = 8
    c.model.head_dim = 256
    c.model.vocab_size = 32_000
    c.model.max_len = 2048
    c.model.dtype = "bfloat16"
    return c
