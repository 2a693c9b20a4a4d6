"""What a newcomer gets wrong, as a torchrun script of 2 ranks (`tests/serve/test_newcomer.py`):

    torchrun --nproc-per-node 2 newcomer_faults.py MODE URL CHECKPOINT VERSION

wrong_rank: only rank 0 calls `refit.connect` (rank 1 sleeps). dead_engine: URL serves nothing.
raise_mid_training: both connect and refit VERSION, then the training loop raises. `refit.connect`'s
timeout is 10 s (3 s for wrong_rank, which waits it out): each mode must end the job within
seconds of it, every rank saying why.
"""

import sys
import time

import torch
import torch.distributed as dist

import refit

TIMEOUT_S = 10.0
WRONG_RANK_TIMEOUT_S = 3.0


def main() -> None:
    mode, url, checkpoint, version = sys.argv[1:5]
    dist.init_process_group("gloo")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    source = refit.DictWeightSource(dict(model.state_dict()))
    if mode == "wrong_rank" and dist.get_rank() == 1:
        time.sleep(600)  # never calls connect: rank 0 must name it, torchrun stops this one
    try:
        timeout_s = WRONG_RANK_TIMEOUT_S if mode == "wrong_rank" else TIMEOUT_S
        with refit.connect(source, [url], timeout_s=timeout_s) as session:
            session.refit(int(version))
            if mode == "raise_mid_training":
                raise RuntimeError(f"rank {dist.get_rank()}: the training step failed")
    finally:
        dist.destroy_process_group()  # an exit with live gloo groups may abort


if __name__ == "__main__":
    main()
