"""configs/*.py: each loads, validates, has the documented shapes; K3 through eval_shape."""

from __future__ import annotations

import pytest

from kimi_k3.config import layer_pattern, model_spec
from kimi_k3.config_files import parse_arg
from kimi_k3.model import count_params, flops_per_token
from tests.helpers import CONFIGS as CONFIG_DIR
from tests.helpers import load_config

NAMES = ("tiny", "ablate_ratio", "small", "1b", "k3", "moe_tiny", "moe_1b", "kimi_linear_48b")


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_validates_and_shows_its_command(name):
    config = load_config(f"configs/{name}.py")
    model_spec(config.model)
    doc = (CONFIG_DIR / f"{name}.py").read_text().split('"""')[1]
    assert f"configs/{name}.py" in doc or f"configs.{name}" in doc
    assert "python" in doc


def test_tiny_is_the_cpu_default():
    m = load_config("tiny").model
    assert (m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.kda.head_dim) == (256, 128, 4, 4, 32)
    assert layer_pattern(m) == "KKKM" and m.dtype == "float32"
    assert count_params(m) < 2_000_000


@pytest.mark.parametrize(
    "arg,pattern",
    [
        ("ratio=3,layers=16", "KKKM" * 4),
        ("ratio=0,layers=16", "M" * 16),
        ("ratio=1,layers=16", "KM" * 8),
        ("ratio=7,layers=16", "KKKKKKKM" * 2),
        ("ratio=15", "K" * 15 + "M"),
        ("ratio=3,layers=6,base=tiny", "KKKMKM"),
        ("ratio=all,layers=4,base=tiny", "KKKK"),
        ("ratio=all", "K" * 16),
    ],
)
def test_ablate_ratio_argument_sets_the_pattern(arg, pattern):
    m = load_config(f"configs/ablate_ratio.py:{arg}").model
    model_spec(m)
    assert layer_pattern(m) == pattern


@pytest.mark.parametrize(
    "arg,match",
    [("rato=3", "rato"), ("ratio=three", "ratio='three'.*'all'"), ("ratio=ALL", "ratio"),
     ("ratio", "key=value"), ("base=huge", "base")],
)
def test_ablate_ratio_bad_arguments_name_the_key(arg, match):
    with pytest.raises(ValueError, match=match):
        load_config(f"ablate_ratio.py:{arg}")


def test_ablate_ratio_all_is_every_layer_kda_without_a_final_mla():
    m = load_config("ablate_ratio.py:ratio=all,layers=3,base=tiny").model
    assert (m.final_mla, model_spec(m).pattern) == (False, "KKK")
    other = load_config("ablate_ratio.py:ratio=3,layers=3,base=tiny").model  # only the kinds differ
    assert {k: v for k, v in m.items() if k not in ("kda_per_mla", "final_mla")} == {
        k: v for k, v in other.items() if k not in ("kda_per_mla", "final_mla")}


def test_negative_ratio_is_rejected_naming_the_field():
    m = load_config("ablate_ratio.py:ratio=-1").model
    with pytest.raises(ValueError, match=r"config\.model\.kda_per_mla"):
        model_spec(m)


def test_configs_without_arguments_reject_one():
    for name in ("tiny", "small", "1b", "k3", "moe_tiny", "moe_1b", "kimi_linear_48b"):
        with pytest.raises(ValueError, match=name):
            load_config(f"{name}.py:x=1")
    with pytest.raises(ValueError, match="no config file"):
        load_config("configs/nonexistent.py")
    assert parse_arg(None, {"a": int}) == {}


def test_gpu_configs_have_their_advertised_sizes():
    assert 120e6 < count_params(load_config("small").model) < 180e6
    assert 0.9e9 < count_params(load_config("1b").model) < 1.3e9
    moe = load_config("moe_1b").model
    assert 0.9e9 < count_params(moe, active=True) < 1.2e9 < 4e9 < count_params(moe) < 5e9


def test_moe_tiny_is_tiny_with_three_moe_layers():
    spec = model_spec(load_config("moe_tiny").model)
    assert spec.moe.num_experts == 8 and spec.scan_prefix == "K" and spec.pattern == "KKKM"
    assert count_params(spec, active=True) < count_params(spec) < 2_000_000


def test_k3_shapes_parameter_count_and_flops():
    m = load_config("k3").model
    p = layer_pattern(m)
    assert (len(p), p.count("K"), p.count("M"), p[-1]) == (93, 69, 24, "M")
    assert (m.d_model, m.num_heads, m.kda.head_dim, m.mla.num_heads) == (7168, 96, 128, 96)
    assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.attn_res, m.attn_res_block_size) == (
        1536, 512, "block", 24)
    assert (m.moe.num_experts, m.moe.top_k, m.moe.num_shared) == (896, 16, 2)
    n, active = count_params(m), count_params(m, active=True)  # nnx.eval_shape: no allocation
    # 92 MoE layers of 896 experts of 3 x 7168 x 2048: ~3.6T, of which a token uses 18 experts
    assert 3.5e12 < n < 3.8e12 and 95e9 < active < 115e9
    # Training FLOPs per token: about 6 per active parameter plus attention and KDA.
    assert 6 * (active - 163840 * 7168) < flops_per_token(m, 8192) < 8 * active
