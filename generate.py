r"""Continue a prompt with a trained model: greedy by default, or temperature / top-k / top-p
sampling, several continuations per prompt if asked.

    python generate.py --config=configs/tiny.py --workdir=runs/tiny --prompt="def " \
        --max_new_tokens=64
    python generate.py --config=configs/tiny.py --checkpoint=runs/tiny/checkpoints/200 \
        --prompt="import " --prompt="class " --temperature=0.8 --top_k=40 --top_p=0.95 \
        --num_samples=3 --seed=1
    python generate.py --config=configs/tiny.py --checkpoint=init --prompt_ids=100,101,102 \
        --stop_ids=10

Text goes through the config's tokenizer (``config.data.tokenizer``; bytes without one) and the
continuation is printed as text; ``--prompt_ids`` takes token ids and prints ids. Each prompt is
printed first (``--- prompt 0 (4 tokens) ---``), then each of its continuations under
``--- continuation (length, 64 new tokens) ---``; ``--noecho`` prints the continuations alone.
``--num_samples=N`` draws N continuations per prompt, each with its own key (greedy has one:
N > 1 without sampling is refused). Repeat
``--prompt`` / ``--prompt_ids`` for a batch (prompts of different lengths decode exactly as
they would alone); without a tokenizer a ``--prompt``'s bytes go in as given, UTF-8 or not. A
``--max_new_tokens`` whose cache would not fit in memory is refused before anything is loaded,
with the most that fits. A checkpoint of another model is refused with the flag that passes the
run's own config (``--config=RUN``). The weights: ``--checkpoint`` (a step, checkpoints or run
folder, or ``init``), else the newest step under ``--workdir/checkpoints``. A Kimi Linear
checkpoint of transformers runs after
``python -m kimi_k3.hf import --hf_dir=DIR --workdir=RUN`` with
``--config=RUN/config.py --workdir=RUN``. All logic lives in ``kimi_k3.generate``.
"""

from absl import flags
from ml_collections import config_flags

from kimi_k3 import cli, compile_cache, generate

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (the model and its tokenizer), e.g. configs/tiny.py.",
    lock_config=True)
flags.mark_flag_as_required("config")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run folder: its newest checkpoint is used when --checkpoint is not given.")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "A checkpoint step, checkpoints or run folder, or 'init' (untrained).")
_PROMPT = flags.DEFINE_multi_string(
    "prompt", [], "Prompt text; repeat for a batch. Without a tokenizer (bytes) its bytes go in as "
    "given, UTF-8 or not; a tokenizer takes UTF-8 text only.")
_PROMPT_IDS = flags.DEFINE_multi_string(
    "prompt_ids", [], "Prompt as comma-separated token ids (ids are printed back); repeat for a batch.")
_MAX_NEW = flags.DEFINE_integer(
    "max_new_tokens", 64, "New tokens per prompt, at most; refused (with the most that fits) when "
    "the cache for the prompts plus these would not fit in memory.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float(
    "temperature", None, "Sampling temperature; 0 or unset: greedy (unset with --top_p: 1).")
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus sampling: keep the most probable tokens "
                            "holding this much probability, in (0, 1] (after --top_k).")
_TOP_K = flags.DEFINE_integer(
    "top_k", None, "Keep the k most probable tokens before --top_p; 0: all (unset with "
    "--temperature unset: greedy; alone: samples at temperature 1).", lower_bound=0)
_NUM_SAMPLES = flags.DEFINE_integer(
    "num_samples", 1, "Continuations per prompt, each with its own sampling key; more than 1 "
    "needs sampling (--temperature, --top_p or --top_k).", lower_bound=1)
_ECHO = flags.DEFINE_bool(
    "echo", True, "Print each prompt before its continuations, with a header on each; "
    "--noecho prints the continuations alone.")
_STOP_IDS = flags.DEFINE_list(
    "stop_ids", [], "Token ids that end a prompt's continuation (config.data.eos_id too, if >= 0).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_PIECE = flags.DEFINE_integer("piece_len", 2048, "Prompt tokens per prefill call (bounds memory).",
                              lower_bound=1)

_CACHE = compile_cache.define_flag()

def main(argv):
    cli.start(argv, _CACHE.value)
    generate.main(
        _CONFIG.value,
        prompts=_PROMPT.value,
        prompt_ids=_PROMPT_IDS.value,
        workdir=_WORKDIR.value,
        checkpoint=_CHECKPOINT.value,
        max_new_tokens=_MAX_NEW.value,
        temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value,
        top_k=_TOP_K.value,
        num_samples=_NUM_SAMPLES.value,
        echo=_ECHO.value,
        stop_ids=_STOP_IDS.value,
        seed=_SEED.value,
        piece_len=_PIECE.value,
        config_name=config_flags.get_config_filename(flags.FLAGS["config"]),
    )


if __name__ == "__main__":
    cli.run(main, config_from=("checkpoint", "workdir"), skip_teardown=True)
