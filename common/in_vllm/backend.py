"""The `refit` backend of vLLM's weight-transfer API: one instance in every vLLM worker.

vLLM builds it in each worker (TP x PP, every DP replica) when the engine runs with
`weight_transfer_config={"backend": "refit"}` (registered by `refit_vllm_plugin`). Through
vLLM's own routes and methods:

- `init_weight_transfer_engine(RefitInitInfo)`: this worker joins the refit group as rank
  `rank_offset + dp_index * (TP x PP) + worker rank` and vets the trainers' plan against the
  checkpoint it was started from; a refusal fails the setup on every rank.
- `start_weight_update()`: checks state only.
- `update_weights({"version": step})`: one whole refit: the in-place layerwise reload begins,
  every bucket is received and loaded (one `load_weights` per bucket), the reload is
  finalised, vLLM's skipped CPU fused-MoE prepack is redone and every param is checked to
  have been loaded, all before the end-of-refit status exchange, so a failure here (or on any
  other rank) fails the refit on every rank, and the trainers read this worker's timings.
- `finish_weight_update()`: checks that a refit landed since the start.

Each call moves this worker's refit state (`common.engine.state.RefitState`: complete,
refitting, landed, mixed, rolled back), which the engine's guard and joining trainers read
(`common.in_vllm.worker_ext`).

Only vLLM processes import this module (it imports vllm).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.layerwise import (
    LAYERWISE_INFO,
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from common.checkpoint import checkpoint_tensors, engine_dtypes, plan_problems
from common.engine.state import RefitState
from common.errors import ROLLED_BACK, NeedsRefusedError
from common.in_vllm import loaded_hash, map_steps, undo
from common.in_vllm.apply import DirectLoad
from common.in_vllm.load_map import CopyRecorder
from common.in_vllm.map_check import Kept, changed_params, readable_params
from common.in_vllm.map_steps import LoadMapSteps
from common.in_vllm.reload_fixes import ReloadFixes
from common.plan import RefitPlan
from common.stats import RefitStats
from common.transfer.sender import RefitReceiver
from common.wire.group import RefitGroup

log = logging.getLogger(__name__)


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """Where and as what this engine's workers join the refit group (plain JSON)."""

    host: str
    port: int
    world_size: int  # every trainer rank + every worker of every engine
    num_trainers: int
    rank_offset: int  # this engine's first refit rank
    timeout_s: float = 300.0
    group_name: str = "refit"
    # The refit group's device; None: this worker's. "cpu" on a CUDA engine: host staging
    # (gloo with CPU trainers; each frame is copied to the GPU, then applied).
    transport_device: str | None = None


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """The version (training step) this refit must carry; the trainers' headers are checked."""

    version: int
    verify: bool = False  # `version` is the one this engine holds: fail if a param changes
    abandon: bool = False  # end a started refit whose trainer is gone (nothing is loaded)


class RefitTransferEngine(LoadMapSteps, WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """Receives refits over the refit group into this worker's model, in place (the load
    map's steps: `common.in_vllm.map_steps`)."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: RefitReceiver | None = None
        self.in_update = False
        self.last_version: int | None = None  # last refit that landed on this worker
        self.landed = False  # a refit landed since start_weight_update
        self.direct: DirectLoad | None = None  # the learned map (REFIT_APPLY=direct)
        self._reloading: torch.nn.Module | None = None  # what this refit's reload opened
        self.apply_report: dict = {}
        self._post_split: dict[str, float] = {}  # the last refit's post-load steps, timed
        self.state = RefitState()  # what this worker holds (module docstring)
        self._touched = False  # the refit in progress began receiving bytes

    @property
    def refit_rank_within_engine(self) -> int:
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        if self.in_update:
            raise RuntimeError("cannot join a refit group during a weight update")
        old = self.receiver
        self.shutdown()
        rank = init_info.rank_offset + self.refit_rank_within_engine
        wire = torch.device(init_info.transport_device or self.device)
        group = RefitGroup(host=init_info.host, port=init_info.port, rank=rank,
                           world_size=init_info.world_size, num_trainers=init_info.num_trainers,
                           timeout_s=init_info.timeout_s, device=wire,
                           name=init_info.group_name)
        try:
            self.receiver = RefitReceiver.setup(group, check=self._check_plan,
                                                base_place=undo.base_place(wire))
        except Exception:
            group.destroy()
            raise
        if wire.type != self.device.type:
            self.receiver.stage_onto(self.device)
        plan = self.receiver.plan
        self.receiver.keep_base_of(old)  # a rejoin keeps its base: deltas and rollback go on
        if self.direct is not None and self.direct.plan_digest != plan.digest:
            self.direct = None  # learned for another plan: the next refit learns again
        if self.direct is None:
            self.apply_report = {"path": map_steps.apply_mode()}
        self._report_needs()  # a kept map: its needs hold in the new group from its first refit
        self._index = {spec.name: i for i, spec in enumerate(plan.specs)}
        self.fixes = ReloadFixes(self.model)
        self._bucket_of = {plan.specs[b.start].name: b.index for b in plan.buckets
                           if b.stop > b.start}
        log.info("%s: joined with plan %s (%d tensors, %d buckets)", group.label,
                 plan.digest[:12], len(plan.specs), len(plan.buckets))

    @staticmethod
    def trainer_send_weights(*args: object, **kwargs: object) -> None:
        """vLLM's trainer-side send (abstract in vLLM 0.26): refit's trainers send with
        `common.transfer.sender.RefitSender` instead."""
        raise RuntimeError("refit's trainers send with common.transfer.sender.RefitSender")

    def _check_plan(self, plan: RefitPlan) -> str | None:
        """Why this engine cannot take `plan` (every problem, naming the tensors); None if it
        can (`common.checkpoint.plan_problems`).

        Names and shapes come from the checkpoint the engine was started from (vLLM has no
        dry-run load); dtypes as `common.checkpoint.engine_dtypes` says. Every checkpoint
        tensor must be in the plan, or its weight would go stale.
        """
        config = self.model_config
        checkpoint = checkpoint_tensors(config.model)
        kept = engine_dtypes({n: p.dtype for n, p in self.model.named_parameters()},
                             checkpoint, config.dtype, config.quantization is not None)
        problems = plan_problems(plan.specs, checkpoint, kept, "the engine")
        if not problems:
            return None
        return (f"against the checkpoint this engine was started from ({config.model}): "
                + "; ".join(problems))

    def start_weight_update(self) -> None:
        if self.receiver is None:
            raise RuntimeError("start_weight_update before init_weight_transfer_engine: this "
                               "engine has not joined a refit group")
        if self.in_update:
            raise RuntimeError("a weight update is already in progress")
        self.in_update, self.landed = True, False
        self.state = self.state.started()

    def update_weights(self, update_info: dict) -> None:
        """One whole refit (see the module docstring); CPU needs no accelerator sync. Any
        failure moves the state (complete, rolled back or mixed) before it is raised."""
        info = self.parse_update_info(update_info)
        self._touched = False
        try:
            if info.abandon:
                raise RuntimeError(f"refit v{info.version} abandoned: its trainer is gone "
                                   f"(a joining trainer ended it); nothing was loaded")
            self.receive_weights(info)
        except Exception as e:
            self.state = self.state.after_failure(info.version, e, self._touched,
                                                  self._base_version())
            raise
        finally:
            self.in_update = False
        self.state = self.state.after_landing(info.version, self._base_version())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        if not self.in_update:
            raise RuntimeError("update_weights without start_weight_update")
        version, verify = update_info.version, update_info.verify
        self._check_version(version, verify)
        held = readable_params(self.model) if verify else None
        receiver, model, loaded = self.receiver, self.model, set()
        direct, recorder = self._pick_path()
        self._report_needs()
        kept = Kept(model) if recorder and map_steps.verify_map() else None
        t0 = time.perf_counter()
        self._open_reload(direct)
        finalized = False

        on_bucket, on_compact = self._loaders(direct, loaded, recorder, kept)

        def finalize() -> str | None:  # before the status exchange: a failure reaches all
            nonlocal finalized
            finalized = True
            self._end_reload(loaded, recorder)
            t = time.perf_counter()
            why = self.fixes.describe_missing(loaded)
            self._post_split["check_s"] = time.perf_counter() - t
            if why:
                raise RuntimeError(why)
            if recorder is not None:
                self._learn(recorder, kept)
            digest = None  # to every rank in the status record
            if direct is not None and direct.hashes is not None:
                direct.hash_copy_layers()
                digest = self.apply_report["loaded_hash"] = direct.hashes.digest()
            if held is not None:
                self._check_unchanged(held, loaded, version)
            return digest

        failure: Exception | None = None
        self._touched, self.state = True, replace(self.state, receiving=True)
        try:
            stats = receiver.receive(on_bucket, on_done=finalize, version=version,
                                     on_compact=on_compact, verify=verify)
        except NeedsRefusedError as e:
            self._drop_refused_map(e)
            raise
        except Exception as e:  # noqa: BLE001 - rolled back (where it can be), then raised
            failure = e
        finally:
            for watcher in (recorder, kept):
                if watcher is not None:
                    watcher.close()
            if not finalized:  # the group failed mid-refit: close the reload session anyway
                self._close_reload(loaded, version)
        if failure is not None:
            self._roll_back(failure, direct, version)
        if receiver.base is not None:  # committed with the status exchange
            self.apply_report.update(undo.base_report(receiver.base))
        self.last_version, self.landed = version, True
        self._report_landed(version, direct, stats, t0)

    def _loaders(self, direct: DirectLoad | None, loaded: set[str],
                 recorder: CopyRecorder | None = None, kept: Kept | None = None) -> tuple:
        """The receiver's callbacks for whole buckets and compact frames: through the map, or
        `load_weights` (watched by `recorder`, its bytes `kept` for the map's check)."""
        plan = self.receiver.plan

        def on_bucket(items: list[tuple[str, torch.Tensor]]) -> None:
            index = self._bucket_of[items[0][0]]
            if direct is not None:
                loaded.update(direct.load(index, items, self._load))
                return
            if kept is not None:
                kept.keep(index, items, plan.buckets[index].nbytes)
            loaded.update(self._load(items, recorder))

        def on_compact(index: int, payload: torch.Tensor) -> None:
            loaded.update(direct.load_compact(index, payload, plan, self._load))

        return on_bucket, on_compact

    def _roll_back(self, failure: Exception, direct: DirectLoad | None, version: int) -> None:
        """A failed refit: re-apply the last complete version's bytes of every frame it
        applied (the receiver's undo log) and redo vLLM's post-load processing; raise the
        refit's error saying whether every worker of this engine rolled back."""
        t0, why, loaded = time.perf_counter(), None, set()
        try:
            self._open_reload(direct)
            try:
                count = self.receiver.roll_back(*self._loaders(direct, loaded))
            finally:
                self._end_reload(loaded)
        except Exception as e:  # noqa: BLE001 - the refit's own error is raised below
            why = f"{type(e).__name__}: {e}"
        error = undo.engine_verdict(failure, why, self.last_version)
        if ROLLED_BACK in str(error):
            log.warning("%s: refit v%d failed; rolled back %d frames to v%s in %.1f ms",
                        self.receiver.group.label, version, count, self.last_version,
                        (time.perf_counter() - t0) * 1e3)
            if self.receiver.base is not None:  # (none: nothing had reached the loaders)
                self.apply_report.update(undo.base_report(self.receiver.base))
            self.apply_report["rolled_back"] = {"version": version, "frames": count}
        raise error from failure

    def _open_reload(self, direct: DirectLoad | None) -> None:
        """vLLM's reload for this refit: the learned map's layers (hashing what they load
        when asked), or every layer for `load_weights`; `_reloading` is what was opened."""
        if direct is None:
            initialize_layerwise_reload(self.model)
            self._reloading = self.model
            return
        direct.hashes = loaded_hash.LoadedHashes() if loaded_hash.enabled() else None
        self._reloading = direct.begin()

    def _end_reload(self, loaded: set[str], recorder: CopyRecorder | None = None) -> None:
        """Finalise vLLM's reload session (watched by a learning refit's `recorder`) and
        redo what it skips for the `loaded` params; both timed for the apply report."""
        t0 = time.perf_counter()
        with recorder if recorder is not None else contextlib.nullcontext():
            finalize_layerwise_reload(self._reloading, self.model_config)
        t1 = time.perf_counter()
        self.fixes.after_load(loaded)
        self._post_split = {"finalize_s": t1 - t0, "fixes_s": time.perf_counter() - t1}

    def _close_reload(self, loaded: set[str], version: int) -> None:
        """Close the reload session of a refit that failed before its own finalisation."""
        try:
            self._end_reload(loaded)
        except Exception:  # noqa: BLE001 - the refit's own error is the one to raise
            log.exception("closing the reload session of failed refit v%d", version)

    def _check_version(self, version: int, verify: bool) -> None:
        """A refit must be newer than what the engine holds; a verification, the same."""
        held = self.last_version
        if verify and held is not None and version != held:
            raise ValueError(f"verify v{version}: this engine holds v{held}")
        if not verify and held is not None and version <= held:
            raise ValueError(f"refit v{version} is not newer than v{held}, the version this "
                             f"engine already holds")

    def _report_landed(self, version: int, direct: DirectLoad | None, stats: RefitStats,
                       t0: float) -> None:
        if direct is not None:  # where the apply's time went: copies, vLLM's layer processing
            self.apply_report["last_refit"] = {**direct.times, "post_s": stats.post_s,
                                               **self._post_split}
        path = "direct" if direct is not None else "load_weights"
        log.info("%s: refit v%d landed in %.1f ms via %s (wait %.1f ms, load %.1f ms)",
                 self.receiver.group.label, version, (time.perf_counter() - t0) * 1e3, path,
                 stats.wait_s * 1e3, stats.load_s * 1e3)

    def _check_unchanged(self, held: dict[str, torch.Tensor], loaded: set[str],
                         version: int) -> None:
        """A verification: every readable param must be as it was before the resent bytes
        were applied; the params no read can see (emptied by CPU kernels) are counted."""
        differ = changed_params(self.model, held)
        unreadable = len(loaded - held.keys())
        self.apply_report["last_verify"] = {"version": version, "compared": len(held),
                                            "unreadable": unreadable, "differ": len(differ)}
        if differ:
            raise RuntimeError(f"verify v{version}: {len(differ)} of {len(held)} readable "
                               f"params differ from what the trainers sent, e.g. "
                               f"{differ[:3]} ({unreadable} params cannot be read here)")
        log.info("%s: verify v%d: %d readable params hold what the trainers sent (%d params "
                 "cannot be read)", self.receiver.group.label, version, len(held), unreadable)

    def _load(self, items: list[tuple[str, torch.Tensor]],
              recorder: CopyRecorder | None = None) -> set[str]:
        """One batched load (watched by `recorder` when learning); then copy out any view
        vLLM still holds (a layer split across buckets waits for its other parts), since the
        receive buffer is about to be reused."""
        if recorder is None:
            names = self.model.load_weights(items)
        else:
            recorder.add_sources([(self._index[n], t) for n, t in items])
            with recorder:
                names = self.model.load_weights(items)
        for info in list(LAYERWISE_INFO.values()):
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if isinstance(value, torch.Tensor) and self.receiver.owns(value):
                        bound.arguments[key] = copy = value.clone()
                        if recorder is not None:
                            recorder.add_copy(value, copy)
        return names

    def finish_weight_update(self) -> None:
        """vLLM itself refuses a finish after a failed update; this refuses one after none."""
        if not self.landed:
            raise RuntimeError(f"finish_weight_update without a refit that landed since "
                               f"start_weight_update (last complete v{self.last_version})")
        self.state = self.state.after_finish()

    def _base_version(self) -> int | None:
        """The version this worker's base holds (deltas go on it, a rollback restores it)."""
        base = None if self.receiver is None else self.receiver.base
        return None if base is None else base.version

    def shutdown(self) -> None:
        """Leave the refit group (e.g. before rebuilding it after a failure)."""
        if self.receiver is not None:
            self.receiver.group.destroy()
        self.receiver = None
