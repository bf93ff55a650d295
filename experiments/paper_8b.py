"""The paper's 8B model shape (Table A.3). Builds abstractly with jax.eval_shape."""

from experiments import base


def get_config(arg: str | None = None):
    c = base.get_config(arg)
    c.model.num_layers = 32
    c.model.embed_dim = 4096
    c.model.mlp_dim = 16384
    c.model.num_heads = 16
    c.model.head_dim = 256
    c.model.vocab_size = 32_000
    c.model.max_len = 2048
    c.model.dtype = "bfloat16"
    return c
