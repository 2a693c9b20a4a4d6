"""Launching a refit job: Ray placement of trainer and engine actors, and the trainer actors'
torch.distributed. Imports ray; never vllm nor megatron."""
