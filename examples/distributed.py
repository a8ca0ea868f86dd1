"""The exact iEF step over a data-parallel batch: run with ``torchrun --nproc_per_node 2 examples/distributed.py``.

Each process holds its own 16 samples; ``IEF`` with ``process_group=`` steps exactly as one process would on the 32
samples of the union batch (the Gram matrix couples every pair of samples across processes). On GPUs use
``backend="nccl"`` and move the model and batches to ``cuda:LOCAL_RANK``; a ``DistributedDataParallel`` model is
taken as it is (its group is the default ``process_group``).
"""
import torch
import torch.distributed as dist

import ief

dist.init_process_group(backend="gloo")  # torchrun sets the rank, the world size and the address
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial model on every process
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
data = torch.Generator().manual_seed(1 + rank)  # each process its own samples
x, y = torch.randn(16, 8, generator=data), torch.randint(0, 4, (16,), generator=data)
opt = ief.optim.IEF(model, lr=0.5, damping=1e-4, process_group=dist.group.WORLD)
for step in range(5):
    loss = opt.step(x, y)  # the union batch's loss, the same on every process
    if rank == 0:
        print(f"step {step}  L = {loss.item():.3f} over {16 * world} samples on {world} processes")
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
replicas = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(replicas, flat)
if rank == 0:
    print("replicas identical:", all(torch.equal(r, flat) for r in replicas))
dist.destroy_process_group()
