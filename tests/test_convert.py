"""dsjax.convert against the reference nobody here wrote: `transformers`' own LlamaForCausalLM.

Every model is a tiny random-weight `LlamaForCausalLM` built offline, with unit-scale weights and
randomised norm scales (so a missed transpose, a wrong head order or an ignored norm moves the
logits by O(1), far outside the tolerances), saved with `save_pretrained` as safetensors.
"""

import dataclasses
import json
import os
import pickle
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from conftest import ROOT, load_safetensors_dir
from dsjax import checkpoint as ckpt
from dsjax import config as config_lib
from dsjax import convert
from dsjax.data import SampleStream, eval_batches, load_tokenizer, prepare_text
from dsjax.model import Transformer
from dsjax.model.decoder import abstract_params

hf_logging.disable_progress_bar()
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512)


def save_random_llama(path, seed=0, dtype=torch.float32, max_shard_size="5GB", **overrides):
    """A random LlamaForCausalLM saved as safetensors; returns its transformers config."""
    cfg = LlamaConfig(**{**TINY, **overrides}, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norm scales: far from HF's all-ones init
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:  # unit-scale activations, so the logits are O(1)
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    model.to(dtype).save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return cfg


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def hf_logits(path, tokens):
    with torch.no_grad():
        return hf_model(path)(torch.as_tensor(tokens)).logits.numpy()


def dsjax_params(ckpt_dir, cfg):
    """Params through the same `restore_params` a training run uses."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            nn.unbox(abstract_params(cfg)))
    return ckpt.restore_params(ckpt_dir, abstract, cfg)


def dsjax_logits(params, cfg, tokens):
    return np.asarray(Transformer(cfg).apply({"params": params}, jnp.asarray(tokens)))


def quiet(*_):
    pass


# ---------------------------------------------------------------------------------------------
# Numerics


@pytest.mark.parametrize("overrides, shard", [
    (dict(num_key_value_heads=4), "5GB"),
    (dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=50000.0), "40KB"),
    (dict(head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0), "5GB"),
], ids=["mha", "gqa-8x2-sharded", "head_dim-32"])
# flash in blocks of 32 x 16 over 80 positions: several blocks, a ragged last one (attention.py)
@pytest.mark.parametrize("impl", ["auto", "flash"])
def test_logits_match_transformers(tmp_path, overrides, shard, impl):
    hf_cfg = save_random_llama(tmp_path / "hf", seed=1, max_shard_size=shard, **overrides)
    cfg = convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), log=quiet)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.rope_theta) == (
        hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hf_cfg.head_dim,
        hf_cfg.rope_parameters["rope_theta"])
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 80))  # > 64 positions
    want = hf_logits(tmp_path / "hf", tokens)
    params = dsjax_params(str(tmp_path / "ckpt"), cfg)
    cfg = dataclasses.replace(cfg, attention_impl=impl, attention_block_q=32, attention_block_k=16)
    got = dsjax_logits(params, cfg, tokens)
    assert want.std() > 0.5  # O(1) logits: a wrong mapping cannot hide under the tolerance
    # float32 on both sides; only summation order differs (measured max |diff| ~1e-5).
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def _tensor_bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _write_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=g-import-not-at-top

    vocab = {"<unk>": 0, "hello": 1, "world": 2, "</s>": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(directory, "tokenizer.json"))


@pytest.mark.parametrize("dtype, shard", [("float32", "40KB"), ("bfloat16", "5GB")])
def test_round_trip_is_bit_exact(tmp_path, dtype, shard):
    src, ckpt_dir, out = (str(tmp_path / d) for d in ("hf", "ckpt", "out"))
    torch_dtype = getattr(torch, dtype)
    save_random_llama(src, seed=3, dtype=torch_dtype, max_shard_size=shard, rope_theta=25000.0)
    _write_tokenizer(src)
    convert.hf_to_orbax(src, ckpt_dir, log=quiet)
    tok = load_tokenizer(ckpt_dir)  # the tokenizer travels with the checkpoint
    assert list(tok.encode("hello world")) == [1, 2] and tok.eos_id == 3
    files = convert.orbax_to_hf(ckpt_dir, out, dtype=dtype, max_shard_bytes=40_000, log=quiet)
    assert len(files) > 2 and "model.safetensors.index.json" in files  # sharded on export

    before, after = load_safetensors_dir(src), load_safetensors_dir(out)
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype == torch_dtype, name
        assert torch.equal(_tensor_bits(after[name]), _tensor_bits(t)), name
    with open(os.path.join(out, "tokenizer.json"), "rb") as a, \
            open(os.path.join(src, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch_dtype)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype)
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(loaded.config, key) == getattr(original.config, key), key
    want = original.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(_tensor_bits(t), _tensor_bits(want[name])), name


# The config.json published with deepseek-ai/deepseek-llm-7b-base (transformers 4.33 spelling).
DEEPSEEK_LLM_7B = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 100000, "eos_token_id": 100001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 30, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
    "use_cache": True, "vocab_size": 102400}


def test_deepseek_llm_7b_config_maps_onto_configs_deepseek_7b():
    derived = convert.model_config_from_hf(DEEPSEEK_LLM_7B)
    ours = config_lib.load(os.path.join(ROOT, "configs", "deepseek_7b.py")).model
    convert.check_same_model(derived, ours, "config.json")  # raises naming any difference
    plan = convert.tensor_plan(derived)
    assert len(plan) == 30 * 9 + 3
    assert plan["model.layers.29.self_attn.k_proj.weight"][2] == (4096, 4096)
    assert plan["lm_head.weight"][2] == (102400, 4096)
    # Exported config.json: the source's token ids survive, the math fields read back the same.
    exported = convert.hf_config(derived, "bfloat16", DEEPSEEK_LLM_7B)
    assert convert.model_config_from_hf(exported) == derived
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (100000, 100001)
    assert LlamaConfig.from_dict(exported).rope_parameters["rope_theta"] == 10000.0


# ---------------------------------------------------------------------------------------------
# Bad input: one message naming the tensor / field / file; pickles never loaded


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the converter tried to unpickle")
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


def _edit_weights(directory, edit):
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(directory, **fields):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(path, "w") as f:
        json.dump(cfg, f)


def _pickle_only(directory):
    weights = load_file(os.path.join(directory, "model.safetensors"))
    torch.save(weights, os.path.join(directory, "pytorch_model.bin"))
    os.remove(os.path.join(directory, "model.safetensors"))


def _renamed_pickle(directory):
    _pickle_only(directory)
    os.rename(os.path.join(directory, "pytorch_model.bin"),
              os.path.join(directory, "model.safetensors"))


def _nan(tensors):
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")


BAD_INPUTS = {
    "missing": (lambda d: _edit_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                ["missing tensor model.layers.1.mlp.up_proj.weight"]),
    "unexpected": (lambda d: _edit_weights(d, lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.bias": torch.randn(64)})),
        ["unexpected tensor model.layers.0.self_attn.q_proj.bias"]),
    "shape": (lambda d: _edit_weights(d, lambda t: t.update(
        {"model.layers.1.self_attn.k_proj.weight": torch.randn(64, 64)})),
        ["model.layers.1.self_attn.k_proj.weight", "[64, 64]", "[32, 64]",
         "num_key_value_heads*head_dim"]),
    "nan": (lambda d: _edit_weights(d, _nan), ["model.layers.1.mlp.down_proj.weight", "NaN"]),
    "tied": (lambda d: _edit_config(d, tie_word_embeddings=True), ["tie_word_embeddings"]),
    "rope-scaling": (lambda d: _edit_config(d, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        ["rope_parameters.rope_type", "linear"]),
    "bias": (lambda d: _edit_config(d, attention_bias=True), ["attention_bias"]),
    "arch": (lambda d: _edit_config(d, model_type="mistral"), ["model_type", "mistral"]),
    "pickle": (_pickle_only, ["pytorch_model.bin", "pickle"]),
    "renamed-pickle": (_renamed_pickle, ["model.safetensors", "not a safetensors file"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_naming_the_problem(tmp_path, capsys, no_unpickling, case):
    damage, expected = BAD_INPUTS[case]
    save_random_llama(tmp_path / "hf")
    damage(str(tmp_path / "hf"))
    capsys.readouterr()  # only the converter's own output below
    out = tmp_path / "ckpt"
    rc = convert.main(["hf-to-orbax", "--hf", str(tmp_path / "hf"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("dsjax.convert: error: ") and err.count("\n") == 1, err
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert not out.exists()  # validated before anything was written


def test_dsjax_config_must_match_config_json(tmp_path, capsys):
    save_random_llama(tmp_path / "hf")
    matching = tmp_path / "tiny_hf.py"
    matching.write_text(
        "import runpy\n"
        f"_BASE = runpy.run_path({os.path.join(ROOT, 'configs', 'cpu_tiny.py')!r})\n"
        "def get_config(arg=None):\n"
        "    c = _BASE['get_config']()\n"
        "    c.model.update(dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,\n"
        "                        mlp_dim=128, vocab_size=512))\n"
        "    return c\n")
    args = ["hf-to-orbax", "--hf", str(tmp_path / "hf")]
    capsys.readouterr()
    assert convert.main(args + ["--config", str(matching), "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "0").is_dir()
    rc = convert.main(args + ["--config", os.path.join(ROOT, "configs", "cpu_tiny.py"),
                              "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == 2
    for fragment in ("model.num_layers: the dsjax config has 6", "num_hidden_layers=2",
                     "model.hidden_size", "model.num_heads", "model.mlp_dim"):
        assert fragment in err, (fragment, err)
    assert "model.vocab_size" not in err  # both are 512: only real differences are named


def test_cli_reports_bad_input_in_one_line(tmp_path):
    save_random_llama(tmp_path / "hf")
    _pickle_only(str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, "-m", "dsjax.convert", "hf-to-orbax", "--hf",
                           str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsjax.convert: error: "), proc.stderr
    assert "pytorch_model.bin" in lines[0] and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# A converted checkpoint in the real entry points


def _corpus(tmp_path):
    """A prepared byte-level corpus whose rows pack several documents."""
    rng = np.random.default_rng(4)
    docs = tmp_path / "docs"
    docs.mkdir()
    letters = np.array(list("abcdefgh ijklmnop\nqrstuvwxyz(){}:=_"))
    for i in range(40):
        (docs / f"{i:02d}.txt").write_text("".join(rng.choice(letters, rng.integers(20, 90))))
    prepare_text([str(docs)], "text", "byte", str(tmp_path / "data"), eval_fraction=0.3)
    return str(tmp_path / "data")


def hf_weighted_loss(model, batch):
    """Mean next-token NLL at weighted positions, each packed document run on its own (HF has no
    segment mask; a document alone sees exactly what dsjax's mask lets it see)."""
    total, count = 0.0, 0.0
    with torch.no_grad():
        for r in range(batch["inputs"].shape[0]):
            for s in np.unique(batch["segment_ids"][r]):
                idx = np.flatnonzero(batch["segment_ids"][r] == s)
                logits = model(torch.as_tensor(batch["inputs"][r, idx][None])).logits[0]
                logp = torch.log_softmax(logits.double(), dim=-1).numpy()
                nll = -logp[np.arange(len(idx)), batch["targets"][r, idx]]
                total += float(np.sum(nll * batch["weights"][r, idx]))
                count += float(np.sum(batch["weights"][r, idx]))
    return total / count


RUN = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4,
       "model.num_kv_heads": 2, "model.mlp_dim": 128, "model.vocab_size": 512,
       "data.source": "prepared", "data.seq_len": 32, "data.global_batch": 8,
       "data.eval_batches": 2, "train.steps": 2, "train.log_every": 1, "train.sample_tokens": 2,
       "optim.warmup_steps": 1, "checkpoint.every": 0, "metrics.tensorboard": False}


def test_training_continues_from_a_converted_checkpoint(tmp_path):
    data = _corpus(tmp_path)
    hf_dir, ckpt_dir, workdir = (str(tmp_path / d) for d in ("hf", "ckpt", "run"))
    save_random_llama(hf_dir, seed=5)
    assert convert.main(["hf-to-orbax", "--hf", hf_dir, "--out", ckpt_dir]) == 0
    overrides = {**RUN, "data.path": data, "checkpoint.init_from": ckpt_dir}
    proc = subprocess.run(
        [sys.executable, "launch.py", "--config", "configs/cpu_tiny.py", "--workdir", workdir]
        + [f"--config.{k}={v}" for k, v in overrides.items()],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised weights from" in proc.stdout
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]

    # The run's first batch, rebuilt: same split, seq_len, global batch and seed (train.seed 0).
    batch = SampleStream(os.path.join(data, "train"), 32, 0, prefetch=0).take(8)
    want = hf_weighted_loss(hf_model(hf_dir), batch)
    # float32 forward on both sides; 1e-4 relative leaves ~10x room over summation-order noise.
    assert losses[0] == pytest.approx(want, rel=1e-4)
    assert losses[1] != losses[0]  # and it trained

    # The trained run exports too, straight from its workdir (an optimizer-state checkpoint).
    out = str(tmp_path / "exported")
    assert convert.main(["orbax-to-hf", "--checkpoint", workdir, "--out", out]) == 0
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), overrides).model
    tokens = np.random.default_rng(6).integers(0, 512, (2, 40))
    trained = dsjax_logits(dsjax_params(workdir, cfg), cfg, tokens)
    np.testing.assert_allclose(hf_logits(out, tokens), trained, atol=1e-4, rtol=1e-4)
    assert np.abs(trained - hf_logits(hf_dir, tokens)).max() > 1e-3  # the weights did change


def test_eval_mode_evaluates_a_converted_checkpoint(tmp_path):
    from dsjax import train  # pylint: disable=g-import-not-at-top

    data = _corpus(tmp_path)
    hf_dir, ckpt_dir = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    save_random_llama(hf_dir, seed=7)
    convert.hf_to_orbax(hf_dir, ckpt_dir, log=quiet)
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {**RUN, "data.path": data})
    results = train.run_eval(cfg, ckpt_dir)  # what `launch.py --mode eval --workdir ckpt_dir` runs
    model = hf_model(hf_dir)
    batches = eval_batches(os.path.join(data, "eval"), 32, 8, 2)
    counts = [float(b["weights"].sum()) for b in batches]
    want = sum(hf_weighted_loss(model, b) * c for b, c in zip(batches, counts)) / sum(counts)
    assert results["eval_loss"] == pytest.approx(want, rel=1e-4)  # float32, as above


# ---------------------------------------------------------------------------------------------
# DeepSeek-VL and SigLIP vision towers (dsjax.convert.vision_transfer)

VISION_TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, image_size=16, patch_size=4)


def _randomised(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):  # HF inits LayerNorm/RMSNorm to 1
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


def save_random_vl(path, seed=0, dtype=torch.float32, **overrides):
    """A random DeepseekVLForConditionalGeneration (with SigLIP's unused pooling head) saved as
    safetensors."""
    from transformers import DeepseekVLConfig, DeepseekVLForConditionalGeneration
    cfg = DeepseekVLConfig(vision_config=dict(model_type="siglip_vision_model", **VISION_TINY),
                           text_config=dict(model_type="llama", **TINY), image_token_id=511,
                           **{"tie_word_embeddings": False, **overrides})
    model = _randomised(DeepseekVLForConditionalGeneration(cfg), seed)
    model.to(dtype).save_pretrained(path, safe_serialization=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepseek_vl_round_trip_is_bit_exact(tmp_path, capsys, dtype):
    from transformers import DeepseekVLForConditionalGeneration
    src, ckpt_dir, out = (str(tmp_path / d) for d in ("hf", "ckpt", "out"))
    torch_dtype = getattr(torch, dtype)
    save_random_vl(src, seed=4, dtype=torch_dtype)
    assert convert.main(["hf-to-orbax", "--hf", src, "--out", ckpt_dir]) == 0
    assert "skipping 11 tensors of SigLIP's attention-pooling head" in capsys.readouterr().out
    assert convert.main(["orbax-to-hf", "--checkpoint", ckpt_dir, "--out", out,
                         "--dtype", dtype]) == 0
    before, after = load_safetensors_dir(src), load_safetensors_dir(out)
    head = "model.vision_model.head."
    assert sorted(after) == sorted(n for n in before if not n.startswith(head))
    for name, t in after.items():
        assert t.dtype == before[name].dtype == torch_dtype, name
        assert torch.equal(_tensor_bits(t), _tensor_bits(before[name])), name

    # transformers loads the export and computes what the source computes, images included.
    loaded, original = (DeepseekVLForConditionalGeneration.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager").eval() for d in (out, src))
    assert not loaded.config.vision_config.vision_use_head
    tokens = torch.randint(0, 500, (1, 24))
    tokens[0, 4:20] = 511
    pixels = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        a = loaded(input_ids=tokens, pixel_values=pixels).logits
        b = original(input_ids=tokens, pixel_values=pixels).logits
    assert torch.equal(a, b)


def test_siglip_tower_round_trip_is_bit_exact(tmp_path, capsys):
    from transformers import SiglipVisionConfig, SiglipVisionModel
    src, ckpt_dir, out = (str(tmp_path / d) for d in ("hf", "ckpt", "out"))
    original = _randomised(SiglipVisionModel(SiglipVisionConfig(**VISION_TINY)), 5)
    original.save_pretrained(src, safe_serialization=True)
    assert convert.main(["hf-to-orbax", "--hf", src, "--out", ckpt_dir]) == 0
    assert "attention-pooling head" in capsys.readouterr().out
    assert convert.main(["orbax-to-hf", "--checkpoint", ckpt_dir, "--out", out]) == 0
    before, after = load_safetensors_dir(src), load_safetensors_dir(out)
    assert sorted(after) == sorted(n for n in before if not n.startswith("head."))
    for name, t in after.items():
        assert torch.equal(_tensor_bits(t), _tensor_bits(before[name])), name
    loaded = SiglipVisionModel.from_pretrained(out, dtype=torch.float32).eval()
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(pixels).last_hidden_state, original(pixels).last_hidden_state)


@pytest.mark.parametrize("overrides, fragment", [
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"vision_config": {"model_type": "siglip_vision_model", **VISION_TINY,
                        "hidden_act": "quick_gelu"}}, "vision_config: hidden_act"),
], ids=["tied-head", "activation"])
def test_deepseek_vl_bad_config_fails_naming_the_field(tmp_path, capsys, overrides, fragment):
    src = str(tmp_path / "hf")
    save_random_vl(src)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(overrides)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    assert convert.main(["hf-to-orbax", "--hf", src, "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsjax.convert: error: ") and fragment in err, err
