r"""Logit parity with transformers' ``KimiLinearForCausalLM``: import, export, both weight layouts.

    python3 -m venv runs/hfvenv && runs/hfvenv/bin/pip install torch "transformers>=5.23" \
        safetensors numpy                                  # once: the torch side's interpreter
    python benchmarks/hf_parity.py --torch_python=runs/hfvenv/bin/python --out_dir=runs/hf_parity
    python benchmarks/hf_parity.py --torch_python=runs/hfvenv/bin/python --out_dir=runs/hf_parity \
        --write_fixtures=tests/fixtures/kimi_linear        # also refresh the CPU test fixtures

``--torch_python`` is an interpreter with torch and transformers (>= 5.23); this one (the
project's) runs the JAX side, so the two exchange files. Per case (``CASES``: tiny random
``KimiLinearConfig``s covering q-LoRA on and off, 0-2 shared experts, renormalisation on and
off, grouped routing, dense first layers, odd sizes):

    1. torch: random weights (norm scales, routing biases, gates perturbed away from their
       init), ``save_pretrained`` (the released layout) and the module layout
       (``state_dict()``, transformers' names), float32 logits with eager attention and the
       plain-torch KDA on random tokens
    2. JAX: ``load_hf_checkpoint`` of each layout -> logits; ``save_hf_checkpoint`` -> export/
    3. torch: ``from_pretrained(export/)`` -> logits
    4. the table: max |ours - theirs| / max |theirs| for each, whether it is under 1e-4, and
       whether greedy decoding of the first row (``kimi_k3.generate``: prefill, then cached
       steps) gives transformers' ``generate()`` tokens

``--memory`` instead measures the importer's host memory (no torch): a random ~290M-parameter
bfloat16 checkpoint written by ``save_hf_checkpoint`` in 3 files with an index, then, in a fresh
process, ``load_hf_checkpoint`` of it while a thread samples the process's anonymous memory
(RssAnon; the memory-mapped files' pages are page cache, not counted): its peak above the
baseline against the bytes of the loaded arrays.

``--write_fixtures`` copies the cases named in ``FIXTURES`` (config.json, model.safetensors,
tokens and logits in logits.npz) for tests/test_hf.py, which checks them without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

TOL = 1e-4
GREEDY_TOKENS = 8  # greedy continuation of the first row, both sides
# name -> (KimiLinearConfig fields, batch, sequence length)
CASES = {
    "qlora_shared1_grouped": (dict(
        vocab_size=61, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=3, kv_lora_rank=10, q_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, num_local_experts=6,
        num_experts_per_tok=2, n_shared_experts=1, n_group=3, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.446, linear_num_heads=3, linear_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], rms_norm_eps=1e-5), 2, 19),
    "noqlora_shared0_norenorm": (dict(
        vocab_size=53, hidden_size=20, intermediate_size=24, moe_intermediate_size=10,
        num_hidden_layers=3, num_attention_heads=5, kv_lora_rank=12, q_lora_rank=None,
        qk_rope_head_dim=2, qk_nope_head_dim=4, v_head_dim=6, num_local_experts=5,
        num_experts_per_tok=3, n_shared_experts=0, n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.5, linear_num_heads=5, linear_head_dim=4,
        linear_conv_kernel_dim=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["sparse", "sparse", "sparse"], rms_norm_eps=1e-6), 1, 70),
    "shared2_dense2_long": (dict(
        vocab_size=97, hidden_size=48, intermediate_size=72, moe_intermediate_size=16,
        num_hidden_layers=5, num_attention_heads=6, kv_lora_rank=24, q_lora_rank=20,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, num_local_experts=8,
        num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.446, linear_num_heads=6, linear_head_dim=12,
        layer_types=["linear_attention", "linear_attention", "linear_attention",
                     "full_attention", "full_attention"],
        mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"]), 2, 150),
    "all_dense_noqlora": (dict(
        vocab_size=40, hidden_size=16, intermediate_size=28, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, linear_num_heads=2, linear_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense"]), 3, 65),
}
FIXTURES = ("qlora_shared1_grouped", "noqlora_shared0_norenorm", "all_dense_noqlora")


# ---------------------------------------------------------------------------------------------
# The torch side (run under --torch_python)
# ---------------------------------------------------------------------------------------------


def _torch_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def torch_make(out_dir: pathlib.Path, names) -> None:
    """Step 1: random checkpoints in both layouts and their logits."""
    import torch
    from safetensors.torch import save_file
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    for i, name in enumerate(names):
        fields, B, T = CASES[name]
        case = out_dir / name
        torch.manual_seed(i)
        # num_key_value_heads must equal the MLA heads (its default is 32).
        fields = {**fields, "num_key_value_heads": fields["num_attention_heads"]}
        cfg = KimiLinearConfig(**fields, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               tie_word_embeddings=False)
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"  # the plain loop over experts (CPU-safe)
        model = KimiLinearForCausalLM(cfg).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):  # scales of 1 would hide a missing scale
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif pname.endswith(("A_log", "dt_bias")):
                    p.add_(0.3 * torch.randn_like(p))
                else:  # weights a little larger than the 0.02 init, so every part shows
                    p.mul_(4.0)
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):  # it chooses experts: test it
                    b.copy_(0.1 * torch.randn_like(b))
        model.save_pretrained(case / "hf")
        (case / "hf_modules").mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(case / "hf_modules" / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(case / "hf" / "config.json", case / "hf_modules" / "config.json")
        rng = np.random.default_rng(100 + i)
        tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int64)
        # Greedy decoding through transformers' caches (recurrent KDA, MLA latents), no stop id.
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            prompt = torch.as_tensor(tokens[:1])
            # An explicit mask: else generate() takes the prompt's pad ids (0) for padding.
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0)
        np.savez(case / "logits.npz", tokens=tokens, logits=_torch_logits(model, tokens),
                 greedy=out[0, T:].numpy())
        print(f"torch: {name} written", flush=True)


def torch_check(out_dir: pathlib.Path, names) -> None:
    """Step 3: transformers loads each export; its logits on the same tokens."""
    from transformers import KimiLinearForCausalLM

    for name in names:
        case = out_dir / name
        model, info = KimiLinearForCausalLM.from_pretrained(
            case / "export", attn_implementation="eager", experts_implementation="eager",
            dtype="float32", output_loading_info=True)
        problems = {k: v for k, v in info.items() if v and k != "error_msgs" or
                    (k == "error_msgs" and v)}
        if problems:
            raise SystemExit(f"{name}: transformers loaded the export with {problems}")
        model.eval()
        tokens = np.load(case / "logits.npz")["tokens"]
        np.savez(case / "export_logits.npz", logits=_torch_logits(model, tokens))
        print(f"torch: {name} export reloaded", flush=True)


# ---------------------------------------------------------------------------------------------
# The JAX side and the driver
# ---------------------------------------------------------------------------------------------


def rel_err(ours, theirs) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float64) - theirs)) / np.max(np.abs(theirs)))


def jax_side(out_dir: pathlib.Path, names) -> dict:
    """Step 2: import both layouts, compare, export."""
    import jax.numpy as jnp

    from benchmarks import timing
    from kimi_k3.generate import generate
    from kimi_k3.hf import load_hf_checkpoint, save_hf_checkpoint

    rows = {}
    for name in names:
        case = out_dir / name
        ref = np.load(case / "logits.npz")
        tokens = jnp.asarray(ref["tokens"], jnp.int32)
        row = {"B x T": "x".join(map(str, ref["tokens"].shape))}
        for layout, folder in (("released", "hf"), ("modules", "hf_modules")):
            with timing.stopwatch() as importing:
                model_config, model = load_hf_checkpoint(case / folder)
                row[f"import {layout}"] = rel_err(model(tokens), ref["logits"])
            row["import s"] = importing.seconds
        # Greedy decoding: our prefill + cached steps against transformers' generate().
        out = generate(model, [ref["tokens"][0].tolist()], GREEDY_TOKENS)
        row["greedy"] = bool(np.array_equal(np.asarray(out.tokens[0]), ref["greedy"]))
        if (case / "export").exists():
            shutil.rmtree(case / "export")
        save_hf_checkpoint(model, model_config, case / "export",
                           extra_config={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
        rows[name] = row
    return rows


MEMORY_CONFIG = {
    "model_type": "kimi_linear", "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 2048, "moe_intermediate_size": 512, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": 256, "q_lora_rank": None,
    "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64, "num_experts": 16,
    "num_experts_per_token": 2, "num_shared_experts": 1, "linear_num_heads": 8,
    "linear_head_dim": 128, "first_k_dense_replace": 1,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
}


def memory_make(out_dir: pathlib.Path) -> None:
    from flax import nnx

    from kimi_k3.hf import model_config_from_hf, save_hf_checkpoint
    from kimi_k3.model import HybridLM

    m = model_config_from_hf(MEMORY_CONFIG, "bfloat16")
    model = nnx.jit(lambda: HybridLM(m, rngs=nnx.Rngs(0)))()
    if (out_dir / "hf").exists():
        shutil.rmtree(out_dir / "hf")
    save_hf_checkpoint(model, m, out_dir / "hf", max_shard_bytes=200 * 2**20)


def memory_load(out_dir: pathlib.Path) -> None:
    import threading

    import jax
    from flax import nnx

    from benchmarks import timing
    from kimi_k3.hf import load_hf_checkpoint

    def anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("RssAnon"))

    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    base = anon()
    thread = threading.Thread(target=watch)
    thread.start()
    with timing.stopwatch() as loading:
        _, model = load_hf_checkpoint(out_dir / "hf", dtype="bfloat16")
        arrays = jax.tree.leaves(nnx.state(model))
        jax.block_until_ready(arrays)
    seconds = loading.seconds
    done.set()
    thread.join()
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    mib = lambda b: b / 2**20
    file_mib = mib(sum(f.stat().st_size for f in (out_dir / "hf").glob("*.safetensors")))
    print(f"| {n_params / 1e6:.0f}M bfloat16, {file_mib:.0f} MiB in "
          f"{len(list((out_dir / 'hf').glob('*.safetensors')))} files | {seconds:.1f} s | "
          f"{mib(sum(x.nbytes for x in arrays)):.0f} MiB | {mib(peak[0] - base):.0f} MiB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch_python", help="an interpreter with torch and transformers")
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--write_fixtures", default="", help="folder for tests' fixtures")
    parser.add_argument("--memory", action="store_true", help="measure the importer's memory")
    parser.add_argument("--side", choices=("driver", "torch_make", "torch_check", "memory_load"),
                        default="driver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: {unknown} are not among {list(CASES)}")
    if args.side == "torch_make":
        return torch_make(out_dir, names)
    if args.side == "torch_check":
        return torch_check(out_dir, names)
    if args.side == "memory_load":
        return memory_load(out_dir)
    if args.memory:
        memory_make(out_dir)
        print("| checkpoint | load_hf_checkpoint | loaded arrays | peak anonymous memory |\n"
              "|---|---|---|---|", flush=True)
        subprocess.run([sys.executable, __file__, "--side=memory_load", f"--out_dir={out_dir}"],
                       check=True)
        return None
    if not args.torch_python:
        parser.error("--torch_python is required (an interpreter with torch and transformers)")

    def torch_step(side):
        subprocess.run([args.torch_python, __file__, f"--side={side}", f"--out_dir={out_dir}",
                        f"--cases={','.join(names)}"], check=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})

    torch_step("torch_make")
    rows = jax_side(out_dir, names)
    torch_step("torch_check")
    ok = True
    lines = ["| case | B x T | import (released) | import (modules) | export -> transformers | "
             f"under 1e-4 | greedy {GREEDY_TOKENS} tokens equal |", "|---|---|---|---|---|---|---|"]
    for name in names:
        row = rows[name]
        ref = np.load(out_dir / name / "logits.npz")["logits"]
        row["export"] = rel_err(np.load(out_dir / name / "export_logits.npz")["logits"], ref)
        good = max(row["import released"], row["import modules"], row["export"]) < TOL
        ok &= good and row["greedy"]
        lines.append(f"| {name} | {row['B x T']} | {row['import released']:.2e} | "
                     f"{row['import modules']:.2e} | {row['export']:.2e} | "
                     f"{'yes' if good else 'NO'} | {'yes' if row['greedy'] else 'NO'} |")
    table = "\n".join(lines)
    print(table)
    (out_dir / "hf_parity.md").write_text(table + "\n")
    (out_dir / "hf_parity.json").write_text(json.dumps(rows, indent=2) + "\n")
    if args.write_fixtures:
        dest = pathlib.Path(args.write_fixtures)
        for name in FIXTURES:
            if name not in names:
                continue
            d = dest / name
            d.mkdir(parents=True, exist_ok=True)
            for file in ("config.json", "model.safetensors"):
                shutil.copy(out_dir / name / "hf" / file, d / file)
            shutil.copy(out_dir / name / "logits.npz", d / "logits.npz")
            print(f"fixture {d} written")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    main()
