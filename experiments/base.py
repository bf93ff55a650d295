"""Every config key, with its default and a one-line comment (flax configs/default.py style).

Variants import this module and change fields. Keys are grouped by pipeline stage:
model -> data -> train -> vectors (gradients, correction, projection) -> hessian ->
index -> retrieval -> evaluation -> tailpatch. `trackstar_jax/config.py` is the only library module
that reads this ConfigDict; it turns sections into typed, hashable objects.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The paper's 154M model on the embedded fact corpus (override per experiment)."""
    del arg
    c = ml_collections.ConfigDict()
    c.seed = 0  # model init, data order, embedded-corpus generation

    # --- model (§A.3, Table A.3; PaLM architecture) ---
    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 32_000  # SentencePiece vocab (the tokenizer is trained to this size)
    c.model.num_layers = 8
    c.model.embed_dim = 1024  # embedding size = hidden size
    c.model.num_heads = 4  # query heads (multi-query: one shared key/value head)
    c.model.head_dim = 256
    c.model.mlp_dim = 4096  # SwiGLU hidden size
    c.model.max_len = 2048  # longest sequence (passages are truncated to this, counted in the log)
    c.model.tie_embeddings = True  # share input/output embedding (then neither is attributed)
    c.model.norm = "rms"  # "rms" or "layer" (LayerNorm without bias)
    c.model.dtype = "float32"  # compute dtype ("bfloat16" on accelerators)
    c.model.param_dtype = "float32"
    c.model.matmul_dtype = (
        ""  # GEMM operands' dtype, float32 accumulation ("" = dtype; "bfloat16": ~2x on AVX512-BF16 CPUs)
    )
    c.model.remat = False  # rematerialise each layer in the backward (less activation memory, ~1/3 more FLOPs)
    c.model.source = ""  # "" = pretrain (launch.train); HF folder | .gguf file | MaxText checkpoint dir | "smollm2": import fills the shapes

    # --- data ---
    c.data = ml_collections.ConfigDict()
    c.data.source = "embedded"  # "embedded" | "lama" | "text" | "jsonl" | "seqio"
    c.data.path = ""  # file or folder for lama / text / jsonl (e.g. ../shared/data/lama)
    c.data.text_key = "text"  # jsonl field holding the passage
    c.data.seqio_task = ""  # seqio Task name (source="seqio"; needs the `seqio` extra)
    c.data.seqio_split = "train"  # split of the seqio Task
    c.data.seqio_module = ""  # module to import so that the seqio Task is registered
    c.data.relations = ""  # comma-separated LAMA relation ids to read ("" = all)
    c.data.max_examples = 0  # cap on corpus size (0 = no cap; LAMA: a fact that would exceed it is skipped)
    # LAMA: evidence sentences kept per fact (0 = all), a seeded choice (data.evidence_seed); the
    # shared T-REx files have a median of 2 per fact, 90% of facts <= 7, but up to 1,832: 8 keeps
    # every sentence of most facts and stops one fact from crowding out hundreds (BUILD_NOTES §2)
    c.data.max_evidence_per_fact = 8
    c.data.evidence_seed = 0  # seed of that choice (a hash of seed, fact and sentence: no file order)
    c.data.embedded = ml_collections.ConfigDict()  # the seeded fact-corpus generator
    c.data.embedded.num_entities = 200
    c.data.embedded.num_facts = 120
    c.data.embedded.phrasings_per_fact = 3  # passages stating each fact, in distinct phrasings
    c.data.embedded.num_distractors = 200  # passages stating no fact
    c.data.tokenizer_model_type = "unigram"  # SentencePiece model type
    c.data.eval_fraction = 0.05  # held-out passages for eval loss (never in the index)
    c.data.statements_per_fact = 0  # lama: templated statements per train-split fact (0 = none)
    c.data.eval_fact_fraction = 0.0  # lama: facts in the eval split (queried; no templated statement)
    c.data.fact_split_seed = 0  # lama: seed of the train / eval fact split and of the statement templates
    c.data.templates_file = (
        ""  # jsonl of {"relation", "templates": {"0": ..., "1": ..., "2": ...}} adding to the shipped ones
    )
    c.data.pararel_dir = ""  # ParaRel patterns folder: variant 1 fallback and more statement phrasings

    # --- candidates: the passages indexed and retrieved (data/candidates.py) ---
    c.candidates = ml_collections.ConfigDict()
    c.candidates.passages = "all"  # "all" corpus passages | "natural" (no templated statements: the paper's closed set)

    # --- mesh (sharding.py) ---
    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor); -1 = all remaining devices

    # --- pretraining (§A.3) ---
    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 187_000
    c.train.global_batch_size = 1024
    c.train.learning_rate = 0.01
    c.train.warmup_steps = 10_000
    c.train.decay_rate = 0.8  # Adafactor second-moment decay exponent
    c.train.min_dim_size_to_factor = 128  # optax Adafactor: smaller matrices keep a full v
    c.train.clipping_threshold = 1.0
    c.train.multiply_by_parameter_scale = True
    c.train.log_every_steps = 50
    c.train.eval_every_steps = 500
    c.train.num_eval_batches = 4
    c.train.checkpoint_every_steps = 1000
    c.train.max_checkpoints_to_keep = 3
    c.train.num_completions = 8  # greedy completions of fact prompts reported at the end
    c.train.max_new_tokens = 8  # length of those completions
    c.train.max_fact_prompts = 256  # fact prompts completed for the summary's fact_accuracy

    # --- gradient features (§3 Eq. 2, §A.1.1-A.1.2) ---
    c.vectors = ml_collections.ConfigDict()
    c.vectors.output_fn = "loss"  # "loss" | "margin" | "logit" | "trak" (margin + example-level Q on index rows)
    c.vectors.num_blocks = 8  # consecutive-layer blocks; attention and MLP kept apart
    c.vectors.proj_dim = 64  # k per side: d = 2 * num_blocks * k^2 (paper: 8 * 2 * 64^2 = 2^16)
    c.vectors.proj_seed = 0  # one seed; each matrix's key is derived from its parameter path
    c.vectors.correction = True  # divide by sqrt(V) from the optimizer state
    c.vectors.path = (
        "fast"  # "fast" (factored; rank-one V where optax kept a full v) | "reference" (vmap(grad), exact V)
    )
    # fast path with an element-wise V (Adam / unfactored Adafactor): True applies it exactly
    # (one layer's per-example gradient materialised at a time), False its rank-one factorisation
    c.vectors.exact_v = False
    c.vectors.batch_size = 32  # examples per featurize step (global)
    # imported models (no optimizer state): how V is estimated (training/second_moment.py).
    # "minibatch": the optimizer's own V, an Adafactor EMA (train.decay_rate, its factoring) over
    # estimate_v_steps steps of estimate_v_batch_sequences-sequence minibatch gradients |
    # "per_example": the mean of squared per-example gradients of estimate_v_examples texts
    c.vectors.estimate_v_method = "minibatch"
    # text of the estimate: "heldout" (data.eval_fraction's passages) | "candidates" |
    # "lama:<relations>" (other T-REx relations) | "file:<path>" (.txt / .jsonl); never the candidates but by name
    c.vectors.estimate_v_source = "heldout"
    c.vectors.estimate_v_examples = 256  # per_example: texts whose gradients estimate V (0: none)
    c.vectors.estimate_v_batch_sequences = 64  # minibatch: sequences per step (B; accumulated by vectors.batch_size)
    c.vectors.estimate_v_steps = 16  # minibatch: steps (N; 0: no estimate)
    c.vectors.estimate_v_seed = 0  # seed of that sample
    # float32 GEMMs of the featurize step: "float32" (exact on every chip) | "tf32" | "bf16"
    # (on a CPU bf16 rounds the model's operands itself; a bf16 model's GEMMs are bf16 whatever
    # this says; docs/scaling.md)
    c.vectors.matmul_precision = "float32"

    # --- Hessian approximation R and normalisation (§3, §A.1.3) ---
    c.hessian = ml_collections.ConfigDict()
    c.hessian.mode = "mixed"  # "none" | "train" | "mixed" (lambda R_eval + (1-lambda) R_train)
    c.hessian.mix_lambda = -1.0  # < 0: choose automatically (eigenvalue-curve crossing)
    # lambda when the automatic choice cannot be made (R_eval's rank below the crossing component:
    # a handful of queries); the paper's T-REx value; < 0: refuse instead
    c.hessian.fallback_lambda = 0.9
    c.hessian.lambda_component_fraction = 1000 / 65536  # crossing component / d (paper: 1000th of 2^16)
    # R_train shrunk toward each block's mean eigenvalue, (1 - rho) R + rho mu I: < 0 = OAS (rho from the
    # spectrum and row count: ~0 when rows far outnumber the block width, large when they do not); 0 = none
    c.hessian.r_train_shrinkage = -1.0
    c.hessian.damping = 1e-6  # relative eigenvalue floor for R^{-1/2}
    c.hessian.unit_norm = True  # unit-normalise R^{-1/2} g (TrackStar); off for ablations

    # --- index (tensorstore zarr3) ---
    c.index = ml_collections.ConfigDict()
    c.index.dtype = "bfloat16"  # "float32" | "bfloat16" | "float16" | "int8" (per-row scale)
    c.index.chunk_rows = 1024  # rows per zarr chunk (= unit of resumable progress)
    c.index.r_every_chunks = 0  # chunks per saved R_train partial sum (0 = auto: saving R costs <= 2% of the data)
    c.index.dir = "index"  # subdirectory of workdir; one per vector setting (e.g. "index_nocorr")

    # --- retrieval (exact top-k) ---
    c.retrieval = ml_collections.ConfigDict()
    c.retrieval.top_k = 10  # proponents and opponents kept per query (1 <= top_k <= index rows)
    c.retrieval.query_batch_size = 64  # queries scored together against each streamed chunk
    c.retrieval.read_chunk_rows = 65_536  # index rows streamed per step (next chunk prefetched meanwhile)
    c.retrieval.queries = ""  # jsonl of {"prompt", "target"[, "example_id"]}; "" = the evaluation's fact queries
    c.retrieval.output = ""  # output name: workdir/retrieval/<output>.jsonl ("" = from the query source)
    c.retrieval.overwrite = False  # replace an existing output of the same name (refused otherwise)
    # per proponent, each token's share of its score (and each query target token's): `retrieval.attribution`
    c.retrieval.token_scores = False
    # two-stage retrieval: rescore the index's top rerank_k with the exact unprojected corrected-gradient
    # score (`retrieval.rerank`; 0 = off); the records keep both scores
    c.retrieval.rerank_k = 0
    c.retrieval.precision = "float32"  # scoring GEMMs: "float32" (exact top-k) | "tf32" | "bf16" (approximate)

    # --- evaluation (§4, §A.4) ---
    c.eval = ml_collections.ConfigDict()
    c.eval.query_mode = "gold"  # "gold" target or the model's own "prediction"
    c.eval.template_variant = 0  # which of the prompt templates (Table A.1)
    c.eval.max_queries = 0  # 0 = all
    c.eval.methods = ("trackstar",)  # rows of the table (names in baselines.METHODS, e.g. "bm25", "exp3")
    c.eval.relations = ""  # comma-separated relations to query ("" = every relation of the corpus)
    c.eval.lama_dir = ""  # LAMA folder with relations.jsonl for templates ("" = config.data.path); LAMA corpora only
    c.eval.pararel_dir = ""  # ParaRel patterns folder for template variants 1, 2 ("" = none)
    c.eval.num_proponents = 10  # proponents retrieved per query (MRR is over this list; recall/precision@10)
    c.eval.max_per_bucket = 1000  # §A.4: facts sampled per frequency bucket
    c.eval.max_per_relation_target_per_bucket = 25  # §A.4: cap per (relation, target) within a bucket
    c.eval.max_per_relation_target = 100  # §A.4: cap per (relation, target) overall
    c.eval.max_incorrect_per_bucket = (
        -1
    )  # §A.4: facts the model gets wrong, per bucket (-1: max_per_bucket / 10, as the paper's 100 of 1000; 0 = no cap)
    c.eval.bucket_edges = (1, 10, 100, 1_000, 10_000, 100_000)  # fact-frequency bucket lower edges (§A.4)
    c.eval.include_unmentioned = False  # keep facts no passage mentions (frequency 0)
    c.eval.max_new_tokens = 8  # greedy completion length (correctness, prediction-mode targets)
    c.eval.bm25_k1 = 1.2  # Lucene defaults
    c.eval.bm25_b = 0.75
    c.eval.bootstrap_seed = 0  # seed of the 95% bootstrap intervals
    c.eval.num_examples_shown = 3  # queries whose proponents are printed / put in table.md
    c.eval.output_dir = ""  # folder in the workdir ("" = eval, or eval_<mode>[_t<variant>] for other modes / templates)
    c.eval.row = ""  # one table row (e.g. "exp3"): eval.methods = (row,) and the row's vectors / hessian / index.dir
    c.eval.optional_methods = ()  # rows left out (logged) when their model is not installed, e.g. ("dense",)
    c.eval.completion_batch_size = 64  # prompts per greedy-completion batch (one compiled shape)

    # --- tail-patch (§4.3) ---
    c.tailpatch = ml_collections.ConfigDict()
    c.tailpatch.top_ks = (1, 3, 5, 10)
    c.tailpatch.learning_rate = -1.0  # < 0: the schedule's value at the final step
    c.tailpatch.batch_size = 16  # proponents per vmapped step (the dense step holds a parameter copy each)
    c.tailpatch.queries_per_step = 8  # queries measured under each proponent's step (pairs share it)
    c.tailpatch.max_queries = 0  # tail-patch a seeded subset of this many queries (0 = all); pairs are cached per run
    c.tailpatch.methods = ()  # rows tail-patched (() = every row of eval.methods)
    c.tailpatch.checkpoint_steps = ()  # also TrackStar's MRR / tail-patch@10 at these checkpoints (Fig. 2 right)

    # --- linear datamodeling score (launch.validate; TRAK, Park et al. 2023) ---
    c.validate = ml_collections.ConfigDict()
    c.validate.num_subsets = 50  # M subsets, each retrained from the run's init (TRAK: M >= 50)
    c.validate.fraction = 0.5  # alpha: each subset holds round(alpha * N) training examples
    c.validate.seed = 0  # subset i depends on (seed, i) only: raising M reuses the finished subsets
    c.validate.num_steps = 0  # retraining steps per subset (0 = train.num_steps)
    c.validate.methods = ("trackstar", "bm25")  # rows scored (names in methods.METHODS, e.g. "exp1", "trex_gold")
    c.validate.num_queries = 0  # fact queries scored (sets eval.max_queries for this stage; 0 = eval.max_queries)
    c.validate.parallel_subsets = (
        1  # K > 1: K subsets retrained side by side (vmap, one device; same result to rounding)
    )

    # --- maxtext: a MaxText checkpoint as model.source; MaxText's own key names and base.yml defaults ---
    c.maxtext = ml_collections.ConfigDict()
    c.maxtext.step = -1  # checkpoint step to import (-1 = the latest)
    c.maxtext.decoder_block = ""  # required; only "llama2" is mapped
    c.maxtext.opt_type = "adamw"  # "adamw" or "adam_pax" ("sgd", "muon": no per-element V, refused)
    c.maxtext.adam_b2 = 0.95  # Adam's second-moment decay (bias correction at the checkpoint's count)
    c.maxtext.adam_eps = 1e-8  # added outside the square root of Adam's denominator
    c.maxtext.adam_eps_root = 0.0  # added inside it
    c.maxtext.rope_type = "default"  # "default" or "llama3.1" (then rope_use_scale=False); "yarn" refused
    c.maxtext.rope_use_scale = True  # llama3.1's frequency scaling (refused with rope_type "llama3.1")
    c.maxtext.rope_min_timescale = 1.0  # only 1 is mapped
    c.maxtext.rope_max_timescale = 0.0  # required: RoPE theta
    c.maxtext.rope_linear_scaling_factor = 1.0  # only 1 is mapped
    c.maxtext.normalization_layer_epsilon = 0.0  # required: RMSNorm epsilon
    c.maxtext.max_target_length = 2048  # positions trained on (the imported model's max_len)
    c.maxtext.param_scan_axis = 1  # axis scanned layers are stacked on
    c.maxtext.num_query_heads = 0  # 0 = read from the query kernel's shape (else checked against it)
    c.maxtext.num_kv_heads = 0  # 0 = read from the key kernel's shape (else checked against it)
    c.maxtext.tokenizer_path = ""  # required: a Hugging Face tokenizer folder (tokenizer.json)
    return c
