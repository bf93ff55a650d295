"""The language-model family: one config (`LMConfig`) and functions that dispatch on `arch`.

Architectures (one module each, each exporting `Transformer(cfg, *, rngs)` whose
`__call__(tokens, tap=None)` returns float32 logits):

| arch       | module        | attention          | MLP              | norm             | biases            |
| ---------- | ------------- | ------------------ | ---------------- | ---------------- | ----------------- |
| `palm`     | `palm.py`     | multi-query        | SwiGLU           | RMS / bias-free LN | none            |
| `llama`    | `llama.py`    | MHA / GQA / MQA    | SwiGLU           | RMS              | optional q/k/v/o, MLP |
| `gpt_neox` | `gpt_neox.py` | MHA, partial RoPE  | GELU             | LayerNorm + bias | everywhere        |

Parameter paths are shared by all of them (the block plan in `features/projection.py`
relies on it): `embed` (token embedding, never attributed), `layer_i/attn/<name>/kernel|bias`,
`layer_i/attn_norm/scale|bias`, `layer_i/mlp/<name>/kernel|bias`, `layer_i/mlp_norm/...`,
`final_norm/...`, `unembed/kernel` (untied output embedding).

Architectures are registered, not listed: each module calls `register(Architecture(...))` at
import with its model class, the fields it does not implement, its Hugging Face model types and
config / tensor mapping, and its GGUF names (`models/__init__.py` imports the built-in ones;
they subclass this module's `DecoderLM`, so this module does not import them). Everything that
dispatches on `arch` (`LMConfig`'s checks, `make_model`, `hf`, `gguf`) asks `architecture(name)`,
which refuses an unknown name listing the known ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from trackstar_jax.models.head import head_nll_sum  # noqa: F401  (re-exported: the family's public API)
from trackstar_jax.models.layers import (  # noqa: F401  (re-exported: the family's public API)
    NORM_TYPES,
    KVCache,
    Linear,
    Norm,
    Tap,
    dense_matmul,
    example_losses,
    flat_params,
    lm_targets,
    param_count,
    param_path_str,
    token_log_probs,
)

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
MATMUL_DTYPES = ("", "float32", "bfloat16")

# Parameters TrackStar never attributes (§3: "all model parameters except the token
# embedding layer"); with tied embeddings this is also the output embedding. `unattributed`
# holds what an adapted model's rules leave out (`models/adapter.py`).
EXCLUDED_PARAMS = ("embed", "unattributed")
# Attention key biases are not attributed either (the paper's models have none). Adding a
# bias to every key shifts each query's scores by a constant, which the softmax ignores:
# where RoPE does not rotate it (GPT-NeoX's un-rotated 75%), its gradient is identically
# zero, so the optimizer's V is ~0 there and the correction 1/sqrt(V) amplifies pure
# roundoff into the largest entries of the vector (seen as 1 vs 8 device vectors that
# differed by 100% with the correction on). The rotated part carries little signal.
EXCLUDED_SUFFIXES = ("/attn/key/bias",)
# The untied output embedding is attributed only on request (`vectors.unembed`). The paper's
# models tie it to the token embedding, so it is never attributed there. Untied, with the
# correction, its vocab x d entries each get 1/sqrt(V) and rarely seen target tokens' columns
# are amplified most: on a GPT-NeoX at the pythia-14m shape after 6 steps it held 98% of the
# corrected gradient norm, so every vector measured rare-token overlap (BUILD_NOTES, Issue 13).
UNEMBED = "unembed"


# ---------------------------------------------------------------------------------------
# The architecture registry
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFNames:
    """How a GGUF file (llama.cpp) of one architecture maps onto Hugging Face names (`models.gguf`).

    Attributes:
      architecture: the file's `general.architecture`.
      hf_config: `(metadata, tensor names, path) -> config.json dict` the metadata describes.
      global_names: GGUF tensor name -> HF tensor name (embedding, final norm, output).
      layer_names: `blk.{i}.<key>` -> HF `<layer_prefix>.{i}.<value>`.
      layer_prefix: HF prefix of the layers (e.g. "model.layers").
      permuted_rows: HF name suffix -> the config.json key of its head count, for the
        projections whose rows llama.cpp's converter reorders for its RoPE layout.
    """

    architecture: str
    hf_config: Callable[[Mapping[str, Any], frozenset[str], Any], dict]
    global_names: Mapping[str, str]
    layer_names: Mapping[str, str]
    layer_prefix: str = "model.layers"
    permuted_rows: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, eq=False)
class Architecture:
    """One architecture of the family, as its module registers it (`register`).

    Attributes:
      name: the `model.arch` value.
      model: the `DecoderLM` subclass, built as `model(cfg, rngs=...)`.
      fixed: `cfg -> {field: allowed values}` for the `LMConfig` fields it does not implement
        (they must keep these values: nothing is ignored silently).
      default_kv_heads: key/value heads when `num_kv_heads` is None (None: `num_heads`).
      hf_model_types: Hugging Face `model_type`s it imports (`models.hf`).
      from_hf: `(config.json dict, *, dtype, param_dtype, max_len) -> LMConfig`.
      hf_tensors: `cfg -> [hf.Tensor]`, the HF state dict's tensors but the untied output embedding.
      hf_output_names: accepted HF names of the untied output embedding (the last is the default).
      to_hf: `cfg -> config.json dict`, the export (`models.hf.save_hf`; `from_hf` must read it back
        to `cfg`), or None when it exports none.
      gguf: its GGUF names, or None when GGUF files of it are not read.
    """

    name: str
    model: Any
    fixed: Callable[[LMConfig], Mapping[str, tuple]] = lambda cfg: {}
    default_kv_heads: int | None = None
    hf_model_types: tuple[str, ...] = ()
    from_hf: Callable[..., LMConfig] | None = None
    hf_tensors: Callable[[LMConfig], list] | None = None
    hf_output_names: tuple[str, ...] = ("lm_head.weight",)
    to_hf: Callable[[LMConfig], dict] | None = None
    gguf: GGUFNames | None = None


ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Adds `arch` to the registry (an architecture module calls it at import).

    Raises:
      ValueError: another architecture already has its name, a HF model type or a GGUF name.
    """
    for other in ARCHITECTURES.values():
        if other.name == arch.name and other.model is not arch.model:
            raise ValueError(f"architecture {arch.name!r} is already registered by {other.model.__module__}")
        if other.name != arch.name:
            clash = set(other.hf_model_types) & set(arch.hf_model_types)
            if other.gguf and arch.gguf and other.gguf.architecture == arch.gguf.architecture:
                clash.add(f"GGUF {arch.gguf.architecture}")
            if clash:
                raise ValueError(f"architecture {arch.name!r}: {sorted(clash)} already belong to {other.name!r}")
    ARCHITECTURES[arch.name] = arch
    return arch


def architecture(name: str) -> Architecture:
    """The registered architecture `name`.

    Raises:
      ValueError: no such architecture (names the known ones).
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"model.arch={name!r} is not a registered architecture (known: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Model hyperparameters (frozen and hashable, so it can be a jit static argument).

    Attributes:
      arch: "palm" (the paper's model), "llama" (Llama / Mistral / Qwen2 / SmolLM2) or
        "gpt_neox" (GPT-NeoX / Pythia).
      vocab_size, num_layers, embed_dim, num_heads, head_dim, mlp_dim, max_len: sizes.
      num_kv_heads: key/value heads (llama: None = num_heads; palm: None or 1, multi-query;
        gpt_neox: None or num_heads).
      tie_embeddings: output embedding = token embedding (palm scales it by 1/sqrt(d)).
      norm: "rms" or "layer"; norm_eps its epsilon; norm_bias a LayerNorm bias.
      rope_base: RoPE theta; rotary_pct: fraction of head_dim that is rotated (gpt_neox).
      qkv_bias: biases on the query/key/value projections; out_bias on the attention
        output; mlp_bias on the MLP projections.
      parallel_residual: gpt_neox `x + attn(ln1(x)) + mlp(ln2(x))`.
      activation: MLP activation ("silu" = SwiGLU for palm/llama; gelu/gelu_tanh/relu for gpt_neox).
      dtype: activation / compute dtype; param_dtype: parameter storage dtype.
      matmul_dtype: the dtype the dense layers', attention's and the output head's GEMM
        operands are rounded to, products accumulated in float32 ("": `dtype`). "bfloat16"
        with float32 activations is TPU's default matmul precision; on a CPU with AVX512-BF16
        those GEMMs run at about twice the float32 rate (`layers.LOWP_MATMUL`). Norms,
        softmaxes and the residual stream stay in `dtype`. A runtime choice
        (`config.RUNTIME_KEYS`): an index records it with its featurizer settings.
      source: where the weights come from: "" (pretrained by `launch.train`), a Hugging Face
        folder, a `.gguf` file, or "smollm2" (see `training.importer`). Not an architecture
        field: `launch.import_model` fills the others from the source.
      remat: rematerialise each decoder layer in the backward pass (`nnx.remat`): a backward
        keeps every layer's input plus one layer's internals instead of all layers'
        internals, for about one more forward pass of FLOPs. Same results; a runtime choice
        that may differ between the stages of one run (not compared with its config.json).
    """

    vocab_size: int = 32_000
    num_layers: int = 8
    embed_dim: int = 1024  # Table A.3 "embedding size" = "hidden size"
    num_heads: int = 4
    head_dim: int = 256
    mlp_dim: int = 4096
    max_len: int = 2048
    tie_embeddings: bool = True
    norm: str = "rms"
    rope_base: float = 10_000.0
    dtype: str = "float32"
    param_dtype: str = "float32"
    matmul_dtype: str = ""
    arch: str = "palm"
    num_kv_heads: int | None = None
    norm_eps: float = 1e-6
    norm_bias: bool = False
    rotary_pct: float = 1.0
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    parallel_residual: bool = False
    activation: str = "silu"
    source: str = ""
    remat: bool = False

    def __post_init__(self):
        architecture(self.arch)  # a registered architecture, else the error names the known ones
        if self.norm not in NORM_TYPES:
            raise ValueError(f"model.norm must be one of {NORM_TYPES}, got {self.norm!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for field in ("vocab_size", "num_layers", "embed_dim", "num_heads", "head_dim", "mlp_dim", "max_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"model.{field} must be positive, got {getattr(self, field)}")
        if not 0.0 < self.rotary_pct <= 1.0:
            raise ValueError(f"model.rotary_pct must be in (0, 1], got {self.rotary_pct}")
        if self.rotary_dim % 2:
            what = (
                "model.head_dim must be even for RoPE"
                if self.rotary_pct == 1.0
                else (
                    f"model.rotary_pct={self.rotary_pct} x model.head_dim={self.head_dim} must give an even rotary dim"
                )
            )
            raise ValueError(f"{what}, got {self.rotary_dim}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"model.matmul_dtype must be one of {MATMUL_DTYPES}, got {self.matmul_dtype!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"model.norm_eps must be positive, got {self.norm_eps}")
        if self.norm_bias and self.norm != "layer":
            raise ValueError("model.norm_bias needs model.norm='layer' (RMSNorm has no bias)")
        kv = self.kv_heads
        if kv <= 0 or self.num_heads % kv:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}")
        self._check_arch()

    def _check_arch(self):
        """Fields the architecture does not implement must keep their allowed values (no silent ignoring)."""
        for field, allowed in architecture(self.arch).fixed(self).items():
            if getattr(self, field) not in allowed:
                raise ValueError(
                    f"model.{field}={getattr(self, field)!r} is not supported by model.arch={self.arch!r} "
                    f"(allowed: {', '.join(map(repr, allowed))})"
                )

    @property
    def kv_heads(self) -> int:
        """Key/value heads with the architecture default resolved (palm: 1; others: num_heads)."""
        if self.num_kv_heads is not None:
            return self.num_kv_heads
        return architecture(self.arch).default_kv_heads or self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Rotated features per head: `int(head_dim * rotary_pct)` (HF GPT-NeoX's rule)."""
        return int(self.head_dim * self.rotary_pct)


def make_model(cfg: LMConfig, seed: int = 0) -> nnx.Module:
    """Initialises the `cfg.arch` model with `seed`."""
    return architecture(cfg.arch).model(cfg, rngs=nnx.Rngs(params=seed))


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """Functional form at the step boundary: `(graphdef, params)`."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def apply(
    graphdef: nnx.GraphDef, params: Any, tokens: Int[Array, "b t"], tap: Tap | None = None
) -> Float[Array, "b t v"]:
    """Pure forward pass: logits for `tokens` under `params` (any architecture: the graphdef knows)."""
    return nnx.merge(graphdef, params)(tokens, tap)


def nll_sum(
    graphdef: nnx.GraphDef,
    params: Any,
    inputs: Int[Array, "b t"],
    targets: Int[Array, "b t"],
    weights: Float[Array, "b t"],
    tap: Tap | None = None,
    *,
    weight_grad: bool = True,
) -> Float[Array, ""]:
    """`sum_{b,t} weights * -log p(targets | inputs)` (weights constant): the weighted
    next-token loss every gradient of the pretraining objective differentiates.

    A `DecoderLM` runs its layers, then the fused, chunked head (`head.head_nll_sum`: the
    `[B, T, V]` logits never exist, and a differentiated call gets its head gradients in the
    forward pass; `weight_grad=False` skips the output matrix's). The tap sees every layer but
    the head, so a caller that must tap an untied `unembed` (`vectors.unembed`) goes through
    `apply` instead. Other models (the linen adapter) go through their logits.
    """
    model = nnx.merge(graphdef, params)
    if isinstance(model, DecoderLM):
        return head_nll_sum(
            model.hidden(inputs, tap),
            model.head_matrix(),
            targets,
            weights,
            weight_grad=weight_grad,
            operand_dtype=model.cfg.matmul_dtype or None,
        )
    return -jnp.sum(token_log_probs(model(inputs, tap), targets) * jax.lax.stop_gradient(weights))


def abstract_params(cfg: LMConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Shapes of the parameters without allocating them (works for 8B configs)."""
    graphdef, params = _abstract_params(cfg)
    return graphdef, jax.tree.map(lambda x: x, params)  # a tree of its own: the caller may edit it


@functools.lru_cache(maxsize=16)
def _abstract_params(cfg: LMConfig) -> tuple[nnx.GraphDef, nnx.State]:
    # Traced once per config: an import asks for the shapes three times (the loader, the
    # weights' check, the optimizer state's), ~0.2 s of tracing each at pythia-14m.
    return nnx.eval_shape(lambda: split_model(make_model(cfg)))


def is_attributed(path: str, unembed: bool = False) -> bool:
    """Whether TrackStar attributes the parameter at `path`: all but the token embedding,
    attention key biases (`EXCLUDED_SUFFIXES`) and, unless `unembed`, an untied output
    embedding (`UNEMBED`); other biases and norm offsets are attributed."""
    top = path.split("/")[0]
    if top == UNEMBED:
        return unembed
    return top not in EXCLUDED_PARAMS and not path.endswith(EXCLUDED_SUFFIXES)


def attributed_paths(params: Any, unembed: bool = False) -> list[str]:
    """Parameter paths that TrackStar attributes (`is_attributed`)."""
    return [p for p in flat_params(params) if is_attributed(p, unembed)]


def check_length(cfg: LMConfig, tokens: Int[Array, "b t"]) -> None:
    """Raises if the sequence is longer than `model.max_len`."""
    if tokens.shape[1] > cfg.max_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_len={cfg.max_len}")


def embed_tokens(embed: Float[Array, "v d"], tokens: Int[Array, "b t"], dtype: str) -> Float[Array, "b t d"]:
    """Token embedding lookup, cast to the compute dtype."""
    return jnp.take(embed, tokens, axis=0).astype(dtype)


class DecoderLM(nnx.Module):
    """Embedding -> decoder layers -> final norm -> logits: the stack every architecture shares.

    Subclasses name their `ARCH`, their `DECODER_LAYER` class `(cfg, path, *, rngs)`, and
    whether tied logits are scaled by 1/sqrt(d) (`SCALE_TIED_LOGITS`: PaLM / T5X do, so logits
    start O(1); Llama and GPT-NeoX do not). Layers are named attributes (`layer_0`, ...), not
    a list, so that parameter paths contain only string keys (clean checkpoint paths).
    `__call__(tokens, tap=None) -> logits [B, T, vocab]` (float32).
    """

    ARCH: str = ""
    DECODER_LAYER: Any = None
    SCALE_TIED_LOGITS: bool = False

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        if cfg.arch != self.ARCH:
            raise ValueError(
                f"{type(self).__module__}.{type(self).__name__} needs model.arch={self.ARCH!r}, got {cfg.arch!r}"
            )
        self.cfg = cfg
        # Imported models bring their own weights; this init matters only for pretraining.
        emb_init = nnx.initializers.normal(stddev=1.0)
        self.embed = nnx.Param(emb_init(rngs.params(), (cfg.vocab_size, cfg.embed_dim), jnp.dtype(cfg.param_dtype)))
        for i in range(cfg.num_layers):
            setattr(self, f"layer_{i}", self.DECODER_LAYER(cfg, f"layer_{i}", rngs=rngs))
        self.final_norm = Norm(cfg.embed_dim, "final_norm", cfg)
        if not cfg.tie_embeddings:
            self.unembed = Linear(cfg.embed_dim, cfg.vocab_size, "unembed", cfg, rngs=rngs)

    def hidden(self, tokens: Int[Array, "b t"], tap: Tap | None = None) -> Float[Array, "b t d"]:
        """The final norm's output `[B, T, d]` (compute dtype): what the output head reads."""
        check_length(self.cfg, tokens)
        x = embed_tokens(self.embed[...], tokens, self.cfg.dtype)
        if tap is not None:  # the tap sees the token ids (the one-hot rows that multiply `embed`)
            x = tap("embed", tokens, x)
        # The tap (and the tracers it closes over, e.g. featurize's capture dummies) is closed
        # over, so a rematerialised forward routes through it exactly as the first.
        call = lambda lyr, h: lyr(h, tap)  # noqa: E731
        if self.cfg.remat:
            call = nnx.remat(call)
        for i in range(self.cfg.num_layers):
            x = call(getattr(self, f"layer_{i}"), x)
        return self.final_norm(x, tap)

    def head_matrix(self) -> Float[Array, "d v"]:
        """The output head as one matrix `[d, vocab]` (compute dtype): logits = hidden @ it."""
        if not self.cfg.tie_embeddings:
            return self.unembed.kernel[...].astype(self.cfg.dtype)
        w = self.embed[...].astype(self.cfg.dtype).T
        return w / math.sqrt(self.cfg.embed_dim) if self.SCALE_TIED_LOGITS else w

    def logits(self, h: Float[Array, "... d"], tap: Tap | None = None) -> Float[Array, "... v"]:
        """The output head on final hidden states: logits `[..., vocab]` float32."""
        if self.cfg.tie_embeddings:
            logits = dense_matmul(h, self.head_matrix(), self.cfg.matmul_dtype or None)
        else:
            logits = self.unembed(h, tap)
        return logits.astype(jnp.float32)

    def init_cache(self, batch: int, length: int) -> list[KVCache]:
        """Empty per-layer key/value caches for `decode`, positions 0..length-1."""
        c = self.cfg
        return [KVCache.empty(batch, length, c.kv_heads, c.head_dim, c.dtype) for _ in range(c.num_layers)]

    def decode(
        self, tokens: Int[Array, "b t"], cache: list[KVCache], pos: Int[Array, " b"]
    ) -> tuple[Float[Array, "b t d"], list[KVCache]]:
        """`hidden` for `t` new tokens per row at positions `pos[b] + 0..t-1`, attending to what
        `cache` holds before them; returns the final norm's output and the caches with the new
        keys and values written (incremental greedy decoding, `models.generate`). Row i's
        hidden states equal `hidden`'s at those positions of its whole sequence."""
        x = embed_tokens(self.embed[...], tokens, self.cfg.dtype)
        out = []
        for i, c in enumerate(cache):
            x, c = getattr(self, f"layer_{i}")(x, None, c, pos)
            out.append(c)
        return self.final_norm(x), out

    def __call__(self, tokens: Int[Array, "b t"], tap: Tap | None = None) -> Float[Array, "b t v"]:
        return self.logits(self.hidden(tokens, tap), tap)
