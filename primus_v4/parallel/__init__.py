"""Parallel axes from outside the model: rank layout and groups (groups), pipeline stages
(pipeline: layout strings; pipeline_stage: a stage's modules; pipeline_schedule: 1F1B), expert
sharding and all-to-all dispatch (expert_parallel), the contiguous pack split and its sequence
comm (context_parallel), the replicas each gradient is summed over (data_parallel), the
global gradient norm (grad_norm), and applying them to a built model (parallelize). Tensor
parallelism is deliberately absent (DESIGN 6)."""
