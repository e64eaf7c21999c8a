"""Spotlight: hashing/scoring on hand-computed cases, training round-trip, fingerprint checks, determinism."""

from __future__ import annotations

import pytest
import torch

from sparsekv import SparseConfig
from sparsekv.config import ConfigError
from sparsekv.kernels.bits import pack_sign_bits
from sparsekv.kernels.hamming import hamming_scores
from sparsekv.selectors.spotlight import (
    LayerHash,
    SpotlightSelector,
    hamming_topk,
    load_checkpoint,
    read_header,
    save_checkpoint,
    softsign,
)
from sparsekv.step import DecodeStep, LayerInfo
from sparsekv.training.loss import ranking_loss
from sparsekv.training.trainer import TrainConfig, train_hash
from tests.helpers import run_chunks


class CharTokenizer:
    """Enough of a tokenizer for the trainer on random-vocab test models."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text, add_special_tokens=False):
        return [3 + (ord(c) * 7) % (self.vocab - 3) for c in text]


TEXT = " ".join(f"word{i % 37} thing{i % 11} and more {i}" for i in range(400))
TINY_CFG = TrainConfig(steps=6, batch_queries=4, random_negatives=16, hard_negatives=4, window=64,
                       train_windows=2, eval_windows=1, eval_queries=16, min_query_position=16,
                       dense_layers=(0,), bits=40)


def tiny_model(shape="tiny-llama", seed=0):
    from sparsekv.models import random_model

    return random_model(shape, dtype=torch.float32, seed=seed)


def linear_hash(weights: torch.Tensor) -> LayerHash:
    """One kv head, identity normalisation, the given [d, bits] hyperplanes."""
    fn = LayerHash(1, weights.shape[0], weights.shape[1], "linear")
    with torch.no_grad():
        fn.w.copy_(weights[None])
    return fn


def test_softsign_and_linear_hash_by_hand():
    assert torch.allclose(softsign(torch.tensor([-1.0, 0.0, 0.5]), 2.0), torch.tensor([-2 / 3, 0.0, 0.5]))
    fn = linear_hash(torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, -1.0]]))  # d=2, 3 bits
    x = torch.tensor([[[2.0, 1.0], [-1.0, 3.0]]])  # [H=1, T=2, d=2]
    out = fn(x, "k")
    assert torch.equal(out, torch.tensor([[[2.0, 1.0, 1.0], [-1.0, 3.0, -4.0]]]))
    codes = pack_sign_bits(out)  # bits 0..2: (+,+,+) -> 0b111, (-,+,-) -> 0b010
    assert codes.flatten().tolist() == [7, 2]


def test_hamming_scores_and_topk_by_hand():
    # query code 0b111 vs keys 0b111, 0b010, 0b110 -> matching bits 3, 1, 2
    q = torch.tensor([7], dtype=torch.int32).view(1, 1, 1, 1)
    k = torch.tensor([7, 2, 6], dtype=torch.int32).view(1, 1, 3, 1)
    scores = hamming_scores(q, k, bits=3)
    assert scores.flatten().tolist() == [3, 1, 2]
    layer = LayerInfo(layer_idx=2, num_layers=4, num_heads=1, num_kv_heads=1, head_dim=2, scaling=1.0)
    visible = torch.ones(1, 1, 3, dtype=torch.bool)

    def step(budget, forced=None):
        return DecodeStep(query=torch.zeros(1, 1, 1, 2), keys=torch.zeros(1, 1, 3, 2), values=torch.zeros(1, 1, 3, 2),
                          visible=visible, forced=torch.zeros_like(visible) if forced is None else forced,
                          budgets=torch.tensor([[budget]]), layer=layer, gqa="group")

    sel = hamming_topk(scores, step(2))
    assert sorted(sel.indices[sel.valid].tolist()) == [0, 2]
    # ties go to the more recent key
    sel = hamming_topk(torch.tensor([[[[2, 2, 1]]]], dtype=torch.int32), step(1))
    assert sel.indices[sel.valid].tolist() == [1]
    # forced tokens always win
    forced = torch.tensor([[[False, True, False]]])
    sel = hamming_topk(scores, step(1, forced))
    assert sel.indices[sel.valid].tolist() == [1]


def test_ranking_loss_prefers_separated_scores():
    pos, neg = torch.tensor([[5.0, 4.0]]), torch.tensor([[0.0, 1.0, 9.0]])
    pv, nv = torch.ones_like(pos, dtype=torch.bool), torch.tensor([[True, True, False]])
    loss = ranking_loss(pos, pv, neg, nv, beta=1.0, alpha=0.0)
    expected = torch.nn.functional.softplus(-torch.tensor([5.0, 4.0, 4.0, 3.0])).mean()
    assert torch.allclose(loss, expected)


def test_selector_query_heads_use_their_kv_head_hash():
    layer = LayerInfo(layer_idx=0, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, scaling=1.0)
    sel = SpotlightSelector(SparseConfig(method="spotlight", dense_layers=(), options={"checkpoint": "none"}), layer)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 5, 8, generator=g)
    query = keys.repeat_interleave(2, dim=1)[:, :, -1:]  # each query head = the last key of its kv head
    sel.prefill(keys, keys, query)
    visible = torch.ones(1, 1, 5, dtype=torch.bool)
    step = DecodeStep(query, keys, keys, visible, torch.zeros_like(visible), torch.tensor([[1]]), layer, "head")
    scores = sel.score(step)
    assert scores.shape == (1, 4, 1, 5)
    assert (scores[..., -1] == sel.code_bits).all()  # identical vectors match on every bit


def test_code_buffer_capacity_is_a_multiple_of_64_keys():
    """The GPU scorer's 16-byte code loads need a row stride of a multiple of 16 words: 64 keys of capacity."""
    layer = LayerInfo(layer_idx=0, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, scaling=1.0)
    sel = SpotlightSelector(SparseConfig(method="spotlight", dense_layers=(), options={"checkpoint": "none"}), layer)
    keys = torch.randn(1, 2, 101, 8, generator=torch.Generator().manual_seed(0))
    sel.prefill(keys, keys, keys[:, :, -1:].repeat_interleave(2, dim=1))
    assert sel._codes.shape[-2] == 128 and sel.key_codes.shape[-2] == 101
    for _ in range(30):
        sel.append(keys[:, :, :1], keys[:, :, :1])
    assert sel._codes.shape[-2] == 256 and sel.key_codes.shape[-2] == 131
    assert torch.equal(sel.key_codes[..., :101, :], sel._hash(keys, "k"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = tmp_path_factory.mktemp("spot") / "hash.safetensors"
    model = tiny_model()
    half = len(TEXT) // 2
    report = train_hash(model, CharTokenizer(model.config.vocab_size), TINY_CFG, path, TEXT[:half], TEXT[half:],
                        show_progress=False)
    return model, path, report


def test_training_writes_a_checkpoint_that_loads(trained):
    model, path, report = trained
    header = read_header(path)
    assert header["layers"] == [1] and header["bits"] == 40 and header["hash"] == "mlp"
    assert header["training"]["steps"] == 6
    assert "iou_group" in report["per_layer"]["1"]
    from sparsekv.fingerprint import model_fingerprint

    assert header["fingerprint"] == model_fingerprint(model)
    ckpt = load_checkpoint(path)
    config = SparseConfig(method="spotlight", budget=0.25, dense_layers=(0,), options={"checkpoint": str(path)})
    SpotlightSelector.check_model(model, config)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    _, recorder = run_chunks(model, config, ids, 24, chunk=8)
    assert recorder.calls
    # the selector used the file's hash: rebuild its key codes by hand
    from sparsekv.cache import SparseCache

    cache = SparseCache.for_model(model, config)
    selector = cache.layers[1].selector
    for name, tensor in ckpt.layers[1].state_dict().items():
        assert torch.allclose(selector.hash_fn.state_dict()[name].float(), tensor)


def test_training_is_deterministic_and_resumes(trained, tmp_path):
    model, path, _ = trained
    half = len(TEXT) // 2
    again = tmp_path / "again.safetensors"
    train_hash(model, CharTokenizer(model.config.vocab_size), TINY_CFG, again, TEXT[:half], TEXT[half:],
               show_progress=False)
    a, b = load_checkpoint(path).layers[1].state_dict(), load_checkpoint(again).layers[1].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    again.unlink()
    report = train_hash(model, CharTokenizer(model.config.vocab_size), TINY_CFG, again, TEXT[:half], TEXT[half:],
                        show_progress=False)
    assert report["resumed_layers"] == [1] and report["trained_layers"] == []
    assert again.is_file()


def test_checkpoint_for_another_model_is_one_config_error(trained):
    _, path, _ = trained
    config = SparseConfig(method="spotlight", dense_layers=(0,), options={"checkpoint": str(path)})
    with pytest.raises(ConfigError, match="another model"):
        SpotlightSelector.check_model(tiny_model(seed=1), config)  # same shape, other weights
    other = tiny_model("tiny-llama-mha")  # other shape: refused when the cache is built
    ids = torch.zeros(1, 30, dtype=torch.long)
    with pytest.raises(ConfigError, match="another model"):
        run_chunks(other, config, ids, 24, chunk=8)


def test_checkpoint_follows_its_model_into_other_dtypes(trained, tmp_path):
    """A hash trained on the float32 model serves the same model in bfloat16 or float16; a file written before
    weight samples (an exact digest of one dtype's weights) still matches its own dtype and says why not others."""
    model, path, _ = trained
    config = SparseConfig(method="spotlight", dense_layers=(0,), options={"checkpoint": str(path)})
    for dtype in (torch.bfloat16, torch.float16):
        SpotlightSelector.check_model(tiny_model().to(dtype), config)
    from sparsekv.fingerprint import _weights_sha256, check_fingerprint

    legacy = {k: v for k, v in read_header(path)["fingerprint"].items() if k != "weights_sample"}
    legacy["weights_sha256"] = _weights_sha256(model)
    check_fingerprint(legacy, model, "old file")
    with pytest.raises(ConfigError, match="weights_sha256"):
        check_fingerprint(legacy, tiny_model(seed=1), "old file")


def test_bad_checkpoint_options(trained, tmp_path):
    _, path, _ = trained
    with pytest.raises(ConfigError, match="does not exist"):
        SparseConfig(method="spotlight", options={"checkpoint": str(tmp_path / "missing.safetensors")})
    with pytest.raises(ConfigError, match="bits"):
        SparseConfig(method="spotlight", options={"checkpoint": str(path), "bits": 64})
    plain = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(plain))
    with pytest.raises(ConfigError, match="not a spotlight checkpoint"):
        SparseConfig(method="spotlight", options={"checkpoint": str(plain)})


def test_auto_on_an_untrained_shape_is_the_seeded_untrained_hash():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    auto = SparseConfig(method="spotlight", budget=0.25, dense_layers=(0,))
    none = SparseConfig(method="spotlight", budget=0.25, dense_layers=(0,), options={"checkpoint": "none"})
    a, _ = run_chunks(model, auto, ids, 24, chunk=8)
    b, _ = run_chunks(model, none, ids, 24, chunk=8)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "shape,layer_idx,shipped",
    [((30, 9, 3, 64), 2, "spotlight-smollm2-135m.safetensors"), ((18, 4, 1, 256), 11, "spotlight-gemma3-270m.safetensors")],
)
def test_auto_picks_the_shipped_hash_of_the_models_shape(shape, layer_idx, shipped):
    """The embedded models' shapes get their shipped hashes (the layer's trained weights, not the seeded ones)."""
    from sparsekv.selectors.spotlight import DATA_DIR, resolve_hash, shipped_checkpoint

    layers, heads, kv_heads, head_dim = shape
    info = LayerInfo(layer_idx=layer_idx, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, scaling=head_dim**-0.5)  # fmt: skip
    path, header = shipped_checkpoint(info)
    assert path == DATA_DIR / shipped and layer_idx in header["layers"]
    auto = resolve_hash(info, "auto", None, None, 0)
    trained = load_checkpoint(path).layers[layer_idx]
    assert all(torch.equal(a, b) for a, b in zip(auto.state_dict().values(), trained.state_dict().values()))
    untrained = resolve_hash(info, "none", None, None, 0)
    assert not torch.equal(next(iter(auto.state_dict().values())), next(iter(untrained.state_dict().values())))


def test_save_keeps_normalisation_in_float32(tmp_path):
    fn = LayerHash(2, 4, 8, "mlp", generator=torch.Generator().manual_seed(0))
    fn.set_normalisation(torch.full((2, 4), 0.1234567), torch.tensor([1.5, 2.5]), torch.tensor([3.0, 4.0]))
    fp = {"num_layers": 3, "num_heads": 2, "num_kv_heads": 2, "head_dim": 4}
    path = save_checkpoint(tmp_path / "h.safetensors", {2: fn}, fp, {"seed": 0})
    loaded = load_checkpoint(path).layers[2]
    assert torch.equal(loaded.key_mean, fn.key_mean)
    assert torch.allclose(loaded.w1, fn.w1.detach(), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_folded_device_hash_equals_layer_hash(kind):
    """The CUDA path hashes through one `sign_hash` kernel with the normalisation folded into the weights; the
    folded weights give the LayerHash's codes (checked with the kernel's torch reference)."""
    from sparsekv.kernels.sign_hash import sign_hash_reference

    layer = LayerInfo(3, 30, 9, 3, 64, 0.125)
    gen = torch.Generator().manual_seed(5)
    config = SparseConfig(method="spotlight", options={"checkpoint": "none", "hash": kind})
    selector = SpotlightSelector(config, layer, checkpoint="none", hash=kind)
    fn = selector.hash_fn
    with torch.no_grad():  # a trained-looking hash: non-zero residual MLP and a real normalisation
        if kind == "mlp":
            fn.w2.normal_(generator=gen)
            fn.b1.normal_(generator=gen)
        fn.set_normalisation(torch.randn(3, 64, generator=gen), torch.rand(3, generator=gen) + 0.5,
                             torch.rand(3, generator=gen) + 0.5)  # fmt: skip
    for role, heads in (("q", 9), ("k", 3)):
        x = torch.randn(2, heads, 5, 64, generator=gen) * 3 + 1
        expected = pack_sign_bits(fn(x.reshape(2, 3, heads // 3 * 5, 64), role)).reshape(2, heads, 5, -1)
        got = sign_hash_reference(x, *selector._folded_weights(role, x.device))
        flipped = sum((v & 0xFFFFFFFF).bit_count() for v in (got ^ expected).flatten().tolist())
        assert flipped <= 2, flipped  # float rounding order only: signs of values within ~1e-6 of zero


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_deferred_key_hash_equals_eager_hash(kind, monkeypatch):
    """On the GPU a decode step's new keys are hashed by the step's query hash (`sign_hash_pair`, one launch).
    The bookkeeping, checked here through the pair's torch reference: codes land in the new keys' slots; reading
    `key_codes`, appending again or a non-fused select hash them the plain way; the codes equal the LayerHash's."""
    layer = LayerInfo(3, 30, 9, 3, 64, 0.125)
    gen = torch.Generator().manual_seed(7)
    config = SparseConfig(method="spotlight", options={"checkpoint": "none", "hash": kind})
    eager, deferred = (SpotlightSelector(config, layer, checkpoint="none", hash=kind) for _ in range(2))
    with torch.no_grad():
        if kind == "mlp":
            eager.hash_fn.w2.normal_(generator=gen)
            eager.hash_fn.b1.normal_(generator=gen)
        eager.hash_fn.set_normalisation(torch.randn(3, 64, generator=gen), torch.rand(3, generator=gen) + 0.5,
                                        torch.rand(3, generator=gen) + 0.5)  # fmt: skip
        deferred.hash_fn.load_state_dict(eager.hash_fn.state_dict())
    monkeypatch.setattr(deferred, "_defers", lambda keys: keys.shape[-2] <= 2)  # the GPU's rule, here on CPU
    keys = torch.randn(2, 3, 40, 64, generator=gen) * 2 + 0.3
    query = torch.randn(2, 9, 1, 64, generator=gen)
    for sel in (eager, deferred):
        sel.prefill(keys[:, :, :30], keys[:, :, :30], query)
    flips = lambda a, b: sum((v & 0xFFFFFFFF).bit_count() for v in (a ^ b).flatten().tolist())
    for t in range(30, 40, 2):
        new = keys[:, :, t : t + 1 if t < 36 else t + 2]  # one new key, then two
        eager.append(new, new)
        deferred.append(new, new)
        assert deferred._pending is new  # not hashed yet
        q_deferred = deferred._query_codes(query)
        assert deferred._pending is None
        assert flips(q_deferred, eager._query_codes(query)) <= 2
        assert flips(deferred._codes[..., : deferred._length, :], eager.key_codes) <= 2
    deferred.append(keys[:, :, :1], keys[:, :, :1])
    assert deferred._pending is not None
    assert torch.equal(deferred.key_codes[..., -1:, :], deferred._hash(keys[:, :, :1], "k"))  # read: hashed
    assert deferred._pending is None


def test_genre_windows_draw_evenly_and_interleave():
    from sparsekv.training.capture import genre_windows

    tok = CharTokenizer(100)
    genres = ["a" * 50, "b" * 50, "c" * 20]
    windows = genre_windows(tok, genres, 10, 7)  # 3 + 2 + 2 windows
    by_genre = [tok.encode(g[:1])[0] for g in genres]
    assert [int(w[0]) for w in windows] == [by_genre[i] for i in (0, 1, 2, 0, 1, 2, 0)]
    assert windows.shape == (7, 10)
    with pytest.raises(ConfigError, match="gives 2 windows of 10 tokens, 3 asked for"):
        genre_windows(tok, genres, 10, 9)
    with pytest.raises(ConfigError, match="no calibration text"):
        genre_windows(tok, [], 10, 1)
    # held-out text gives what it has: "c" has 2 windows of its share of 3
    from sparsekv.training.capture import held_out_windows

    held = held_out_windows(tok, genres, 10, 9)
    assert [int(w[0]) for w in held] == [by_genre[i] for i in (0, 1, 2, 0, 1, 2, 0, 1)]
    assert held_out_windows(tok, ["short"], 10, 2) is None
