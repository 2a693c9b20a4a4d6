"""The training side's control of engines: `EngineClient` over HTTP (`vllm serve`), a child
process or a Ray actor. Never imports vllm nor the `in_vllm` room (hosts start by name)."""
