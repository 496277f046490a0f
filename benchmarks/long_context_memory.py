r"""Forward time and peak device memory against sequence length: all-MLA vs 3:1 vs all-KDA.

    # on a GPU (bf16, 8 layers, d_model 512): 8K ... 1M tokens, where it fits
    python benchmarks/long_context_memory.py --out_dir=benchmarks/results/long_context
    # CPU, toy sizes, seconds (what the tests run)
    python benchmarks/long_context_memory.py --smoke --out_dir=/tmp/lcm

Two modes per model, batch 1:

- ``forward``: one jitted whole-sequence ``model(tokens)`` (the blockwise training forward);
  peak memory holds every layer's activations over the whole sequence;
- ``prefill``: the sequence in pieces of ``--piece_len`` through jitted ``model.prefill``, the
  cache carried (and donated) between pieces, as ``eval.py`` runs. Memory is the weights, one
  piece's activations and the cache: KDA's state is a fixed [HV, K, V] per layer, MLA's latent
  cache grows by kv_lora_rank + shared_head_dim numbers per token per layer.

Columns of ``long_context_memory.csv``: variant, pattern, mode, seq_len, status (ok | oom |
too_slow | error), seconds (median of the timed passes after the first, compilation excluded;
the only pass when there is one; ``time_passes``), tokens_per_s,
peak_bytes (the allocator's high-water mark, ``memory_stats()['peak_bytes_in_use']``, where the
backend reports it: GPU/TPU; blank on CPU), xla_bytes (XLA's compiled estimate: arguments +
outputs + temporaries - aliases, of the one compiled call; every backend), cache_bytes (prefill:
the carried cache), params.

Each (variant, mode) series runs in its own subprocess, lengths in increasing order, so the
high-water mark of that process is the peak of the current length (the driver itself never
touches the accelerator). A series stops at the first length that runs out of memory or takes
longer than ``--max_seconds``. The CSV, the Markdown table and ``long_context_time.png`` /
``long_context_memory.png`` are rewritten after every point, so a run stopped by an outer time
limit keeps everything it measured.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

# JAX and the model are imported inside the functions that run in each series' own child
# process: the parent only spawns them and gathers their results, so it never holds a device.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

VARIANTS = ("all-MLA", "3:1", "all-KDA")
MODES = ("forward", "prefill")
FIELDS = ("variant", "pattern", "mode", "seq_len", "status", "seconds", "tokens_per_s", "peak_bytes",
          "xla_bytes", "cache_bytes", "params", "detail")
RESULT = "RESULT "  # a worker's stdout line: this prefix, then one row as JSON
DEVICE = "DEVICE "  # a worker's stdout line: this prefix, then the device it runs on


def pattern_for(variant: str, num_layers: int) -> str:
    """The layer letters of a variant: all-MLA "MMMM...", 3:1 "KKKM..." (last layer MLA), all-KDA."""
    if variant == "all-MLA":
        return "M" * num_layers
    if variant == "all-KDA":
        return "K" * num_layers
    if variant == "3:1":
        p = ("KKKM" * num_layers)[:num_layers]
        return p[:-1] + "M"
    raise ValueError(f"--variants: {variant!r} is not one of {VARIANTS}")


def model_config(args, variant: str):
    from kimi_k3.config import default_model_config

    m = default_model_config()
    m.vocab_size = 256
    m.d_model = args.d_model
    m.num_layers = args.num_layers
    m.pattern = pattern_for(variant, args.num_layers)
    m.num_heads = args.heads
    m.kda.head_dim = args.head_dim
    m.mla.num_heads = args.heads
    m.mla.kv_lora_rank = args.kv_lora_rank
    m.mla.qk_nope_head_dim = args.head_dim
    m.mla.shared_head_dim = args.shared_head_dim
    m.mla.v_head_dim = args.head_dim
    m.mla.attn_block_size = args.attn_block_size
    m.mlp_dim = 3 * args.d_model
    m.dtype = args.dtype
    return m


# ---------------------------------------------------------------------------------------------
# One series (variant, mode), in this process
# ---------------------------------------------------------------------------------------------


def cache_bytes(model, seq_len: int, batch_size: int = 1) -> int:
    """Bytes of ``model.init_cache(batch_size, seq_len)`` (shapes only, nothing allocated)."""
    import jax

    abstract = jax.eval_shape(lambda: model.init_cache(batch_size, seq_len))
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)))


def is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}".lower()
    return any(s in text for s in ("resource_exhausted", "out of memory", "oom", "failed to allocate"))


def peak_bytes_in_use():
    import jax

    stats = jax.devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _xla_bytes(compiled):
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend / version implements it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def time_passes(one_pass, repeats: int, budget_s: float) -> float:
    """Seconds of one pass (compiled ahead: no compilation in it), by benchmarks/timing.py:
    with ``repeats`` > 1 the first pass is a warm-up (it may hold one-time runtime work) and
    the median of up to ``repeats`` - 1 more, each waited for, is returned; no further pass
    starts once ``budget_s`` has passed (then, or with ``repeats`` = 1, one pass is timed)."""
    from benchmarks import timing

    if repeats <= 1:
        return timing.time_jax(one_pass, warmup=0, calls=1, batches=1).seconds
    _, first_s = timing.first_call(one_pass)
    if first_s >= budget_s:
        return first_s
    return timing.time_jax(one_pass, warmup=0, calls=1, batches=repeats - 1,
                           budget_s=budget_s - first_s).seconds


def run_series(args, variant: str, mode: str, emit=print) -> list[dict]:
    """Measure one variant in one mode at every length, in increasing order; stop early on OOM
    or when a pass exceeds ``args.max_seconds``. Emits and returns one row per length tried."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from kimi_k3.eval_scoring import align_cache
    from kimi_k3.model import HybridLM

    cfg = model_config(args, variant)
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    rows = []

    def forward(state, tokens_BxT):
        logits = nnx.merge(graphdef, state)(tokens_BxT)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))  # every logit computed, a scalar out

    def piece(state, tokens_BxP, cache):
        logits, cache = nnx.merge(graphdef, state).prefill(tokens_BxP, cache)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), cache

    rng = np.random.default_rng(0)
    for T in sorted(args.seq_lens):
        row = {"variant": variant, "pattern": cfg.pattern, "mode": mode, "seq_len": T,
               "params": params, "status": "ok", "detail": ""}
        try:
            tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, T)), jnp.int32)
            if mode == "forward":
                compiled = jax.jit(forward).lower(state, tokens).compile()
                row["xla_bytes"] = _xla_bytes(compiled)

                def one_pass(compiled=compiled, tokens=tokens):
                    return compiled(state, tokens)
            else:
                P = min(args.piece_len, T)
                if T % P:
                    raise ValueError(f"--seq_lens: {T} is not a multiple of --piece_len {P}")
                abstract_cache = jax.eval_shape(lambda T=T: model.init_cache(1, T))
                # Feed every piece the cache nested as prefill returns it: one compilation.
                out_cache = jax.eval_shape(piece, state, tokens[:, :P], abstract_cache)[1]
                abstract_cache = align_cache(abstract_cache, out_cache)
                row["cache_bytes"] = cache_bytes(model, T)
                compiled = jax.jit(piece, donate_argnums=(2,)).lower(
                    state, tokens[:, :P], abstract_cache).compile()
                row["xla_bytes"] = _xla_bytes(compiled)

                def one_pass(compiled=compiled, tokens=tokens, T=T, P=P, out_cache=out_cache):
                    cache = align_cache(model.init_cache(1, T), out_cache)
                    out = None
                    for i in range(T // P):
                        out, cache = compiled(state, tokens[:, i * P : (i + 1) * P], cache)
                    return out, cache

            row["seconds"] = time_passes(one_pass, args.repeats, args.max_seconds / 2)
            row["tokens_per_s"] = T / row["seconds"]
            row["peak_bytes"] = peak_bytes_in_use()
            if row["seconds"] > args.max_seconds:
                row["status"] = "too_slow"
                row["detail"] = f"one pass took {row['seconds']:.1f} s > --max_seconds {args.max_seconds}"
        except Exception as err:  # XLA raises its own types for OOM; anything else is reported too
            row["status"] = "oom" if is_oom(err) else "error"
            row["detail"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        rows.append(row)
        emit(RESULT + json.dumps(row))
        if row["status"] != "ok":
            break
    return rows


# ---------------------------------------------------------------------------------------------
# The driver: series in subprocesses (or in process), then CSV, table and plots
# ---------------------------------------------------------------------------------------------


def device_name() -> str:
    import jax

    return f"{jax.devices()[0].device_kind} ({jax.default_backend()}), JAX {jax.__version__}"


def stream_worker(script: str, argv: list[str], on_row, on_device,
                  timeout: float | None = None) -> tuple[int, str]:
    """Run ``python script *argv`` in a fresh process and pass each row it prints (a ``RESULT``
    line) to ``on_row`` and its ``DEVICE`` line to ``on_device`` as soon as they come, so a run
    cut short by a time limit keeps what it measured. The worker's allocator may take 95% of
    the card (JAX's default pool is 75%). Past ``timeout`` seconds the worker is killed.

    Returns (exit code: negative for a signal, -9 when killed; the last line of its stderr).
    """
    import tempfile
    import threading

    cmd = [sys.executable, os.path.abspath(script), *argv]
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=env)
        timer = threading.Timer(timeout, proc.kill) if timeout else None
        if timer:
            timer.start()
        try:
            for line in proc.stdout:
                if line.startswith(RESULT):
                    on_row(json.loads(line[len(RESULT):]))
                elif line.startswith(DEVICE):
                    on_device(line[len(DEVICE):].strip())
            code = proc.wait()
        finally:
            if timer:
                timer.cancel()
        err.seek(0)
        tail = (err.read().strip().splitlines() or [""])[-1]
    return code, tail


def _series_in_subprocess(argv: list[str], variant: str, mode: str, on_row, on_device) -> None:
    """Run one series in a fresh process (``stream_worker``)."""
    done = set()

    def seen(row):
        done.add(row["seq_len"])
        on_row(row)

    code, tail = stream_worker(__file__, [*argv, "--worker", f"--variant={variant}", f"--mode={mode}"],
                               seen, on_device)
    if code != 0:
        print(f"  {variant} {mode}: worker exited with {code}: {tail[:300]}")
        nxt = [T for T in sorted(_lengths(argv)) if T not in done][:1]
        if nxt:  # the length it died on (killed for host memory, say)
            on_row({"variant": variant, "pattern": "", "mode": mode, "seq_len": nxt[0],
                    "status": "oom" if code in (-9, 137) else "error",
                    "detail": f"worker exit code {code}: {tail[:200]}"})


def _lengths(argv):
    return parse_args(argv).seq_lens


def write_csv(path: str, rows: list[dict], fields) -> None:
    """``rows`` as CSV with the columns ``fields`` (a missing or None value: empty)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fields})


def write_outputs(rows: list[dict], out_dir: str, device: str) -> dict[str, str]:
    from kimi_k3 import plots

    os.makedirs(out_dir, exist_ok=True)
    paths = {"csv": os.path.join(out_dir, "long_context_memory.csv"),
             "md": os.path.join(out_dir, "long_context_memory.md"),
             "time_png": os.path.join(out_dir, "long_context_time.png"),
             "memory_png": os.path.join(out_dir, "long_context_memory.png")}
    write_csv(paths["csv"], rows, FIELDS)
    with open(paths["md"], "w") as f:
        f.write(format_table(rows, device) + "\n")

    time_series, mem_series = {}, {}
    for r in rows:
        key = f"{r['variant']} {r['mode']}"
        if r["status"] != "ok":
            continue
        time_series.setdefault(key, ([], []))
        time_series[key][0].append(r["seq_len"])
        time_series[key][1].append(r["seconds"])
        mem = r.get("peak_bytes") or r.get("xla_bytes")
        if mem:
            mem_series.setdefault(key, ([], []))
            mem_series[key][0].append(r["seq_len"])
            mem_series[key][1].append(mem / 2**30)
    measured = any(r.get("peak_bytes") for r in rows)
    mem_label = "peak device memory (GiB)" if measured else "XLA compiled estimate (GiB)"
    if time_series:
        plots.line_plot(paths["time_png"], time_series, title=f"Forward time ({device})",
                        xlabel="sequence length (tokens)", ylabel="seconds per sequence",
                        logx=True, logy=True, token_axis=True)
    if mem_series:
        plots.line_plot(paths["memory_png"], mem_series, title=f"Memory against length ({device})",
                        xlabel="sequence length (tokens)", ylabel=mem_label, logx=True, logy=True,
                        token_axis=True)
    return paths


def gib(x) -> str:
    return "" if not x else f"{x / 2**30:.4g}"


def format_table(rows: list[dict], device: str) -> str:
    lines = [f"device: {device}", "",
             "| variant | mode | tokens | status | time (s) | tokens/s | peak (GiB) | XLA est. (GiB) "
             "| cache (GiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        secs = r.get("seconds")
        tps = r.get("tokens_per_s")
        lines.append(
            f"| {r['variant']} | {r['mode']} | {r['seq_len']} | {r['status']} | "
            f"{'' if secs is None else f'{secs:.4g}'} | {'' if tps is None else f'{tps:.4g}'} | "
            f"{gib(r.get('peak_bytes'))} | {gib(r.get('xla_bytes'))} | {gib(r.get('cache_bytes'))} |"
        )
    return "\n".join(lines)


# The model flags' values under --smoke: CPU toy sizes (2 layers, so 3:1 is "KM").
SMOKE_MODEL = dict(d_model=32, num_layers=2, heads=2, head_dim=16, kv_lora_rank=16, shared_head_dim=8,
                   attn_block_size=16, dtype="float32")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's shape flags, read by ``model_config`` (shared with decode_bench.py)."""
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--num_layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4, help="KDA and MLA heads")
    p.add_argument("--head_dim", type=int, default=128, help="KDA K = V; MLA nope / value dims")
    p.add_argument("--kv_lora_rank", type=int, default=256)
    p.add_argument("--shared_head_dim", type=int, default=64)
    p.add_argument("--attn_block_size", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]
    strs = lambda s: [x for x in s.split(",") if x]
    p.add_argument("--out_dir", default="benchmarks/results/long_context")
    p.add_argument("--seq_lens", type=ints,
                   default=[8192, 32768, 131072, 262144, 524288, 1048576])
    p.add_argument("--variants", type=strs, default=list(VARIANTS))
    p.add_argument("--modes", type=strs, default=list(MODES))
    p.add_argument("--piece_len", type=int, default=8192, help="prefill tokens per call")
    add_model_args(p)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per point (median)")
    p.add_argument("--max_seconds", type=float, default=60.0,
                   help="a series stops after a pass slower than this")
    p.add_argument("--in_process", action=argparse.BooleanOptionalAction, default=False,
                   help="run every series in this process (peak memory then accumulates)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU toy sizes as defaults: 32-64 tokens, d_model 32, 2 layers (so 3:1 is "
                        "'KM'), float32, in process; flags given explicitly still win")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(seq_lens=[32, 64], piece_len=16, repeats=1, in_process=True, **SMOKE_MODEL)
    args = p.parse_args(argv)
    for v in args.variants:
        pattern_for(v, args.num_layers)
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: {m!r} is not one of {MODES}")
    if not args.seq_lens or min(args.seq_lens) < 1:
        p.error(f"--seq_lens: {args.seq_lens} must be positive integers")
    return args


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        print(DEVICE + device_name(), flush=True)
        run_series(args, args.variant, args.mode, emit=lambda s: print(s, flush=True))
        return []
    # With workers, this process never touches the accelerator (it would hold its memory).
    device = [device_name() if args.in_process else "device not yet known"]
    print(f"lengths {args.seq_lens}; variants {args.variants}; modes {args.modes}", flush=True)
    rows = []

    def on_row(r):
        rows.append(r)
        secs = "" if r.get("seconds") is None else f"{r['seconds']:.4g} s"
        peak, est = gib(r.get("peak_bytes")) or "-", gib(r.get("xla_bytes")) or "-"
        print(f"  {r['seq_len']:>8} tokens: {r['status']:<8} {secs:<12} peak {peak} GiB, "
              f"XLA est. {est} GiB {r.get('detail', '')}", flush=True)
        write_outputs(rows, args.out_dir, device[0])  # after every point: a cut-short run keeps it

    def on_device(name):
        if device[0] != name:
            device[0] = name
            print(f"device: {name}", flush=True)

    for variant in args.variants:
        for mode in args.modes:
            print(f"- {variant} {mode} ...", flush=True)
            if args.in_process:
                for r in run_series(args, variant, mode, emit=lambda s: None):
                    on_row(r)
            else:
                _series_in_subprocess(argv, variant, mode, on_row, on_device)
    paths = write_outputs(rows, args.out_dir, device[0]) if rows else {}
    print(format_table(rows, device[0]))
    print("wrote " + ", ".join(paths.values()))
    return rows


if __name__ == "__main__":
    main()
