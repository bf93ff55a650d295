"""CPU-sized config for tests, CI and the quickstart (well under 1M parameters)."""

from experiments import base


def get_config(arg: str | None = None):
    c = base.get_config(arg)
    c.model.vocab_size = 512
    c.model.num_layers = 2
    c.model.embed_dim = 64
    c.model.num_heads = 2
    c.model.head_dim = 32
    c.model.mlp_dim = 256
    c.model.max_len = 64
    c.train.num_steps = 600
    c.train.global_batch_size = 32
    c.train.learning_rate = 0.01
    c.train.warmup_steps = 100
    c.train.min_dim_size_to_factor = 32  # so the tiny model's matrices are factored, as at scale
    c.train.log_every_steps = 50
    c.train.eval_every_steps = 200
    c.train.checkpoint_every_steps = 200
    c.vectors.num_blocks = 2
    c.vectors.proj_dim = 8  # d = 2 * 2 * 8^2 = 256
    c.vectors.batch_size = 32
    c.hessian.lambda_component_fraction = 1 / 64
    c.index.chunk_rows = 64
    c.retrieval.read_chunk_rows = 256
    return c
