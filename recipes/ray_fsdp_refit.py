"""FSDP2 trainer actors and vLLM engine actors on Ray: an RL-shaped loop, one step off.

    python recipes/ray_fsdp_refit.py [--steps 3] [--trainers 2] [--engines 1]
        [--pause keep|wait|abort] [--address auto] [--result out.json]

Engines (`AsyncLLM` with the refit backend, one async actor each) generate batch k+1 while
the trainers (FSDP2 over gloo, one actor per rank) train on batch k; then the engines are
paused, refit (the trainers broadcast) and resumed, and the weight version is the step.
Every sample carries the versions its tokens came from, read from vLLM's `weight_versions`
(a sample still generating during a refit in mode keep carries two). The trainers learn on
the samples (next-token loss on prompt + completion). The loop is `recipes/ray_loop.py`'s.
`--address` joins a running cluster (`ray start --head` on one node, `ray start --address`
on the others); the checkpoint directory must then be visible to every node.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes.*

from common.launch.ray_cluster import RayLayout  # noqa: E402
from recipes.dtensor_fsdp_refit import PROBE_TOKENS, PROMPTS, fsdp_step, tiny_qwen3  # noqa: E402,E501
from recipes.engines import tiny_llm_kwargs  # noqa: E402
from recipes.ray_loop import Batches, SessionTrainer, main_loop, parser  # noqa: E402

PROMPT_LEN, NEW_TOKENS, SAMPLES_PER_RANK = 6, 16, 2
LLM_KWARGS = tiny_llm_kwargs(128, max_num_seqs=8)


class FSDPTrainer(SessionTrainer):
    """One trainer rank: the tiny Qwen3 (same seed on every rank), FSDP2, AdamW."""

    def build(self):
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from dtensor_refit import DTensorWeightSource, DtypePolicy

        self.model = tiny_qwen3()
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.rank = dist.get_rank()
        return DTensorWeightSource(self.model, DtypePolicy(torch.bfloat16))

    def save_checkpoint(self, path: str) -> None:
        """Every rank gathers (DCP full state dict); rank 0 writes it in bf16."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        from recipes.dtensor_fsdp_refit import save_bf16

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        if self.rank == 0:
            save_bf16(full, path)

    def train_step(self, samples: list[list[int]]) -> float:
        """Next-token loss on this rank's share of the samples (all of one length)."""
        return fsdp_step(self.model, self.opt, samples)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--trainers", type=int, default=2)
    args = p.parse_args(argv)
    batches = Batches(count=SAMPLES_PER_RANK * args.trainers, prompt_len=PROMPT_LEN,
                      new_tokens=NEW_TOKENS, vocab=1000)
    layout = RayLayout(trainers=args.trainers, engines=args.engines)
    main_loop(args, "ray-fsdp", layout, FSDPTrainer, (), batches, LLM_KWARGS,
              (PROMPTS, PROBE_TOKENS))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
