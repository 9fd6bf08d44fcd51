"""Parallel training (course module 14): one model, many processes, each strategy written out.

Every strategy runs on real ``torch.distributed`` processes (gloo on CPU, NCCL on GPUs), started
by :func:`llmu.distributed.launch`, which calls a rank function ``fn(rank, world_size, ...)`` on
every process; each module below has a ``demo(rank, world_size, ...)`` for it to run.

- ``data_parallel.py``: data parallelism (what DDP does): parameters broadcast from rank 0,
  gradients averaged by bucketed all-reduces launched from per-parameter hooks, overlapped with
  the backward; ``no_sync`` for gradient accumulation.
- ``zero.py``: ZeRO stages 1, 2 and 3 (optimizer states, then gradients, then parameters sharded
  over the ranks, with reduce-scatter and all-gather; stage 3 gathers each layer's parameters just
  in time and frees them after use), any element-wise optimizer (SGD, Adam, AdamW, ...), mixed
  precision (bf16/fp16 compute over float32 master weights, reductions and optimizer state), the
  per-rank memory against the ZeRO paper's formulas, and a comparison with PyTorch's FSDP2
  (``fully_shard``).
- ``sharded_optimizer.py``: ``ShardedOptimizer``, ZeRO stage 1 over any list of parameters: each
  rank keeps the optimizer state of its slice only, steps it, and all-gathers the parameters.
- ``tensor_parallel.py``: column- and row-parallel linear layers, the Megatron MLP, attention
  (heads split, GQA-aware) and decoder layer, the conjugate identity / all-reduce operators, and
  ``count_communication`` to check two all-reduces per layer forward and two backward.
- ``context_parallel.py``: ring attention, forward and backward, merging partial results with
  FlashAttention's logsumexp; contiguous and load-balanced zigzag layouts, and the per-step
  schedule.
- ``pipeline_parallel.py``: GPipe and 1F1B schedules as printable per-rank action lists, run over
  micro-batches with point-to-point isend/recv; the measured bubble against
  ``(p - 1) / (m + p - 1)``, the peak number of micro-batches in flight, and a per-rank timeline.
- ``memory.py``: the memory of a training step per GPU (weights, gradients, optimizer states,
  activations after Korthikanti et al. 2022, with or without recomputation) under DP/ZeRO/TP/PP/CP.
- ``comm.py``: the α–β cost model of ring all-reduce, all-gather, reduce-scatter and trees, bus
  bandwidth, and link presets (NVLink, InfiniBand, PCIe).
- ``bench.py``: the ``all_reduce`` benchmark entry (bus bandwidth over message size, on real
  processes).

Expert parallelism lives with the Mixture-of-Experts module: ``llmu.moe.expert_parallel``.

Import the submodule you need (``from llmu.parallel import zero``); this package imports nothing.
"""
