"""What one refit moved and where its time went, per rank (`RefitSender` / `RefitReceiver`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RefitStats:
    """What one refit moved and where its time went, on this rank."""

    version: int
    num_buckets: int
    nbytes: int
    seconds: float = 0.0
    produce_s: float = 0.0  # iterating the weight source: gathers and conversions
    pack_s: float = 0.0
    send_s: float = 0.0  # sender: from the start until its last frame's collective ended
    replan_s: float = 0.0  # the needs exchange at the start (a re-plan when they changed)
    wait_s: float = 0.0  # blocked on the refit group's collectives
    load_s: float = 0.0  # receiver callback (e.g. model.load_weights), post_s included
    post_s: float = 0.0  # receiver: what runs after the last bucket (post-load processing)
    stage_s: float = 0.0  # receiver, host staging: the host's time copying (or, from page-locked
    # buffers, queueing the copies of) frames onto the apply device (in load_s)
    device_stage_s: float = 0.0  # receiver, host staging: those copies' device time
    device_apply_s: float = 0.0  # receiver on a GPU: the loads' and post_s's device time
    device_post_s: float = 0.0  # receiver on a GPU: post_s's share of device_apply_s
    buckets_loaded: int = 0  # buckets handed to the receiver callback
    checksum_s: float = 0.0  # receiver: checking the received bytes against the sender's
    delta_s: float = 0.0  # sender: delta-mode frames (pack + encode + send) and the shadows'
    # commit (`pack_s` is whole frames alone); receiver: rebuilding frames from deltas
    delta_frames: int = 0  # receiver: frames that arrived as deltas
    wire_bytes: int = 0  # this rank's bytes sent or received by the refit's broadcasts
    sources: int = 1  # sender: source streams sending at once (1: one ordered stream)
    source_imbalance: float = 1.0  # sender: the busiest source's bytes over the mean source's
    worker_imbalance: float = 1.0  # sender: the busiest receiving worker's bytes over the mean
    need_set: int = -1  # receiver: its need-set in this refit (-1: whole buckets to everyone)
    loaded_hash: str = ""  # receiver: a hash of the model-format bytes it loaded, if it made one
    role: str = "sender"
    # Each receiving rank's own timings ({"seconds", "wait_s", "load_s", "post_s",
    # "wire_bytes", "need_set", "delta_frames"}; "stage_s", "device_stage_s", "device_apply_s",
    # "device_post_s", "loaded_hash" where it has them), from the status exchange at the end
    # of a refit that landed.
    receivers: dict[int, dict[str, float | str]] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    def summary(self) -> str:
        mine = (f"produce {self.produce_s * 1e3:.1f} ms, pack {self.pack_s * 1e3:.1f} ms"
                if self.role == "sender" else f"load {self.load_s * 1e3:.1f} ms, checksum "
                                               f"{self.checksum_s * 1e3:.1f} ms")
        text = (f"refit v{self.version}: {self.nbytes / 1e6:.1f} MB in {self.num_buckets} "
                f"buckets, {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s; {mine}, wait "
                f"{self.wait_s * 1e3:.1f} ms)")
        if self.sources > 1:
            text += (f"; {self.sources} sources at once (busiest source {self.source_imbalance:.2f}"
                     f"x the mean, busiest worker {self.worker_imbalance:.2f}x)")
        if self.receivers:
            rank, slowest = max(self.receivers.items(), key=lambda kv: kv[1].get("seconds", 0))
            text += (f"; slowest of {len(self.receivers)} receivers: rank {rank} "
                     f"{slowest.get('seconds', 0) * 1e3:.1f} ms (load "
                     f"{slowest.get('load_s', 0) * 1e3:.1f} ms); most received "
                     + ", ".join(f"{n / 1e6:.1f} MB" + (f" (need-set {s})" if s >= 0 else "")
                                 for s, n in sorted(self.received_by_set().items())))
        return text

    def received_by_set(self) -> dict[int, int]:
        """The most bytes one receiver took in, per need-set (-1: no need-sets)."""
        out: dict[int, int] = {}
        for r in self.receivers.values():
            s = int(r.get("need_set", -1))
            out[s] = max(out.get(s, 0), int(r.get("wire_bytes", 0)))
        return out
