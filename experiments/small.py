"""~6M-parameter model: the larger CPU run and the default for GPU experiments."""

from experiments import base


def get_config(arg: str | None = None):
    c = base.get_config(arg)
    c.model.vocab_size = 8192
    c.model.num_layers = 4
    c.model.embed_dim = 256
    c.model.num_heads = 4
    c.model.head_dim = 64
    c.model.mlp_dim = 1024
    c.model.max_len = 128
    c.train.num_steps = 3000
    c.train.global_batch_size = 64
    c.train.warmup_steps = 300
    c.vectors.num_blocks = 4
    c.vectors.proj_dim = 16  # d = 2 * 4 * 16^2 = 2048
    c.index.chunk_rows = 256
    return c
