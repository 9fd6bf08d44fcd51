"""Scale: training FLOPs, Chinchilla, MFU and serving cost (course module 15).

- :mod:`llmu.scale.flops`: ``6·N·D`` and attention's share of training FLOPs (per token, per step),
  on the parameter counts of ``llmu.moe.params``; Llama 3 8B and 70B shapes;
- :mod:`llmu.scale.chinchilla`: the ~20 tokens per parameter rule, Hoffmann et al.'s fitted law
  ``L(N, D) = E + A/N^α + B/D^β`` and its compute-optimal ``N`` and ``D`` in closed form,
  isoFLOP curves, published runs;
- :mod:`llmu.scale.mfu`: model FLOPs utilization, a short training run timed on this machine,
  published MFUs (PaLM's table, Llama 3 405B);
- :mod:`llmu.scale.serving`: dollars per million tokens, and the roofline ceilings of decode
  (memory-bound) and prefill (compute-bound) tokens/s;
- :mod:`llmu.scale.isoflop`: a scaling law fitted from your own runs (Hoffmann et al.'s approach
  2): an isoFLOP grid of small byte-level models trained on this CPU in about a minute, a
  parabola in ``ln N`` per budget, and power laws through the optima;
- :mod:`llmu.scale.parametric`: the same runs fitted the third way, the loss surface
  ``L(N, D) = E + A/N^α + B/D^β`` by a Huber loss on log residuals and L-BFGS from a grid of starts,
  and the allocation it implies;
- :mod:`llmu.scale.bench`: the ``train_step`` benchmark entry.

Course notebook: ``15_scale``. There is no Triton kernel in this module: it measures and prices
what the others built.
"""

from llmu.scale.chinchilla import (
                                   HOFFMANN_2022,
                                   PUBLISHED_RUNS,
                                   TOKENS_PER_PARAMETER,
                                   LossFit,
                                   TrainedModel,
                                   compute_optimal,
                                   isoflop_losses,
                                   rule_of_thumb,
)
from llmu.scale.flops import (
                                   LLAMA3_8B,
                                   LLAMA3_70B,
                                   as_shape,
                                   attention_share,
                                   forward_flops_per_token,
                                   kaplan_attention_flops,
                                   matmul_parameters,
                                   train_flops_per_token,
                                   train_step_flops,
                                   training_flops,
)

# The function mfu stays in its module (llmu.scale.mfu.mfu): at package level the name is the module.
from llmu.scale.mfu import PUBLISHED_MFU, TRAIN_SIZES, PublishedMFU, TrainRun, mfu_from_steps, train_run, train_step
from llmu.scale.serving import (
                                   cost_per_million_tokens,
                                   decode_step_seconds,
                                   decode_tokens_per_s,
                                   kv_bytes_per_token,
                                   prefill_tokens_per_s,
                                   weight_bytes,
)

__all__ = [
    "training_flops", "matmul_parameters", "forward_flops_per_token", "train_flops_per_token", "train_step_flops",
    "attention_share", "kaplan_attention_flops", "as_shape", "LLAMA3_8B", "LLAMA3_70B",
    "LossFit", "HOFFMANN_2022", "TOKENS_PER_PARAMETER", "rule_of_thumb", "compute_optimal", "isoflop_losses",
    "TrainedModel", "PUBLISHED_RUNS",
    "mfu_from_steps", "PublishedMFU", "PUBLISHED_MFU", "TrainRun",
    "train_step", "train_run", "TRAIN_SIZES",
    "cost_per_million_tokens", "kv_bytes_per_token", "weight_bytes", "decode_step_seconds", "decode_tokens_per_s",
    "prefill_tokens_per_s",
]
