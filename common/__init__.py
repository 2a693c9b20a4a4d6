"""refit core: plan, packing, refit group and the coalescing broadcaster (no vllm, no megatron)."""
