"""Tensor parallelism inside one engine: N rank processes each hold 1/N of every layer (engine/parallel/sharding.py),
rank 0 schedules and sends each step's plan to the others (engine/parallel/ranks.py), and every rank runs its shard
of the forward, joined by all-reduces over a process group of their own (engine/parallel/group.py): Gloo on CPU,
NCCL on CUDA."""
