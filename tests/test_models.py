from types import SimpleNamespace

import pytest
import torch

from sparsekv import models
from sparsekv.assets import cache_dir
from sparsekv.models import MODEL_SHAPES, ModelLoadError, chat_prompt, load_model, random_model

TINY = ["tiny-llama", "tiny-llama-mha", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma3", "tiny-phi3"]
REAL = {"llama3-8b": 8.03e9, "qwen2-7b": 7.62e9, "mistral-7b": 7.25e9}  # published parameter counts


@pytest.fixture(scope="module")
def default_model():
    # Uses the user's cache on purpose: the 93 MB download and the conversion happen once per machine.
    return load_model()


@pytest.mark.slow
def test_default_model_shape_and_mode(default_model):
    model, tok = default_model
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert cfg._attn_implementation == "sdpa"
    assert not model.training and model.dtype == torch.float32
    assert tok.pad_token is not None


@pytest.mark.slow
def test_default_model_answers(default_model):
    model, tok = default_model
    prompt = chat_prompt(tok, "What is the capital of France?")
    assert prompt != "What is the capital of France?"  # the chat template was applied
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
    assert answer.strip() and "Paris" in answer


@pytest.mark.slow
def test_second_load_uses_converted_cache(default_model, monkeypatch):
    folder = cache_dir() / "models" / models.DEFAULT_MODEL_DIRNAME
    assert (folder / "config.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the converted cache should have been reused")

    monkeypatch.setattr(models, "_convert_embedded", no_conversion)
    model, _ = load_model(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    ref = default_model[0].model.embed_tokens.weight[:4]
    torch.testing.assert_close(model.model.embed_tokens.weight[:4].float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("shape", TINY)
def test_tiny_models_forward_and_generate(shape):
    model = random_model(shape)
    cfg = model.config
    assert cfg._attn_implementation == "sdpa" and not model.training
    assert cfg.num_key_value_heads <= cfg.num_attention_heads
    ids = torch.randint(3, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert logits.shape == (2, 7, cfg.vocab_size) and torch.isfinite(logits).all()
    assert out.shape == (2, 11)


def test_tiny_shapes_cover_gqa_mha_and_odd_head_dim():
    cfgs = [MODEL_SHAPES[s].config for s in TINY]
    assert any(c["num_key_value_heads"] < c["num_attention_heads"] for c in cfgs)
    assert any(c["num_key_value_heads"] == c["num_attention_heads"] for c in cfgs)
    assert any(c["head_dim"] != 64 for c in cfgs)


def test_random_model_seed_dtype_and_overrides():
    a = random_model("tiny-llama", seed=3)
    b = random_model("tiny-llama", seed=3)
    c = random_model("tiny-llama", seed=4, num_hidden_layers=3, dtype=torch.bfloat16)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert len(c.model.layers) == 3 and c.dtype == torch.bfloat16
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight.float())
    with pytest.raises(ValueError, match="unknown model shape"):
        random_model("gpt-17")


@pytest.mark.parametrize("shape", sorted(REAL))
def test_real_shapes_on_meta(shape):
    model = random_model(shape, dtype=torch.bfloat16, device="meta")
    params = list(model.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)
    n = sum(p.numel() for p in params)
    assert abs(n - REAL[shape]) / REAL[shape] < 0.01


def test_llama3_8b_dims_and_layer_override():
    model = random_model("llama3-8b", num_hidden_layers=2, device="meta")
    cfg = model.config
    assert len(model.model.layers) == 2
    dims = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert dims == (4096, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (14336, 128256, 131072)
    assert cfg.rope_parameters["rope_theta"] == 500000


def test_bad_specs_raise_model_load_error(tmp_path, monkeypatch):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model(missing)

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(bad))

    empty_dir = tmp_path / "empty-model-dir"
    empty_dir.mkdir()
    with pytest.raises(ModelLoadError, match="empty-model-dir"):
        load_model(str(empty_dir))

    # Offline mode makes the hub lookup fail at once instead of after retries.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="sparsekv-test/does-not-exist") as info:
        load_model("sparsekv-test/does-not-exist")
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_chat_prompt_without_template_returns_text():
    assert chat_prompt(SimpleNamespace(chat_template=None), "hello") == "hello"


def test_failed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "asset" / "model.gguf"
    broken.parent.mkdir()
    broken.write_bytes(b"not a gguf")
    import dataclasses

    monkeypatch.setitem(models.EMBEDDED, "default", dataclasses.replace(models.EMBEDDED["default"], gguf=lambda: broken))
    with pytest.raises(ModelLoadError, match="cannot convert the embedded model 'default'"):
        load_model()
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # no half-converted folder to trust later


def test_an_embedded_model_with_a_wrong_tokenizer_is_refused(default_model, monkeypatch):
    """transformers 5.17.0 builds Gemma 3's GGUF tokenizer wrongly (Unigram instead of BPE): the model then reads every
    text as nonsense without an error. A probe text with its known ids catches a tokenizer that splits differently."""
    import dataclasses

    _, tokenizer = default_model
    text = "July 2010What hard liquor"
    right = tuple(tokenizer(text, add_special_tokens=False).input_ids)
    spec = models.EMBEDDED["default"]
    monkeypatch.setitem(models.EMBEDDED, "default", dataclasses.replace(spec, tokenizer_probe=(text, right)))
    assert models._tokenizer_matches("default", tokenizer)
    wrong = dataclasses.replace(spec, tokenizer_probe=(text, right[:-1] + (right[-1] + 1,)))
    monkeypatch.setitem(models.EMBEDDED, "default", wrong)
    with pytest.raises(ModelLoadError, match="wrong tokenizer .* transformers >= 5.18"):
        load_model()
    assert models.EMBEDDED["gemma3-270m"].tokenizer_probe is not None
