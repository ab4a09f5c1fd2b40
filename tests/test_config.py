"""Configs load, build their abstract model, and every invalid combination names its field."""

import dataclasses
import glob
import os

import jax
import pytest

from conftest import FLAT_MESH, ROOT
from dsjax import config as config_lib
from dsjax import sharding
from dsjax.config import SECTIONS, ConfigError
from dsjax.model.decoder import abstract_params, count_params

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_loads_and_builds_abstract_model(path):
    cfg = config_lib.load(path)
    params = abstract_params(cfg.model)  # eval_shape: the 7B config costs no memory
    assert count_params(params) > 0
    names = jax.tree.leaves(jax.tree.map(lambda p: p.names, params,
                                         is_leaf=lambda x: hasattr(x, "names")))
    assert names, "every parameter must carry logical axis names"


def _dense_llama(V, D, H, N, K, F, L):
    """Embedding and head V x D each, final norm D; per layer q and o D x H*K, k and v D x N*K,
    SwiGLU 3 x D x F, two norms D."""
    return 2 * V * D + D + L * (2 * D * H * K + 2 * D * N * K + 3 * D * F + 2 * D)


def _cpu_moe():
    """configs/cpu_moe.py by hand: D 128, V 512, 4 heads, MLA (q rank 64, kv rank 32, nope 32,
    rope 16, v 32), 1 dense block (F 384), 3 MoE blocks (8 routed + 1 shared expert of width
    96), and one MTP module (a MoE block, a 2D -> D projection and three norms)."""
    D, V, H = 128, 512, 4
    attn = (D * 64 + 64 + 64 * H * (32 + 16)      # q_a, q_norm, q_b
            + D * (32 + 16) + 32 + 32 * H * (32 + 32)  # kv_a (latent + shared rope key), norm, kv_b
            + H * 32 * D)                          # o
    moe = 9 * 3 * D * 96 + D * 8 + 8               # experts, router, router bias
    dense_block = attn + 3 * D * 384 + 2 * D
    moe_block = attn + moe + 2 * D
    mtp = 2 * D * D + 3 * D + moe_block
    return 2 * V * D + D + dense_block + 3 * moe_block + mtp


# The language model's parameters (a VL tower is counted apart), written out by hand so that a
# layer created twice, or a weight left out, changes the count.
PARAM_COUNTS = {
    "cpu_tiny.py": _dense_llama(V=512, D=256, H=8, N=4, K=32, F=832, L=6),
    "cpu_vl.py": _dense_llama(V=512, D=256, H=8, N=4, K=32, F=768, L=4),
    "h100_bf16.py:smoke": _dense_llama(V=512, D=128, H=4, N=4, K=32, F=256, L=2),
    "h100_fp8.py:smoke": _dense_llama(V=512, D=128, H=4, N=4, K=32, F=256, L=2),
    "cpu_moe.py": _cpu_moe(),
}


def test_hand_formulas_give_the_known_counts():
    assert PARAM_COUNTS == {"cpu_tiny.py": 5_278_976, "cpu_vl.py": 3_410_176,
                            "h100_bf16.py:smoke": 459_392, "h100_fp8.py:smoke": 459_392,
                            "cpu_moe.py": 1_900_800}


@pytest.mark.parametrize("name", sorted(PARAM_COUNTS))
def test_small_config_parameter_counts_match_the_hand_count(name):
    cfg = config_lib.load(os.path.join(ROOT, "configs", name))
    assert count_params(abstract_params(cfg.model)) == PARAM_COUNTS[name]


def test_smoke_variant_of_optimized_config_loads():
    cfg = config_lib.load(os.path.join(ROOT, "configs", "h100_fp8.py") + ":smoke")
    assert cfg.mesh.data * cfg.mesh.tensor * cfg.mesh.pipeline == 8


def test_optimized_config_uses_onebit_adam_without_fsdp():
    for arg in ("", ":smoke"):
        cfg = config_lib.load(os.path.join(ROOT, "configs", "h100_fp8.py") + arg)
        assert cfg.optim.name == "onebit_adam" and not cfg.mesh.fsdp
        assert cfg.optim.freeze_step == cfg.train.steps // 5  # 200 of 1000; smoke 4 of 20


def test_fsdp_with_onebit_adam_names_both_fields():
    with pytest.raises(ConfigError, match=r"^mesh\.fsdp: optim\.name='onebit_adam' needs"):
        _tiny(**{"optim.name": "onebit_adam", "mesh.fsdp": True, **FLAT_MESH})


def test_deepseek_7b_parameter_count_is_exact():
    cfg = config_lib.load(os.path.join(ROOT, "configs", "deepseek_7b.py"))
    assert count_params(abstract_params(cfg.model)) == 6_910_365_696


def test_deepseek_67b_parameter_count_is_exact_and_it_pipelines_with_fsdp():
    cfg = config_lib.load(os.path.join(ROOT, "configs", "deepseek_67b.py"))
    # By hand: per layer q and o 8192^2, k and v 8192 x 1024, MLP 3 x 8192 x 22016, 2 norms;
    # x 95, plus embedding and head 102400 x 8192 each and the final norm.
    layer = 2 * 8192 ** 2 + 2 * 8192 * 1024 + 3 * 8192 * 22016 + 2 * 8192
    assert 95 * layer + 2 * 102400 * 8192 + 8192 == 67_425_001_472
    assert count_params(abstract_params(cfg.model)) == 67_425_001_472
    m = cfg.mesh
    assert (m.data, m.tensor, m.pipeline, m.fsdp) == (4, 8, 5, True)  # validated by load


def _tiny(**overrides):
    base = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4,
            "model.num_kv_heads": 2, "model.mlp_dim": 128, "model.vocab_size": 512}
    base.update(overrides)
    return config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), base)


@pytest.mark.parametrize("overrides, field", [
    ({"mesh.data": 4}, "mesh"),  # 4*2*2 != 8 devices
    ({"mesh.tensor": 8, "mesh.data": 1, "mesh.pipeline": 1, "model.num_heads": 12,
      "model.num_kv_heads": 4, "model.hidden_size": 96}, "model.num_heads"),
    ({"mesh.tensor": 4, "mesh.data": 2, "mesh.pipeline": 1, "model.num_kv_heads": 2},
     "model.num_kv_heads"),
    ({"model.mlp_dim": 129}, "model.mlp_dim"),
    ({"model.vocab_size": 257}, "model.vocab_size"),
])
def test_invalid_mesh_combinations_name_the_field(overrides, field):
    # Loading checks what divides over the mesh; making the mesh, the device count.
    with pytest.raises(ConfigError) as err:
        sharding.make_mesh(_tiny(**overrides))
    assert str(err.value).startswith(field), str(err.value)


@pytest.mark.parametrize("overrides, field", [
    ({"data.global_batch": 6}, "data.global_batch"),  # mesh.data 2 x pipeline.microbatches 4
    ({"mesh.pipeline": 4, "mesh.data": 1}, "model.num_layers"),  # 2 layers over 4 stages
    ({"model.num_kv_heads": 3}, "model.num_kv_heads"),      # 4 heads over 3 kv heads
    ({"model.hidden_size": 66}, "model.num_heads"),         # 66 / 4 heads
    ({"model.num_layers": 0}, "model.num_layers"),
    ({"fp8.recipe": "tensorwise"}, "fp8.recipe"),
    ({"fp8.matmuls": "q,k,router"}, "fp8.matmuls"),
    ({"fp8.keep_first_layers": 2, "fp8.keep_last_layers": 1}, "fp8.keep_first_layers"),
    ({"fp8.layers": "8888888"}, "fp8.layers"),  # one word for 2 layers
    ({"fp8.layers": "8888888,88888b8"}, "fp8.layers"),  # b: not a code
    ({"fp8.layers": "8888888,888888"}, "fp8.layers"),  # 6 codes for 7 matmuls
    ({"fp8.layers": "8888888,8888888", "fp8.keep_first_layers": 1}, "fp8.layers"),
    ({"fp8.select": "always"}, "fp8.select"),
    ({"fp8.select": "auto"}, "fp8.select"),  # compute_dtype float32: nothing to choose
    ({"train.compute_dtype": "fp8", "fp8.select": "auto", "fp8.layers": "8888888,8888888"},
     "fp8.layers"),  # auto writes the map itself
    ({"fp8.max_rel_error": 0.0}, "fp8.max_rel_error"),
    ({"fp8.hysteresis": 0}, "fp8.hysteresis"),
    ({"fp8.test_outlier_layer": 2}, "fp8.test_outlier_layer"),  # 2 layers
    ({"fp8.test_outlier_layer": 0}, "fp8.test_outlier_layer"),  # cpu_tiny's pipeline
    ({"train.nonfinite": "ignore"}, "train.nonfinite"),
    ({"train.compute_dtype": "int4"}, "train.compute_dtype"),
    ({"optim.name": "sgd"}, "optim.name"),
    ({"remat.policy": "sometimes"}, "remat.policy"),
    ({"data.source": "web"}, "data.source"),
    ({"optim.lr": -1.0}, "optim.lr"),
    ({"train.steps": 0}, "train.steps"),
    ({"checkpoint.keep": 0}, "checkpoint.keep"),
    ({"optim.name": "onebit_adam", "optim.freeze_step": 0}, "optim.freeze_step"),
    ({"optim.name": "onebit_adam", "optim.freeze_step": 600}, "optim.freeze_step"),  # = steps
    ({"optim.bucket_mb": -1.0}, "optim.bucket_mb"),
    ({"optim.refresh_every": 1}, "optim.refresh_every"),
    ({"optim.name": "onebit_adam", "optim.b1": 0.99}, "optim.update_bound"),  # sqrt(.95) = .975
    # One data-parallel worker: nothing for 1-bit Adam to compress.
    ({"optim.name": "onebit_adam", "mesh.data": 1, "mesh.tensor": 4}, "mesh.data"),
    ({"vision.tiling": True}, "vision.tiling"),  # a text model has nothing to tile
    ({"vision.tower": "siglip", "vision.tiling": True, "vision.max_images": 1},
     "vision.max_images"),  # a tiled image is a global view and at least one tile
    ({"posttrain.recipe": "sft"}, "posttrain.recipe"),
    ({"posttrain.recipe": "pretrain,sft,dpo", "train.task": "sft"}, "train.task"),
    # DPO does not pipeline, and cpu_tiny's mesh does: the recipe's dpo stage fails at load.
    ({"posttrain.recipe": "pretrain,sft,dpo"}, "mesh.pipeline"),
    ({"posttrain.dpo_lr": 0.0}, "posttrain.dpo_lr"),
    ({"data.source": "arithmetic"}, "data.source"),  # a chat task, and cpu_tiny pretrains
    ({"vision.tower": "siglip", "vision.tiling": True, "vision.max_tiles": 0}, "vision.max_tiles"),
])
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        _tiny(**overrides)
    assert str(err.value).startswith(field), str(err.value)


def test_unknown_keys_and_sections_are_rejected():
    path = os.path.join(ROOT, "configs", "cpu_tiny.py")
    import importlib.util
    spec = importlib.util.spec_from_file_location("cpu_tiny_cfg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bad_key = module.get_config()
    bad_key.model.num_layer = 3  # typo of num_layers
    with pytest.raises(ConfigError, match=r"^model\.num_layer: unknown config key.*num_layers"):
        config_lib.from_config_dict(bad_key)
    bad_section = module.get_config()
    bad_section.fp16 = {"enabled": True}
    with pytest.raises(ConfigError, match=r"^fp16: unknown config section"):
        config_lib.from_config_dict(bad_section)


def test_wrong_type_names_the_field():
    raw = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py")).to_dict()
    raw.pop("name")
    raw["train"]["steps"] = "ten"
    with pytest.raises(ConfigError, match=r"^train\.steps: expected an integer"):
        config_lib.from_config_dict(raw)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_field_can_be_overridden_on_the_command_line(path):
    # Config files set only what differs from the dataclass defaults; the rest must still be
    # reachable as --config.SECTION.FIELD (ml_collections rejects keys the ConfigDict lacks).
    overrides = [f"--config.{section}.{field.name}=1" for section, cls in SECTIONS.items()
                 for field in dataclasses.fields(cls)]
    line = config_lib.check_command_line(["--config", path, *overrides, "--workdir=w"], "none.py")
    assert line.config == path
    assert line.argv == [*overrides, "--workdir=w"]  # --config is read here, not again
    cfg = config_lib.load(path)
    assert config_lib.from_config_dict(line.raw, name=cfg.name) == cfg


def test_unknown_override_names_the_key_and_lists_the_valid_ones():
    path = os.path.join(ROOT, "configs", "cpu_tiny.py")
    with pytest.raises(ConfigError, match=r"^train\.stepz: unknown config key 'stepz'; valid: .*steps"):
        config_lib.check_command_line([f"--config={path}", "--config.train.stepz=3"], path)


def test_onebit_freezing_before_the_warmup_ends_is_a_warning_the_run_prints(tmp_path):
    """A warning, not an error: short test runs freeze early on purpose (h100_fp8:smoke)."""
    cfg = _tiny(**{"optim.name": "onebit_adam", "optim.freeze_step": 2, "optim.warmup_steps": 5,
                   "train.steps": 10})
    [line] = config_lib.warnings(cfg)
    assert line.startswith("optim.freeze_step 2 < optim.warmup_steps 5: 1-bit Adam freezes v")
    assert config_lib.warnings(_tiny(**{"optim.name": "onebit_adam", "optim.freeze_step": 5,
                                        "optim.warmup_steps": 5, "train.steps": 10})) == []
    assert config_lib.warnings(_tiny(**{"optim.freeze_step": 2, "optim.warmup_steps": 5})) == []


@pytest.mark.parametrize("name, want", [
    ("cpu_tiny", "runs/cpu_tiny"),
    ("h100_fp8:smoke", "runs/h100_fp8_smoke"),
    ("cpu_tiny:../../etc", "runs/cpu_tiny_etc"),  # an ARG never leaves runs/
    ("x:a/b c", "runs/x_a_b_c"),
    ("..", "runs/run"),
])
def test_the_default_workdir_is_one_safe_directory_under_runs(name, want):
    assert config_lib.default_workdir(name) == want
