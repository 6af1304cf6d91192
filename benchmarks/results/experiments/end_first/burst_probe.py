"""Lab probe: two end devices each send 8 x 80 KB to a cloud device at once (ranks 4 -> 0, 5 -> 1).

Prints, on ranks 0 and 1, each message's arrival (ms after the burst started) for 6 bursts.
Both flows cross the 20 Mbit/s end-edge link: shared fairly, message k of each flow arrives
after about (k + 1) x 64 ms. Run (as root):

    deepcee-lab run --topology configs/lab/cee6.yaml --launcher env --out /tmp/burst -- \
        python benchmarks/results/experiments/end_first/burst_probe.py
"""

import json
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
numel = 20480  # 80 KB of float32: one end device's half of a cee6 GPT micro-batch
arrivals = []
for _ in range(6):
    dist.barrier()
    time.sleep(0.5)
    dist.barrier()
    start = time.perf_counter()
    works = []
    if rank in (4, 5):
        works = [dist.isend(torch.ones(numel), rank - 4) for _ in range(8)]
    if rank in (0, 1):
        works = [dist.irecv(torch.empty(numel), rank + 4) for _ in range(8)]
    times = []
    for work in works:
        work.wait()
        times.append(round((time.perf_counter() - start) * 1e3))
    if rank in (0, 1):
        arrivals.append(times)
print("RESULT", rank, json.dumps(arrivals), flush=True)
dist.barrier()
time.sleep(3)
dist.destroy_process_group()
