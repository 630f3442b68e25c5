"""Parallel axes, model-agnostic: rank layout and process groups (groups), pipeline layout
strings and stage plans (pipeline_layout) and the 1F1B schedule (pipeline_schedule), the
all-to-all expert dispatcher (expert_parallel), the context-parallel sequence comm and row split
(context_parallel), the replicas each gradient is summed over (data_parallel) and the global
gradient norm (grad_norm). How a model is cut along these axes is the model's own
(models/deepseek_v4/infra/parallelize.py). Tensor parallelism is deliberately absent: the single KV
latent, the indexer scores and the compressed pools have no head axis worth sharding, so long
context scales with CP and experts with EP (docs/DESIGN.md)."""
