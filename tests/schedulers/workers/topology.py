"""Worker: where dp_plugin says this rank sits, and one all-reduce.

Prints ``rank R of S local L/LS cross C/CS host H rendezvous A:P sum X``;
X is the all-reduced sum of every rank's rank (S*(S-1)/2 when right).
Under srun it also prints ``job J`` (SLURM_JOB_ID), which the derived
port comes from.
"""

from __future__ import annotations

import os
import socket

import torch

import dp_plugin.torch as hvd
from dp_plugin.launch import runtime

hvd.init()
topo = runtime.topology()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="ranks").item()
host = topo.hostname or socket.gethostname()
print(f"rank {hvd.rank()} of {hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} "
      f"cross {hvd.cross_rank()}/{hvd.cross_size()} host {host} launcher {topo.launcher} "
      f"rendezvous {topo.rendezvous_addr}:{topo.rendezvous_port} sum {total:g} "
      f"job {os.environ.get('SLURM_JOB_ID', '-')}", flush=True)
hvd.shutdown()
