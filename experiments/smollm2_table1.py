"""Table 1 of experiments/trex_table1.py on a real pretrained model: SmolLM2-135M, same relations.

    python -m launch.import_model --config=experiments/smollm2_table1.py --workdir=runs/smollm2_table1
    python -m launch.evaluate --config=experiments/smollm2_table1.py --workdir=runs/smollm2_table1 --notrain

The corpus is built exactly as trex_table1's CPU variant (8 relations, train / eval fact split,
templated statements of the train facts; `data.max_examples` smaller so that three indices of a
135M-parameter model fit a CPU), the queries are eval-split facts with the paper-style template
0, and the rows are trex_table1's. SmolLM2 was trained on web text, not on this corpus, and has no
optimizer state: the correction uses V estimated from per-example gradients of corpus examples
(`vectors.estimate_v_examples`, as experiments/smollm2_trex.py). The orderings are then seen on a
model trained on far more text than ours.
"""

from experiments import smollm2_trex, trex_table1


def get_config(arg: str | None = None):
    c = smollm2_trex.get_config()
    t = trex_table1.get_config("cpu")
    for key in ("source", "path", "relations", "statements_per_fact", "eval_fact_fraction", "fact_split_seed"):
        c.data[key] = t.data[key]
    c.data.pararel_dir = t.data.pararel_dir
    c.data.max_examples = 3000  # evidence sentences (+ the train facts' statements)
    c.data.eval_fraction = 0.0  # nothing is trained, so nothing is held out
    c.eval.methods = t.eval.methods
    c.eval.optional_methods = t.eval.optional_methods
    c.eval.template_variant = 0  # paper style ("[X] was born in the city of:")
    c.eval.max_queries = 200
    c.eval.max_per_bucket = 200
    c.eval.max_per_relation_target_per_bucket = t.eval.max_per_relation_target_per_bucket
    c.eval.max_per_relation_target = t.eval.max_per_relation_target
    c.hessian.r_eval_source = "task_prompts"
    c.hessian.r_eval_prompts = 1000  # blocks are 256 wide (d = 4096 = 16 x 256)
    return c
