"""Train a Kimi K3-style hybrid LM.

    python train.py --config=configs/tiny.py --workdir=runs/tiny
    python train.py --config=configs/small.py --workdir=runs/small --config.train.steps=300 \\
        --config.mesh.fsdp=2

Multi-host: on a TPU pod slice, SLURM or Open MPI, add ``--multihost`` (JAX reads the cluster
from the environment); elsewhere give ``--coordinator_address=HOST:PORT --num_processes=N
--process_id=I`` (or set JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID).
All logic lives in ``kimi_k3.train_lib``.

Exit codes (``kimi_k3.runtime``): 0 done (train.steps reached); 1 failed (bad data, a failed
checkpoint save, a non-finite step, a run folder in use by another trainer); 2 a bad flag or
config; 75 stopped by SIGTERM or Ctrl-C after saving the step it reached: run the same command
again to resume (a second Ctrl-C stops at once, without saving).
"""

import os

import kimi_k3

# A training process owns its accelerator (kimi_k3.TRAINER_MEM_FRACTION of a GPU's memory). Set
# XLA_PYTHON_CLIENT_MEM_FRACTION yourself to choose otherwise.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", kimi_k3.TRAINER_MEM_FRACTION)

from absl import flags
from ml_collections import config_flags

from kimi_k3 import cli, compile_cache, train_lib

config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/tiny.py[:arg].",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run folder: checkpoints, metrics.jsonl, TensorBoard.")
_MULTIHOST = cli.define_multihost_flags()
_CACHE = compile_cache.define_flag()
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
    cli.start(argv, _CACHE.value)
    _MULTIHOST.initialize()
    train_lib.train(FLAGS.config, os.path.abspath(FLAGS.workdir),
                    config_name=config_flags.get_config_filename(FLAGS["config"]))


if __name__ == "__main__":
    cli.run(main)
