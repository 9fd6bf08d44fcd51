"""Training and alignment (course module 04): how a language model learns, and how it is tuned.

- :mod:`llmu.training.cross_entropy`: the language-model loss in torch, and a chunked cross-entropy
  fused with the LM head's matmul, so that the logits of the whole vocabulary never exist for
  every position at once (ignore-index and label smoothing included);
- :mod:`llmu.training.kernels`: the Triton kernels of that cross-entropy, forward and backward,
  with their launchers and ``autograd.Function``;
- :mod:`llmu.training.loop`: the training loop for ``llmu.models`` (``Trainer``): AdamW's parameter
  groups and optimizer-state memory, warmup plus cosine learning rate, gradient clipping, gradient
  accumulation, and checkpoints that resume exactly;
- :mod:`llmu.training.adamw`: AdamW written out (decoupled weight decay, bias correction), equal
  to ``torch.optim.AdamW`` bit for bit;
- :mod:`llmu.training.batches`: ``get_batch``, random training windows of a token array or of an
  ``np.memmap`` larger than memory, reading only the windows it draws;
- :mod:`llmu.training.checkpoint`: ``save_checkpoint``/``load_checkpoint`` for a hand-written
  loop (weights, optimizer state, iteration, data-order state), to a path or a file object;
- :mod:`llmu.training.sft`: supervised fine-tuning on chat conversations, with the loss masked to
  the assistant's tokens;
- :mod:`llmu.training.lora`: low-rank adapters on chosen projections, merge and unmerge,
  trainable-parameter counts;
- :mod:`llmu.training.dpo`: direct preference optimization, the loss from the policy's and the
  reference's log-probabilities of chosen and rejected answers;
- :mod:`llmu.training.grpo`: GRPO's loss, with advantages normalised within each prompt's group of
  sampled completions, PPO's clipped surrogate and the k3 KL penalty towards the reference;
- :mod:`llmu.training.runs`: the notebook's three runs end to end (pretraining a small byte-level
  model, SFT of SmolLM2 with LoRA, DPO), shared with ``benchmarks/training_runs.py``, which records
  their long versions in ``llmu/data/training_runs.json``;
- :mod:`llmu.training.bench`: the ``fused_linear_cross_entropy_fwd`` (forward only) and
  ``fused_linear_cross_entropy`` (forward and backward) benchmark entries.

Course module 04, training and alignment. Import from the submodules
(``from llmu.training.loop import Trainer``); this package imports nothing itself.
"""
