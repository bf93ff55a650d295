"""Features: TrackStar's per-example gradient vectors `P_d (grad Loss(z) / sqrt(V))` (§3 Eq. 2, §A.1).

- `grads`: the exact reference path (vmap(grad), materialised) and the output functions.
- `factored`: the fast path (per-layer inputs x output gradients, projected per token).
- `projection`: the layer-block plan and the two-sided Gaussian projection.
- `preconditioner`: the optimizer second-moment correction (Adafactor factored V).
- `vectors`: `VectorConfig` and the one jitted featurize step used by index, queries and evaluation.
"""

from trackstar_jax.features.vectors import VectorConfig, VectorFn, make_vector_fn
