"""Parallel axes from outside the model: rank layout and groups (groups), pipeline stages
(pipeline), expert sharding and all-to-all dispatch (expert_parallel), gradient reduction over
data-parallel replicas (data_parallel). Tensor parallelism is deliberately absent (DESIGN 6)."""
