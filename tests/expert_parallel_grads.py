"""One step's gradients with the routed experts split over this torchrun's ranks (expert parallelism), against one
process holding every expert and running each rank's micro-batch in turn. Run by tests/test_trainer.py:
`torchrun --nproc_per_node 2 tests/expert_parallel_grads.py PARAMS`; prints the largest difference and exits 1 past
the tolerance."""
import copy
import sys

import torch
import torch.distributed as dist

from marin_study.config import load_params
from marin_study.model import Transformer

TOLERANCE = 1e-6  # fp32: the same sums in another order (a rank's rows meet the expert in another grouped matmul)

cfg = load_params(sys.argv[1]).model
dist.init_process_group("gloo")
rank, P = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
whole = Transformer(cfg)
tokens_RBT = torch.randint(0, cfg.vocab_size, (P, 2, 65), generator=torch.Generator().manual_seed(1))

for batch_BT in tokens_RBT:  # one process, every expert: the data-parallel mean of the ranks' losses
    (whole(batch_BT[:, :-1], batch_BT[:, 1:]).loss / P).backward()

split = copy.deepcopy(whole)
split.zero_grad(set_to_none=True)
split.shard_experts(dist.group.WORLD)
(split(tokens_RBT[rank, :, :-1], tokens_RBT[rank, :, 1:]).loss / P).backward()

worst = 0.0
for (name, expected), got in zip(whole.named_parameters(), split.parameters()):
    grad = got.grad.clone()
    if name.endswith(("gate_up_EDF", "down_EFD")):  # this rank's experts: every rank's rows reached them already
        per_rank = cfg.n_experts // P
        expected_grad = expected.grad[rank * per_rank:(rank + 1) * per_rank]
    else:  # replicated: summed over the ranks, as data parallelism does
        dist.all_reduce(grad)
        expected_grad = expected.grad
    worst = max(worst, float((grad - expected_grad).abs().max()))
print(f"rank {rank}: largest gradient difference {worst:.3g} (tolerance {TOLERANCE:g})", flush=True)
dist.destroy_process_group()
sys.exit(0 if worst <= TOLERANCE else 1)
