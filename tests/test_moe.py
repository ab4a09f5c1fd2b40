"""DeepSeek-V2/V3 (MLA + DeepSeekMoE) against the reference nobody here wrote: `transformers`'
DeepseekV2ForCausalLM / DeepseekV3ForCausalLM, through dsjax.convert in both directions.

Every HF model is tiny and random, built offline, with unit-scale weights, randomised norm scales
and (V3) a randomised correction bias, so a wrong mapping, a wrong RoPE pairing, a wrong group
rule or an ignored bias moves logits by O(1) or changes which experts a token picks.
"""

import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, DeepseekV2Config, DeepseekV2ForCausalLM,
                          DeepseekV3Config, DeepseekV3ForCausalLM)
from transformers.utils import logging as hf_logging

from conftest import load_safetensors_dir
from dsjax import checkpoint as ckpt
from dsjax import convert, sharding
from dsjax.model import Transformer
from dsjax.model.decoder import abstract_params
from dsjax.model.loss import loss_fn
from dsjax.model.moe import MoE, moe_fields, route

hf_logging.disable_progress_bar()

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=12,
              qk_rope_head_dim=8, v_head_dim=10, moe_intermediate_size=20, n_routed_experts=8,
              num_experts_per_tok=3, first_k_dense_replace=1, tie_word_embeddings=False,
              max_position_embeddings=256)
# V2: softmax router, group-limited greedy (4 groups of 2, 2 kept), plain q projection, two
# shared experts, a routed scaling factor that would show if dropped.
V2 = dict(COMMON, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
          n_group=4, topk_group=2, routed_scaling_factor=1.7, norm_topk_prob=False)
# V3: sigmoid router + correction bias, top-2-sum group scores, normalised weights, low-rank q,
# YaRN (factor 4 over a 32-token original context: the ramp lands inside the 4 rotary pairs).
V3 = dict(COMMON, q_lora_rank=16, n_shared_experts=1, n_group=4, topk_group=2,
          routed_scaling_factor=2.5, norm_topk_prob=True,
          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 32, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.6})


def save_random_deepseek(path, version, seed=0, **overrides):
    """A random DeepseekV{2,3}ForCausalLM saved as safetensors; returns the torch model."""
    config_cls, model_cls, base = {2: (DeepseekV2Config, DeepseekV2ForCausalLM, V2),
                                   3: (DeepseekV3Config, DeepseekV3ForCausalLM, V3)}[version]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**base, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm scales: far from HF's all-ones init
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:  # unit-scale activations and O(1) router logits
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # comparable to sigmoid score gaps
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def dsjax_params(ckpt_dir, cfg):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            nn.unbox(abstract_params(cfg)))
    return ckpt.restore_params(ckpt_dir, abstract, cfg)


def quiet(*_):
    pass


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def converted(request, tmp_path_factory):
    """(version, HF dir, torch model, dsjax config, dsjax params) of one random model."""
    version = request.param
    root = tmp_path_factory.mktemp(f"v{version}")
    hf_dir, ckpt_dir = str(root / "hf"), str(root / "ckpt")
    model = save_random_deepseek(hf_dir, version, seed=version)
    cfg = convert.hf_to_orbax(hf_dir, ckpt_dir, log=quiet)
    return version, hf_dir, model, cfg, dsjax_params(ckpt_dir, cfg)


def test_config_maps_every_deepseek_field(converted):
    version, _, model, cfg, _ = converted
    c = model.config
    assert (cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank) == ("mla", c.q_lora_rank or 0,
                                                                  c.kv_lora_rank)
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok,
            cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace) == (8, c.n_shared_experts, 3,
                                                                        4, 2, 1)
    assert cfg.scoring == ("softmax" if version == 2 else "sigmoid")
    assert cfg.rope_scaling == ("none" if version == 2 else "yarn")


@pytest.mark.parametrize("impl", ["auto", "flash"])  # flash: 96 positions in blocks of 32 x 16
def test_logits_match_transformers(converted, impl):
    _, _, model, cfg, params = converted
    cfg = dataclasses.replace(cfg, attention_impl=impl, attention_block_q=32, attention_block_k=16)
    # 96 positions: past YaRN's 32-token original context and its ramp.
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 96))
    with torch.no_grad():
        want = model(torch.as_tensor(tokens)).logits.numpy()
    got = np.asarray(Transformer(cfg).apply({"params": params}, jnp.asarray(tokens)))
    assert want.std() > 0.5  # O(1) logits: a wrong mapping cannot hide under the tolerance
    # float32 on both sides; only summation order differs.
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_router_choices_and_moe_output_match_per_layer(converted):
    """Each MoE layer fed HF's own input: the same expert *sets* per token, the same output."""
    _, _, model, cfg, params = converted
    captured = {}

    def hook(i):
        def fn(module, args, output):
            captured[i] = (args[0].detach().numpy(), output.detach().numpy(),
                           module.gate(args[0])[2].detach().numpy())
        return fn

    moe_layers = range(cfg.first_k_dense_replace, cfg.num_layers)
    handles = [model.model.layers[i].mlp.register_forward_hook(hook(i)) for i in moe_layers]
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 48))
    with torch.no_grad():
        model(torch.as_tensor(tokens))
    for h in handles:
        h.remove()

    block = MoE(**dict(moe_fields(cfg)))
    for i in moe_layers:
        x, want_out, want_experts = captured[i]
        layer = jax.tree.map(lambda a: a[i - cfg.first_k_dense_replace],
                             params["moe_layers"]["moe"])
        got_out, stats = block.apply({"params": layer}, jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(got_out), want_out, atol=1e-4, rtol=1e-4)
        logits = np.asarray(x).reshape(-1, cfg.hidden_size) @ np.asarray(layer["router"])
        got_experts, _, _ = route(jnp.asarray(logits), layer.get("router_bias"),
                                  k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                                  topk_group=cfg.topk_group, scoring=cfg.scoring,
                                  norm_topk_prob=cfg.norm_topk_prob,
                                  scaling=cfg.routed_scaling_factor)
        for t, (g, w) in enumerate(zip(np.asarray(got_experts), want_experts)):
            assert set(g.tolist()) == set(w.tolist()), (i, t)
        assert float(stats["load"].sum()) == x.shape[0] * x.shape[1] * cfg.num_experts_per_tok


@pytest.mark.parametrize("converted", [3], ids=["v3"], indirect=True)  # V2 has no bias
def test_correction_bias_changes_choices(converted):
    """The bias must matter (else the V3 parity above could not catch a dropped bias)."""
    _, _, _, cfg, params = converted
    layer = jax.tree.map(lambda a: a[0], params["moe_layers"]["moe"])
    x = jax.random.normal(jax.random.key(0), (64, cfg.hidden_size))
    kw = dict(k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
              scoring="sigmoid", norm_topk_prob=True, scaling=2.5)
    with_bias = route(x @ layer["router"], layer["router_bias"], **kw)[0]
    without = route(x @ layer["router"], jnp.zeros_like(layer["router_bias"]), **kw)[0]
    assert np.mean(np.sort(with_bias, -1) != np.sort(without, -1)) > 0.05


def test_export_is_bit_exact_and_loads_in_transformers(converted, tmp_path):
    version, hf_dir, model, cfg, _ = converted
    ckpt_dir, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    convert.hf_to_orbax(hf_dir, ckpt_dir, log=quiet)
    convert.orbax_to_hf(ckpt_dir, out, dtype="bfloat16", log=quiet)
    before, after = load_safetensors_dir(hf_dir), load_safetensors_dir(out)
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        if name.endswith("e_score_correction_bias"):
            assert after[name].dtype == torch.float32  # kept float32 whatever --dtype says
            assert torch.equal(after[name], t), name
        else:
            assert after[name].dtype == torch.bfloat16, name
            assert torch.equal(after[name], t.to(torch.bfloat16)), name
    # And float32 export reloads as the same model.
    out32 = str(tmp_path / "out32")
    convert.orbax_to_hf(ckpt_dir, out32, dtype="float32", log=quiet)
    reloaded = hf_model(out32)
    assert type(reloaded).__name__ == f"DeepseekV{version}ForCausalLM"
    tokens = torch.as_tensor(np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 40)))
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(),
                                      hf_model(hf_dir)(tokens).logits.numpy())
    assert convert.model_config_from_hf(convert.hf_config(cfg, "float32")) == cfg


def test_fp8_block_scaled_weights_are_dequantised_on_import(tmp_path):
    """V3's release stores matrices as float8_e4m3fn with one float32 `weight_scale_inv` per
    128x128 block (w = w_fp8 * scale); the MTP module sits in layer num_hidden_layers."""
    hf_dir = str(tmp_path / "hf")
    # 160 > 128: two blocks along D. num_nextn_predict_layers=0: the MTP tensor below is skipped.
    model = save_random_deepseek(hf_dir, 3, seed=5, hidden_size=160, num_attention_heads=4,
                                 num_nextn_predict_layers=0)
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.2.self_attn.q_a_proj.weight"  # [16, 160]
    w = tensors[name]
    scale = torch.tensor([[0.02, 0.05]])  # blocks [0:16, 0:128] and [0:16, 128:160]
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
    tensors[name] = (w / full).to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = scale
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(160, 320)  # MTP: skipped
    save_file(tensors, path, metadata={"format": "pt"})
    said = []
    cfg = convert.hf_to_orbax(hf_dir, str(tmp_path / "ckpt"), log=said.append)
    assert cfg.num_mtp_layers == 0 and any("skipping 1 tensors of MTP modules" in m for m in said)
    params = dsjax_params(str(tmp_path / "ckpt"), cfg)
    want = (tensors[name].to(torch.float32) * full).numpy()
    np.testing.assert_array_equal(np.asarray(params["moe_layers"]["attn"]["q_a"][1]), want.T)
    assert np.abs(want - w.numpy()).max() < 0.1 * np.abs(w.numpy()).max()  # fp8-close
    del model


def test_mtp_modules_convert_both_ways(tmp_path):
    """DeepSeek-V3 stores MTP module k as decoder layer num_hidden_layers + k (enorm, hnorm,
    eh_proj, shared_head.norm, copies of the embedding and head, one MoE block). transformers
    builds none, so its checkpoints import without MTP (said in the log); a dsjax model with MTP
    exports them under those names and imports back bit-exactly, and a copy of the embedding
    that differs from the embedding is refused."""
    hf_dir = str(tmp_path / "hf")
    save_random_deepseek(hf_dir, 3, seed=3)  # config.json: num_nextn_predict_layers=1
    said = []
    cfg = convert.hf_to_orbax(hf_dir, str(tmp_path / "plain"), log=said.append)
    assert any("num_nextn_predict_layers=1 but the weights hold no MTP module" in m
               for m in said), said
    mtp_cfg = dataclasses.replace(cfg, num_mtp_layers=1)
    rng = np.random.default_rng(7)
    params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32),
                          nn.unbox(abstract_params(mtp_cfg)))
    src, out, back = (str(tmp_path / d) for d in ("src", "out", "back"))
    ckpt.save_params(src, params, mtp_cfg)
    convert.orbax_to_hf(src, out, dtype="float32", log=quiet)
    tensors = load_safetensors_dir(out)
    L = cfg.num_layers
    assert tensors[f"model.layers.{L}.eh_proj.weight"].shape == (64, 128)  # [D, 2D]
    np.testing.assert_array_equal(tensors[f"model.layers.{L}.eh_proj.weight"].numpy(),
                                  params["mtp_eh_proj"][0].T)
    np.testing.assert_array_equal(tensors[f"model.layers.{L}.enorm.weight"].numpy(),
                                  params["mtp_enorm"][0])
    np.testing.assert_array_equal(tensors[f"model.layers.{L}.mlp.experts.5.up_proj.weight"]
                                  .numpy(), params["mtp_layers"]["moe"]["up"][0, 5].T)
    assert torch.equal(tensors[f"model.layers.{L}.embed_tokens.weight"],
                       tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors[f"model.layers.{L}.shared_head.head.weight"],
                       tensors["lm_head.weight"])
    assert hf_model(out).config.num_nextn_predict_layers == 1  # transformers loads (and skips)
    got = convert.hf_to_orbax(out, back, log=quiet)
    assert got == mtp_cfg
    restored = jax.device_get(dsjax_params(back, got))
    jax.tree.map(np.testing.assert_array_equal, restored, params)
    # A copy that is not a copy.
    tensors[f"model.layers.{L}.embed_tokens.weight"][0, 0] += 1.0
    path = os.path.join(out, "model.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    with pytest.raises(convert.ConvertError, match=rf"model\.layers\.{L}\.embed_tokens"):
        convert.hf_to_orbax(out, str(tmp_path / "bad"), log=quiet)


# ---------------------------------------------------------------------------------------------
# Training: expert parallelism, the bias update, MTP, the configs


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# configs/cpu_moe.py shrunk: 2 dense-free MoE layers... (1 dense + 2 MoE), 1 MTP module.
MOE_FLAGS = {"model.num_layers": 3, "model.hidden_size": 64, "model.mlp_dim": 128,
             "model.q_lora_rank": 32, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 16,
             "model.qk_rope_head_dim": 8, "model.v_head_dim": 16,
             "model.moe_intermediate_size": 32, "data.seq_len": 32, "data.global_batch": 8,
             "train.steps": 4, "train.log_every": 1, "optim.warmup_steps": 1}


def _trainer(**overrides):
    from dsjax import config as config_lib  # pylint: disable=import-outside-toplevel
    from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel

    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_moe.py"),
                          {**MOE_FLAGS, **overrides})
    return build_trainer(cfg)


def _batch(seed=0):
    from conftest import random_batch  # pylint: disable=import-outside-toplevel
    return random_batch(np.random.default_rng(seed), 8, 32, vocab=512)


def test_expert_parallel_matches_dense_fallback():
    """Experts over `data` (4 devices, all-to-all in shard_map) vs all experts local under GSPMD:
    dropless, so the same losses over two steps (the second after a step through both
    gradients) and the same loads."""
    runs = {}
    for ep in (True, False):
        trainer = _trainer(**{"model.expert_parallel": ep})
        state = trainer.init()
        losses, loads = [], []
        for seed in range(2):
            state, m = trainer.step(state, trainer.device_batch(_batch(seed)))
            losses.append(float(m["loss"]))
            loads.append(np.asarray(m["expert_load"]))
        runs[ep] = losses, loads
    # float32; the two layouts only sum in different orders (measured rel. diff ~1e-7).
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    np.testing.assert_allclose(runs[True][1], runs[False][1], atol=1e-6)
    assert runs[True][0][1] != runs[True][0][0]


def test_expert_parallel_lowers_to_all_to_all():
    trainer = _trainer()
    state = trainer.abstract_state()
    with sharding.activate(trainer.mesh, trainer.rules):
        hlo = trainer.jitted(0).lower(state, trainer.abstract_batch()).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo


def test_bias_update_moves_an_overloaded_expert_down():
    """Expert 0 made to win every token (a large bias): after one step its correction bias is
    exactly gamma lower, the others' moved by gamma toward balance, whatever the optimizer would
    have done to the bias (weight decay, a zero gradient)."""
    trainer = _trainer(**{"model.bias_update_speed": 0.01, "optim.weight_decay": 0.5})
    state = trainer.init()
    params = jax.device_get(state.params)
    before = np.array(params["moe_layers"]["moe"]["router_bias"])
    before[:, 0] = 10.0  # s + b: expert 0 (and its group) first for every token
    params["moe_layers"]["moe"]["router_bias"] = before
    state = state.replace(params=jax.device_put(params, trainer.state_shardings.params))
    state, m = trainer.step(state, trainer.device_batch(_batch()))
    load = np.asarray(m["expert_load"])
    assert (load[:2, 0] == 0.5).all()  # every token's first pick in both MoE layers (4 x 1/8)
    after = np.asarray(jax.device_get(state.params)["moe_layers"]["moe"]["router_bias"])
    step = np.sign(load[:2] - load[:2].mean(axis=1, keepdims=True)) * 0.01
    np.testing.assert_allclose(after, before - step, atol=1e-7)
    assert (after[:, 0] < before[:, 0]).all()


def test_router_bias_gets_no_gradient_and_update_formula():
    from dsjax.model.moe import update_router_bias  # pylint: disable=import-outside-toplevel
    load = jnp.array([[10.0, 2.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0]])
    new = update_router_bias(jnp.zeros((2, 4)), load, 0.001)
    np.testing.assert_allclose(new, [[-0.001, 0.001, 0.001, 0.001], [0, 0, 0, 0]])
    logits = jax.random.normal(jax.random.key(1), (16, 8))
    grad = jax.grad(lambda b: route(logits, b, k=2, n_group=2, topk_group=1, scoring="sigmoid",
                                    norm_topk_prob=True, scaling=2.5)[1].sum())(jnp.zeros(8))
    assert not np.any(np.asarray(grad))


def test_mtp_loss_is_present_weighted_and_dropped_at_eval():
    trainer = _trainer(**{"model.aux_loss_alpha": 0.0})
    state = trainer.init()
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    with sharding.activate(trainer.mesh, trainer.rules):
        nll, _, aux = jax.jit(lambda p: state.objective.loss_and_aux(p, batch))(state.params)
        total, _ = jax.jit(lambda p: loss_fn(p, state.objective, batch))(state.params)
        logits = trainer.eval_model.apply({"params": state.params}, batch["inputs"],
                                          batch["positions"], batch["segment_ids"])
        _, sown = trainer.eval_model.apply({"params": state.params}, batch["inputs"],
                                           batch["positions"], batch["segment_ids"],
                                           mutable=["aux"])
    mtp = np.asarray(aux["mtp_loss"])
    assert mtp.shape == (1,) and abs(float(mtp[0]) - np.log(512)) < 0.5  # ~uniform at init
    assert float(aux["aux_loss"]) == pytest.approx(0.3 * float(mtp[0]), rel=1e-6)
    assert float(total) == pytest.approx(float(nll) + 0.3 * float(mtp[0]), rel=1e-6)
    assert "mtp_loss" not in sown.get("aux", {})  # eval: no targets, MTP modules do not run
    assert logits.shape == (8, 32, 512)


def test_eval_shape_parameter_counts_match_the_published_totals():
    """V2-Lite 15.7B; V3 671B, and 685B as released: + the MTP module, whose checkpoint layer
    also stores its own embedding and output head (dsjax shares the main ones), + the fp8
    release's float32 128x128 block scales of every fp8 matrix (all but embedding, head and
    routers)."""
    import dataclasses  # pylint: disable=import-outside-toplevel
    from dsjax import config as config_lib  # pylint: disable=import-outside-toplevel
    from dsjax.model.decoder import count_params  # pylint: disable=import-outside-toplevel

    lite = config_lib.load(os.path.join(ROOT, "configs", "deepseek_v2_lite.py")).model
    assert count_params(abstract_params(lite)) == 15_706_484_224
    v3 = config_lib.load(os.path.join(ROOT, "configs", "deepseek_v3.py")).model
    main = count_params(abstract_params(dataclasses.replace(v3, num_mtp_layers=0)))
    assert main == 671_026_419_200
    tree = nn.unbox(abstract_params(v3))
    with_mtp = count_params(tree)
    copies = 2 * v3.vocab_size * v3.hidden_size  # the MTP layer's embed_tokens, shared_head.head
    scales = 0
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [p.key for p in path]
        if names[-1] in ("embedding", "lm_head", "router", "router_bias", "scale") or \
                names[0].startswith("mtp_") and names[0] != "mtp_eh_proj":
            continue
        # dsjax [L?, E?, in, ...out] -> HF [out, in] blocks per layer/expert
        lead = 1 + (names[0] in ("layers", "moe_layers", "mtp_layers")) + (
            names[-1] in ("gate", "up", "down") and "moe" in names and "shared" not in names)
        stack = int(np.prod(x.shape[:lead - 1]))
        fan_in, out = x.shape[lead - 1], int(np.prod(x.shape[lead:]))
        scales += stack * -(-fan_in // 128) * -(-out // 128)
    assert round((with_mtp + copies) / 1e9, 1) == 684.5
    assert round((with_mtp + copies + scales) / 1e9) == 685


def test_tiny_moe_config_trains_with_falling_loss_and_logs_expert_load(tmp_path):
    import json  # pylint: disable=import-outside-toplevel
    from dsjax import config as config_lib  # pylint: disable=import-outside-toplevel
    from dsjax import train  # pylint: disable=import-outside-toplevel

    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_moe.py"), {
        "data.seq_len": 64, "data.global_batch": 8, "data.eval_batches": 1,
        "train.steps": 40, "train.log_every": 5, "train.sample_tokens": 2,
        "optim.warmup_steps": 5, "checkpoint.every": 0, "metrics.tensorboard": False,
        "metrics.profile_every": 0, "data.path": str(tmp_path / "data")})
    train.run(cfg, str(tmp_path / "run"))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if '"loss"' in line]
    losses = [r["loss"] for r in records]
    # ln(512) = 6.2 nats at init; measured 3.35 at step 10 and 2.67 at step 40.
    assert losses[-1] < min(losses[0] - 0.5, 3.0), losses
    load = np.asarray(records[-1]["expert_load"])
    assert load.shape == (4, 8)  # 3 MoE layers + the MTP block, 8 experts each
    np.testing.assert_allclose(load.sum(axis=1), 1.0, atol=1e-3)
    assert "mtp_loss" in records[-1] and "aux_loss" in records[-1]


def test_experts_run_fp8_gemms_and_train_with_remat():
    """Experts' (and shared experts') gate/up/down as fp8 einsums (current scaling) with the
    MoE-aware remat policy, experts over `data` with all-to-all: the first loss differs from the
    float32 model's by quantisation only (every block is MoE and only gate/up/down are fp8, so
    the difference is the experts'), and three steps on one batch lower it."""
    flags = {"model.first_k_dense_replace": 0, "fp8.matmuls": "gate,up,down",
             "fp8.other_dtype": "float32"}
    exact = _trainer(**flags)
    fp8_trainer = _trainer(**flags, **{"train.compute_dtype": "fp8",
                                       "remat.policy": "names:moe_routed,kv_latent"})
    batch = _batch(3)
    _, m_exact = exact.step(exact.init(), exact.device_batch(batch))
    state = fp8_trainer.init()
    losses = []
    for _ in range(3):
        state, m = fp8_trainer.step(state, fp8_trainer.device_batch(batch))
        losses.append(float(m["loss"]))
    # Same init (same seed), so the first losses differ by the experts' e4m3 rounding only
    # (a small positive gap); 0 would mean no expert ran in fp8.
    gap = abs(losses[0] - float(m_exact["loss"]))
    assert 0 < gap < 0.05 * float(m_exact["loss"]), (losses[0], float(m_exact["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("expert_parallel, impl", [
    (True, "capacity"), (False, "capacity"), (True, "padded"), (False, "padded")],
    ids=["True", "False", "padded-ep", "padded"])
def test_delayed_fp8_experts_scale_per_expert_like_current_scaling(expert_parallel, impl):
    """Delayed scaling of the routed experts: one amax history per expert and projection
    ([layers, E, ...]). After one observation of a batch is committed, each scale is that
    batch's amax / fp8_max, which current scaling computes from the same tensors; so on that
    batch the delayed model's loss and gradients equal the current-scaling model's, expert by
    expert (one shared scale per projection would not). Experts over `data` (all-to-all
    shard_map) and the dense fallback; the capacity buffers and the padded grouped GEMMs."""
    from dsjax import fp8  # pylint: disable=import-outside-toplevel
    from dsjax.model.loss import loss_fn  # pylint: disable=import-outside-toplevel

    flags = {"model.first_k_dense_replace": 0, "model.expert_parallel": expert_parallel,
             "model.moe_impl": impl,
             "train.compute_dtype": "fp8", "fp8.other_dtype": "float32", "fp8.history_len": 4}
    delayed, current = _trainer(**flags, **{"fp8.recipe": "delayed"}), _trainer(**flags)
    state = delayed.init()
    experts = state.fp8_meta["moe_layers"]["moe"]
    assert sorted(experts) == ["down", "gate", "shared", "up"]  # shared: its own SwiGLU's
    E = delayed.cfg.model.n_routed_experts
    assert experts["up"].amax_history.shape == (3, E, 3, 4)  # [layers, E, (x, w, g), history]
    batch = _batch(5)

    def grads(trainer, objective, meta):
        fn = jax.value_and_grad(lambda p, m, b: loss_fn(p, objective, b, m)[0], (0, 1))
        with sharding.activate(trainer.mesh, trainer.rules):
            return jax.jit(fn)(state.params, meta, trainer.device_batch(batch))

    _, (_, observed) = grads(delayed, state.objective, state.fp8_meta)
    meta = fp8.commit(state.fp8_meta, observed)
    scales = np.asarray(jax.device_get(meta["moe_layers"]["moe"]["up"].scale))  # [L, E, 3]
    assert np.all(scales > 0) and len(np.unique(scales[0, :, 1])) == E  # a scale per expert
    loss_d, (grads_d, _) = grads(delayed, state.objective, meta)
    loss_c, (grads_c, _) = grads(current, current.init().objective, {})
    np.testing.assert_allclose(float(loss_d), float(loss_c), rtol=1e-6)
    for g, r in zip(jax.tree.leaves(jax.device_get(grads_d)), jax.tree.leaves(grads_c)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overrides, field", [
    ({"model.attention": "gqa"}, "model.attention"),
    ({"model.qk_rope_head_dim": 7}, "model.qk_rope_head_dim"),
    ({"model.num_kv_heads": 2}, "model.num_kv_heads"),
    ({"model.rope_scaling": "ntk"}, "model.rope_scaling"),
    ({"model.rope_scaling": "yarn"}, "model.rope_original_max_len"),
    ({"model.scoring": "relu"}, "model.scoring"),
    ({"model.num_experts_per_tok": 9}, "model.num_experts_per_tok"),
    ({"model.n_group": 3}, "model.n_group"),
    ({"model.topk_group": 3}, "model.topk_group"),
    ({"model.first_k_dense_replace": 5}, "model.first_k_dense_replace"),
    ({"model.capacity_factor": -1.0}, "model.capacity_factor"),
    ({"model.n_routed_experts": 6, "model.n_group": 1}, "model.n_routed_experts"),  # 6 over data 4
    ({"optim.name": "onebit_adam", "optim.freeze_step": 1, "model.expert_parallel": False},
     "model.expert_parallel"),  # 1-bit Adam trains experts only where expert parallelism put them
    ({"model.n_routed_experts": 0}, "model.expert_parallel"),
])
def test_invalid_moe_and_mla_values_name_the_field(overrides, field):
    from dsjax import config as config_lib  # pylint: disable=import-outside-toplevel
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.load(os.path.join(ROOT, "configs", "cpu_moe.py"), {**MOE_FLAGS, **overrides})
    assert str(err.value).startswith(field), str(err.value)
