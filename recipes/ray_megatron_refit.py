"""Megatron-Core trainer actors and vLLM engine actors on Ray: an RL-shaped loop, one step off.

    python recipes/ray_megatron_refit.py [--moe] [--steps 3] [--engines 1]
        [--pause keep|wait|abort] [--address auto] [--result out.json]

Four trainer actors build the tiny Megatron GPT of `recipes/mcore_models.py` on gloo: Qwen3
TP2 x PP2, or with `--moe` Qwen3-MoE PP2 x EP2 (x DP2); each trains on its data-parallel
share of the samples the engines generated (next-token loss through Megatron's pipeline).
The loop, engines, version tags and timings are `recipes/ray_loop.py`'s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes.*

from common.launch.ray_cluster import RayLayout  # noqa: E402
from recipes.engines import tiny_llm_kwargs  # noqa: E402
from recipes.mcore_models import MAX_POS, MICRO, MICROBATCHES, SEQ, VOCAB  # noqa: E402
from recipes.megatron_refit import NEW_TOKENS, PROMPTS  # noqa: E402
from recipes.ray_loop import Batches, SessionTrainer, main_loop, parser  # noqa: E402

TRAINERS, PROMPT_LEN = 4, 6
LLM_KWARGS = tiny_llm_kwargs(MAX_POS, max_num_seqs=8)


class MegatronTrainer(SessionTrainer):
    """One trainer rank: its Megatron chunk (randomised, the same seed everywhere), AdamW."""

    def build(self):
        import warnings

        from mcore_refit import DtypePolicy, MegatronWeightSource, converter_for
        from recipes import mcore_cpu_shim
        from recipes.mcore_configs import setup_parallel
        from recipes.mcore_models import DENSE, MOE, build_model, randomise, wrap_for_training

        warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
        mcore_cpu_shim.install()  # torch.cuda stand-ins megatron-core needs on CPU
        self.layout = MOE if self.args[0] else DENSE
        setup_parallel(self.layout)
        chunks = build_model(self.layout)
        randomise(chunks, seed=7)
        self.model, self.opt = wrap_for_training(chunks)
        self.step = 0
        return MegatronWeightSource(self.model, converter_for(self.layout.model_type),
                                    vocab_size=VOCAB, policy=DtypePolicy(torch.bfloat16))

    def save_checkpoint(self, path: str) -> None:
        """Every rank gathers; rank 0 writes the HF checkpoint the engines start from."""
        from common.config import RefitConfig
        from common.plan import RefitPlan
        from recipes.megatron_refit import gather_full, write_checkpoint

        full = gather_full(self.source, RefitPlan.build(self.source.plan_specs(), RefitConfig()))
        if full is not None:
            write_checkpoint(full, self.layout, path)

    def train_step(self, samples: list[list[int]]) -> float:
        """This data-parallel rank's share of the samples as Megatron micro-batches."""
        from recipes.mcore_models import dp_share, train_step

        self.step += 1
        return train_step(self.model, self.opt, self.step, batches=dp_share(samples))


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--moe", action="store_true", help="Qwen3-MoE on PP2 x EP2 (x DP2)")
    args = p.parse_args(argv)
    dp = 2 if args.moe else 1  # DENSE: TP2 x PP2 = 4 ranks; MOE: PP2, EP inside DP2
    batches = Batches(count=MICROBATCHES * MICRO * dp, prompt_len=PROMPT_LEN,
                      new_tokens=SEQ + 1 - PROMPT_LEN, vocab=VOCAB)
    layout = RayLayout(trainers=TRAINERS, engines=args.engines)
    main_loop(args, "ray-megatron", layout, MegatronTrainer, (args.moe,), batches, LLM_KWARGS,
              (PROMPTS, NEW_TOKENS))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
