"""Which gloo operations take CUDA tensors, on two ranks sharing one GPU (what FSDP2 and sequence
parallelism would need to run on ranks that share a GPU without NCCL). Prints one JSON line:
``{op: "ok" | "error: ..."}``.

    python benchmarks/gpu_gloo_probe.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def ops(rank: int) -> dict[str, Callable[[], object]]:
    dev = torch.device("cuda", 0)
    x = torch.full((4,), float(rank + 1), device=dev)
    return {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8, device=dev), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(2, device=dev), x),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4, device=dev), x),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
        "send_recv": lambda: dist.send(x, 1) if rank == 0 else dist.recv(torch.empty(4, device=dev), 0),
    }


def worker(rank: int, port: int, out: dict[str, str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for name, op in ops(rank).items():
        try:
            op()
            torch.cuda.synchronize()
            result = "ok"
        except Exception as err:  # the probe records what failed, whatever it was
            result = f"error: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        if rank == 0:
            out[name] = result
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(29611, out), nprocs=2)
        print(json.dumps({"benchmark": "gpu_gloo_probe", "torch": torch.__version__, **dict(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
