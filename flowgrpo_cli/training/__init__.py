"""What is trained: the policy (LoRA or full weights on a model adapter, their checkpoints in
diffusers' format) and the trainer (FSDP2 sharding, AdamW, EMA, checkpoint state)."""
